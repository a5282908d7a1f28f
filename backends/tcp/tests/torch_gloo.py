"""Helper for gloo_mixed.rs: one torch rank of a mixed gloo group.

usage: torch_gloo.py PORT RANK WORLD SCRIPT

Joins the job through the TCPStore at 127.0.0.1:PORT (as under torchrun:
the agent's store, env:// init), then runs the op script that
gloo_mixed.rs's consort ranks run too, and prints one JSON line: the
result of every step, as lists of numbers.

SCRIPT is JSON: a list of steps {"op", "dtype", "n", ...}; see
gloo_mixed.rs for what each op does. Inputs are a function of (rank,
step, element) that both sides compute the same way.
"""
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = {
    "f32": torch.float32,
    "f64": torch.float64,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i32": torch.int32,
    "i64": torch.int64,
    "u8": torch.uint8,
    "i8": torch.int8,
}
OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
    "avg": dist.ReduceOp.AVG,
}


def data(rank, step, n, dtype, frac=False):
    """Small integers: exact in every dtype, and in every sum of 4 ranks.
    With `frac`, thirds of them (in float32, then the dtype): sums that
    round, so the order of the reduction shows in the bits."""
    i = torch.arange(n, dtype=torch.int64)
    v = (i * 7 + rank * 3 + step * 5) % 11
    if dtype == torch.uint8 or dtype == torch.int8:
        v = v % 5
    if frac:
        return (v.to(torch.float32) / 3.0).to(dtype)
    return v.to(dtype)


def out(t):
    """The values, and the tensor's bytes in hex (compared bit for bit)."""
    raw = bytes(t.contiguous().view(torch.uint8).tolist())
    return [t.to(torch.float64).tolist(), raw.hex()]


def main():
    port, rank, world = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    script = json.loads(sys.argv[4])
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    })
    timeout = float(os.environ.get("TORCH_GLOO_TIMEOUT", "60"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    groups = {}
    results = []
    for step, s in enumerate(script):
        op = s["op"]
        if op == "new_group":
            groups[step] = dist.new_group(s["ranks"])
            results.append(None)
            continue
        group = None
        if "group" in s:
            group = groups[s["group"]]
            if group == dist.GroupMember.NON_GROUP_MEMBER:
                results.append(None)
                continue
        grank = dist.get_rank(group) if group is not None else rank
        gsize = dist.get_world_size(group) if group is not None else world
        dtype = DTYPES[s["dtype"]] if "dtype" in s else None
        n = s.get("n", 0)
        if op == "all_reduce":
            t = data(grank, step, n, dtype, s.get("frac", False))
            dist.all_reduce(t, op=OPS[s["reduce"]], group=group)
            results.append(out(t))
        elif op == "broadcast":
            t = data(grank, step, n, dtype, s.get("frac", False))
            if group is None:
                dist.broadcast(t, src=s["root"])
            else:
                dist.broadcast(t, group_src=s["root"], group=group)
            results.append(out(t))
        elif op == "all_gather":
            t = data(grank, step, n, dtype, s.get("frac", False))
            o = torch.empty(n * gsize, dtype=dtype)
            dist.all_gather_into_tensor(o, t, group=group)
            results.append(out(o))
        elif op == "reduce_scatter":
            t = data(grank, step, n * gsize, dtype, s.get("frac", False))
            o = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(o, t, op=OPS[s["reduce"]], group=group)
            results.append(out(o))
        elif op == "reduce":
            t = data(grank, step, n, dtype, s.get("frac", False))
            root = s["root"]
            dist.reduce(t, dst=root, op=OPS[s["reduce"]])
            results.append(out(t) if grank == root else None)
        elif op == "gather":
            t = data(grank, step, n, dtype, s.get("frac", False))
            root = s["root"]
            parts = [torch.empty(n, dtype=dtype) for _ in range(gsize)] if grank == root else None
            dist.gather(t, parts, dst=root)
            results.append(out(torch.cat(parts)) if grank == root else None)
        elif op == "scatter":
            root = s["root"]
            whole = data(grank, step, n * gsize, dtype, s.get("frac", False))
            o = torch.empty(n, dtype=dtype)
            dist.scatter(o, list(whole.chunk(gsize)) if grank == root else None, src=root)
            results.append(out(o))
        elif op == "all_to_all":
            t = data(grank, step, n * gsize, dtype, s.get("frac", False))
            o = torch.empty(n * gsize, dtype=dtype)
            dist.all_to_all_single(o, t)
            results.append(out(o))
        elif op == "barrier":
            dist.barrier(group=group)
            results.append([[], ""])
        elif op == "send_recv":
            # A ring: send to the next rank, receive from the previous one.
            t = data(grank, step, n, dtype, s.get("frac", False))
            r = torch.empty(n, dtype=dtype)
            nxt, prv = (rank + 1) % world, (rank + world - 1) % world
            if rank % 2 == 0:
                dist.send(t, nxt, tag=s["tag"])
                dist.recv(r, prv, tag=s["tag"])
            else:
                dist.recv(r, prv, tag=s["tag"])
                dist.send(t, nxt, tag=s["tag"])
            results.append(out(r))
        else:
            raise SystemExit(f"unknown op {op}")
    print(json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
