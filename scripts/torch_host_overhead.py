"""torch's host time per all_reduce, the anchor for consort's.

One process (world 1), a tensor on the GPU, `dist.all_reduce` timed call by
call on the host (the GPU is not waited for between calls, as in consort's
`bench_host_overhead_per_call`, gpu-check step 2): what ProcessGroupNCCL's
own bookkeeping costs per call (its events, stream waits and work objects)
on top of NCCL's entry point. Prints one row per size:

    torch host us/call, <backend>, <bytes> B: mean M / median D

Usage (gpu-check step 6 runs it):

    python3 scripts/torch_host_overhead.py [--backend nccl|gloo] [--device cuda|cpu]

`--backend gloo --device cpu` runs the same loop without a GPU, to check
the script itself.
"""

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--sizes", default="4,4096,131072,268435456")
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group(a.backend, rank=0, world_size=1)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for size in (int(s) for s in a.sizes.split(",")):
        x = torch.zeros(max(size // 4, 1), dtype=torch.float32, device=dev)
        for _ in range(20):  # the communicator is made at the first call
            dist.all_reduce(x)
        sync()
        each = []
        for _ in range(a.iters):
            t = time.perf_counter_ns()
            dist.all_reduce(x)
            each.append((time.perf_counter_ns() - t) / 1e3)
        sync()
        print(
            f"torch host us/call, {a.backend}, {size} B: "
            f"mean {statistics.fmean(each):.2f} / median {statistics.median(each):.2f}"
        )
        del x
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
