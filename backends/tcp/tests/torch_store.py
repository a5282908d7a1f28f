"""Helper for torch_interop.rs: runs torch's own TCPStore against ours.

usage: torch_store.py client PORT   -- torch client against our server
       torch_store.py server        -- torch server; prints its port
"""
import json
import sys
from datetime import timedelta

import torch.distributed as dist


def client(port):
    s = dist.TCPStore("127.0.0.1", port, is_master=False,
                      timeout=timedelta(seconds=10), wait_for_workers=False)
    out = {}
    s.set("t/alpha", b"one")
    out["get"] = s.get("t/alpha").decode()
    out["add1"] = s.add("t/n", 5)
    out["add2"] = s.add("t/n", -2)
    out["cas_ok"] = s.compare_set("t/alpha", b"one", b"two").decode()
    out["cas_miss"] = s.compare_set("t/alpha", b"nope", b"x").decode()
    out["check"] = s.check(["t/alpha", "t/n"])
    out["check_missing"] = s.check(["t/absent"])
    s.multi_set(["t/k1", "t/k2"], [b"v1", b"v2"])
    out["multi_get"] = [v.decode() for v in s.multi_get(["t/k1", "t/k2"])]
    s.append("t/k1", b"+tail")
    out["appended"] = s.get("t/k1").decode()
    out["delete"] = s.delete_key("t/k2")
    out["delete_again"] = s.delete_key("t/k2")
    try:
        s.wait(["t/never"], timedelta(milliseconds=200))
        out["wait_timeout"] = False
    except Exception:  # torch raises DistStoreError
        out["wait_timeout"] = True
    # the connection still works after a cancelled wait
    out["after_timeout"] = s.get("t/alpha").decode()
    # torch 2.15's whole client API: queues, list_keys (17), barrier (18)
    s.queue_push("t/q", b"q1")
    s.queue_push("t/q", b"q2")
    out["queue_len"] = s.queue_len("t/q")
    out["queue_pop"] = [s.queue_pop("t/q", block=True).decode(),
                        s.queue_pop("t/q", block=False).decode()]
    try:
        s.queue_pop("t/q", block=False)
        out["queue_empty"] = False
    except Exception:
        out["queue_empty"] = True
    out["num_keys"] = s.num_keys()
    out["list_keys"] = sorted(s.list_keys())
    s.barrier("t/bar1", 1)
    try:
        s.barrier("t/bar2", 2, timedelta(milliseconds=300))
        out["barrier_timeout"] = False
    except Exception:
        out["barrier_timeout"] = True
    out["after_barrier"] = s.get("t/bar2").decode()
    # a key the Rust side sets while we block
    s.set("t/torch_ready", b"1")
    out["from_rust"] = s.get("t/from_rust").decode()
    print(json.dumps(out), flush=True)


def server():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True,
                      timeout=timedelta(seconds=20), wait_for_workers=False)
    print(s.port, flush=True)
    s.wait(["r/from_rust"])
    print(json.dumps({"from_rust": s.get("r/from_rust").decode(),
                      "counter": s.get("r/n").decode()}), flush=True)
    s.set("r/from_torch", b"hello from torch")
    # a barrier of two with the Rust side
    s.barrier("r/bar", 2)
    s.wait(["r/done"])


if __name__ == "__main__":
    if sys.argv[1] == "client":
        client(int(sys.argv[2]))
    else:
        server()
