#!/usr/bin/env python3
"""torch's anchor for `consort bench sharded`: the same synthetic model, in
the same layout, under DDP and FSDP2's `fully_shard`, one step timed as
consort times it (the median of --iters after one warm-up; each step's time
is the slowest rank's).

The model: --params f32 parameters in --layers equal layers, one wrapping
unit each; each layer's backward computes its gradient elementwise with
--work multiply-adds per element (`x = p + bias; x = x * 0.999 + 0.001`
repeated), last layer first, as consort's synthetic backward does; then
AdamW (lr 1e-3). On CUDA that backward is one elementwise kernel per
layer, as consort's NVRTC kernel is (torch's jiterator, checked against
the plain loop first); where jiterator is missing or disagrees, the loop of
2·work+1 kernels runs instead and the `kernel` column says so. Run under torchrun (or `consort run`, which sets the same
variables):

    torchrun --nproc-per-node 2 scripts/torch_sharded_bench.py              # gloo, CPU
    torchrun --nproc-per-node 2 scripts/torch_sharded_bench.py --device cuda  # nccl
    torchrun --nproc-per-node 2 scripts/torch_sharded_bench.py --device cuda --share-gpu
    torchrun --nproc-per-node 2 scripts/torch_sharded_bench.py --device cuda --mixed bf16

Prints one row per strategy on rank 0 (step ms and the peak memory of the
device, on CUDA); --json prints JSON objects instead.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn


def loop_backward(p, work, bias):
    """The synthetic gradient as torch ops: 2·work+1 elementwise kernels."""
    g = p + bias
    for _ in range(work):
        g = g * 0.999 + 0.001
    return g


def fused_backward(work, bias):
    """The synthetic gradient as one CUDA kernel (jiterator), computed in f32
    as consort's kernel is; None where jiterator is missing or disagrees
    with the loop."""
    try:
        from torch.cuda.jiterator import _create_jit_fn

        code = (
            "template <typename T> T synthetic_backward(T p) {"
            f" float x = static_cast<float>(p) + {float(bias)!r}f;"
            f" for (int k = 0; k < {int(work)}; k++) x = x * 0.999f + 0.001f;"
            " return static_cast<T>(x); }"
        )
        fn = _create_jit_fn(code)
        p = torch.linspace(-1, 1, 4099, device="cuda")
        if torch.allclose(fn(p), loop_backward(p, work, bias), rtol=1e-5, atol=1e-6):
            return fn
        print("jiterator's synthetic backward disagrees with the loop: using the loop")
    except Exception as e:  # an old torch, or no NVRTC
        print(f"no jiterator ({e}): the synthetic backward runs as a loop of kernels")
    return None


class Synthetic(torch.autograd.Function):
    """Forward passes `x` on; backward gives `p` its synthetic gradient."""

    @staticmethod
    def forward(ctx, p, x, work, bias, fused):
        ctx.save_for_backward(p)
        ctx.work, ctx.bias, ctx.fused = work, bias, fused
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (p,) = ctx.saved_tensors
        if ctx.fused is not None and p.is_cuda:
            g = ctx.fused(p)
        else:
            g = loop_backward(p, ctx.work, ctx.bias)
        return g, grad, None, None, None


class Layer(nn.Module):
    def __init__(self, n, work, bias, fused):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        self.work, self.bias, self.fused = work, bias, fused

    def forward(self, x):
        return Synthetic.apply(self.weight, x, self.work, self.bias, self.fused)


class Model(nn.Module):
    def __init__(self, params, layers, work, bias, fused=None):
        super().__init__()
        self.layers = nn.ModuleList(
            Layer(params // layers, work, bias, fused) for _ in range(layers)
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def time_steps(model, device, iters):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    x = torch.ones(1, device=device, requires_grad=True)
    for it in range(iters + 1):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        model(x).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = torch.tensor([(time.perf_counter() - t) * 1e3], dtype=torch.float64)
        if device.type == "cuda":
            ms = ms.to(device)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        if it > 0:
            times.append(ms.item())
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=4_000_000)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--work", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--mixed",
        default="none",
        choices=["none", "bf16", "f16"],
        help="FSDP2's MixedPrecisionPolicy (param and reduce dtype); DDP stays f32",
    )
    ap.add_argument(
        "--share-gpu",
        action="store_true",
        help="every rank on GPU 0 (NCCL < 2.30 then needs a host id per rank over sockets)",
    )
    a = ap.parse_args()
    cuda = a.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if a.share_gpu:
        os.environ.setdefault("NCCL_HOSTID", f"h-{local}")
        os.environ.setdefault("NCCL_NET", "Socket")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        local = 0
    if cuda:
        torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    bias = rank * 1e-3
    fused = fused_backward(a.work, bias) if cuda else None
    rows = []
    base = None
    for strategy in ("ddp", "fsdp"):
        model = Model(a.params, a.layers, a.work, bias, fused).to(device)
        if strategy == "ddp":
            wrapped = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = torch.distributed.device_mesh.init_device_mesh(a.device, (world,))
            dt = {"bf16": torch.bfloat16, "f16": torch.float16}.get(a.mixed)
            mp = MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=dt)
            for layer in model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            wrapped = fully_shard(model, mesh=mesh, mp_policy=mp)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        ms = time_steps(wrapped, device, a.iters)
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
        base = base or ms
        rows.append(
            {
                "backend": "torch-nccl" if cuda else "torch-gloo",
                "world": world,
                "params": a.params,
                "strategy": strategy if a.mixed == "none" or strategy == "ddp" else f"{strategy}+{a.mixed}",
                "step_ms": round(ms, 2),
                "vs_ddp": round(ms / base, 2),
                "peak_mib": round(peak, 1),
                "kernel": "fused" if fused is not None else "loop",
            }
        )
        del wrapped, model
    if rank == 0:
        if a.json:
            for r in rows:
                print(json.dumps(r))
        else:
            print(f"{'backend':>10} {'world':>5} {'params':>8} {'strategy':>10} {'step_ms':>8} {'vs_ddp':>6} {'peak_mib':>8} {'kernel':>6}")
            for r in rows:
                print(
                    f"{r['backend']:>10} {r['world']:>5} {r['params']:>8} {r['strategy']:>10} "
                    f"{r['step_ms']:>8} {r['vs_ddp']:>6} {r['peak_mib']:>8} {r['kernel']:>6}"
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
