"""Helper for torch_interop.rs: runs torch's own TCPStore against ours.

usage: torch_store.py client PORT   -- torch client against our server
       torch_store.py server        -- torch server; prints its port
       torch_store.py api PORT      -- torch's whole client API, as JSON
       torch_store.py api-master    -- the same against torch's own server
       torch_store.py full PORT     -- a torch client on a store filled to
                                       its limit: read, delete, write
"""
import json
import sys
import threading
import time
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


def api(port):
    """torch's whole client API from two clients (threads for the calls
    that block), printed as JSON: run against our server and against
    torch's own, the two outputs must be equal."""
    def mk():
        return dist.TCPStore("127.0.0.1", port, is_master=False,
                             timeout=timedelta(seconds=10), wait_for_workers=False)

    def raised(f):
        try:
            f()
            return False
        except Exception:  # torch raises DistStoreError
            return True

    a, b = mk(), mk()
    n0 = a.num_keys()
    out = {}
    a.set("api/x", b"1")
    a.multi_set(["api/m1", "api/m2", "api/m3"], [b"v1", b"", b"v3"])
    out["multi_get"] = [v.decode() for v in b.multi_get(["api/m3", "api/m1", "api/m2", "api/x"])]
    out["compare_set"] = [a.compare_set("api/cas", b"", b"first").decode(),
                          a.compare_set("api/cas", b"first", b"second").decode(),
                          b.compare_set("api/cas", b"nope", b"third").decode(),
                          b.compare_set("api/absent", b"exp", b"des").decode(),
                          b.get("api/cas").decode()]
    # APPEND has no reply: a round trip orders it before b's
    a.append("api/log", b"a")
    a.check(["api/log"])
    b.append("api/log", b"b")
    out["append"] = b.get("api/log").decode()
    out["check"] = [a.check(["api/x", "api/log"]), a.check(["api/x", "api/none"])]
    out["add"] = [a.add("api/n", 5), b.add("api/n", -2), a.add("api/n", 0)]
    out["delete_key"] = [a.delete_key("api/m2"), b.delete_key("api/m2"), b.check(["api/m2"])]
    a.queue_push("api/q", b"q1")
    a.queue_push("api/q", b"q2")
    # torch's queue_push waits for no reply: a round trip on a's own
    # connection (served in order) makes sure both are in before b looks.
    a.check(["api/q"])
    out["queue"] = [b.queue_len("api/q"), b.check(["api/q"]),
                    b.queue_pop("api/q", block=False).decode(),
                    b.queue_pop("api/q", block=True).decode(),
                    b.queue_len("api/q"), b.check(["api/q"]),
                    raised(lambda: b.queue_pop("api/q", block=False))]
    # a blocking pop, woken by the other client's push
    got = {}
    t = threading.Thread(target=lambda: got.update(v=b.queue_pop("api/q2", block=True)))
    t.start()
    time.sleep(0.3)
    waited = t.is_alive()
    a.queue_push("api/q2", b"late")
    t.join(10)
    out["blocking_pop"] = [waited, got.get("v", b"?").decode()]
    # the map's keys, not the queues'
    out["list_keys"] = sorted(k for k in a.list_keys() if "api/" in k)
    out["num_keys"] = a.num_keys() - n0
    # barriers of one, and of two across both clients
    a.barrier("api/b1", 1)
    done = {}
    t = threading.Thread(target=lambda: (a.barrier("api/b2", 2, timedelta(seconds=10)),
                                         done.update(a=True)))
    t.start()
    time.sleep(0.3)
    waited = t.is_alive()
    b.barrier("api/b2", 2, timedelta(seconds=10))
    t.join(10)
    out["barrier"] = [a.get("api/b1").decode(), waited, done.get("a", False),
                      a.get("api/b2").decode()]
    # a barrier that times out, then retries: the timed-out arrival still
    # counts, and the connection stays usable
    out["barrier_retry"] = [raised(lambda: a.barrier("api/b3", 2, timedelta(milliseconds=300))),
                            a.get("api/b3").decode()]
    a.barrier("api/b3", 2, timedelta(seconds=10))
    b.barrier("api/b3", 2, timedelta(seconds=10))
    out["barrier_retry"].append(b.get("api/b3").decode())
    # a wait that times out, then the key comes
    out["wait"] = [raised(lambda: a.wait(["api/late"], timedelta(milliseconds=200)))]
    b.set("api/late", b"L")
    a.wait(["api/late"], timedelta(seconds=10))
    out["wait"].append(a.get("api/late").decode())
    print(json.dumps(out, sort_keys=True), flush=True)


def api_master():
    m = dist.TCPStore("127.0.0.1", 0, is_master=True,
                      timeout=timedelta(seconds=20), wait_for_workers=False)
    api(m.port)


def full(port):
    """A torch client on a store another client filled to its limit and
    left: connects, reads, deletes four 1 MiB values, writes 1 MiB."""
    t = time.time()
    s = dist.TCPStore("127.0.0.1", port, is_master=False,
                      timeout=timedelta(seconds=20), wait_for_workers=False)
    out = {"connect_ms": (time.time() - t) * 1e3}
    out["before"] = s.get("before").decode()
    out["check"] = s.check(["before", "fill-1048576-0"])
    out["deleted"] = [s.delete_key("fill-1048576-%d" % i) for i in range(4)]
    s.set("after", b"x" * (1 << 20))
    out["after"] = len(s.get("after"))
    out["ms"] = (time.time() - t) * 1e3
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "client":
        client(int(sys.argv[2]))
    elif sys.argv[1] == "api":
        api(int(sys.argv[2]))
    elif sys.argv[1] == "api-master":
        api_master()
    elif sys.argv[1] == "full":
        full(int(sys.argv[2]))
    else:
        server()
