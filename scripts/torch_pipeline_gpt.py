"""torch's pipelining on the GPT example's model shape, gloo on CPU: the
anchor for `examples/gpt --pp N` (the guide: consort::manual::pipeline).

The same shape as consort/examples/gpt: 13-token vocabulary, context 32,
d_model 64, 4 heads, pre-norm blocks with a GELU MLP of 4 x d_model, a
final norm and a linear head, cross entropy; Adam at 3e-3; blocks shared
out over the stages in order, stage 0 embeds, the last stage has the head.
Batches are random tokens (this measures time and memory, not learning).
Prints, from the last stage: the median step time after 5 warm-up steps
and this process's peak RSS; every rank prints its peak RSS.

Usage: torchrun --standalone --nproc-per-node PP scripts/torch_pipeline_gpt.py \
           [--steps 60] [--batch-size 16] [--microbatches 4] [--layers 4] [--schedule 1F1B]
"""
import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--microbatches", type=int, default=4)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--schedule", default="1F1B")
a = p.parse_args()
V, C, D, H = 13, 32, 64, 4

dist.init_process_group("gloo")
rank, pp = dist.get_rank(), dist.get_world_size()
torch.manual_seed(42)


class Part(nn.Module):
    def __init__(self, first, last, blocks):
        super().__init__()
        self.tokens = nn.Embedding(V, D) if first else None
        self.positions = nn.Embedding(C, D) if first else None
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(D, H, 4 * D, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(blocks))
        self.norm = nn.LayerNorm(D) if last else None
        self.head = nn.Linear(D, V) if last else None
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(C), persistent=False)

    def forward(self, x):
        if self.tokens is not None:
            pos = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
            x = self.tokens(x) + self.positions(pos)
        for b in self.blocks:
            x = b(x, src_mask=self.mask, is_causal=True)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


single = get_schedule_class(a.schedule).__name__ in ("ScheduleGPipe", "Schedule1F1B")
spr = 1 if single else 2
stages = pp * spr
mine = [s for s in range(stages) if s % pp == rank] if "ZBV" not in a.schedule and "DualPipe" not in a.schedule \
    else [rank, 2 * pp - 1 - rank]
parts, pipeline_stages = [], []
for s in mine:
    take = (s + 1) * a.layers // stages - s * a.layers // stages
    m = Part(s == 0, s == stages - 1, take)
    parts.append(m)
    pipeline_stages.append(PipelineStage(m, s, stages, torch.device("cpu")))


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


cls = get_schedule_class(a.schedule)
sched = cls(pipeline_stages[0] if single else pipeline_stages, n_microbatches=a.microbatches, loss_fn=loss_fn)
opt = torch.optim.Adam([q for m in parts for q in m.parameters()], lr=3e-3)
first, last = 0 in mine, stages - 1 in mine
times = []
for step in range(a.steps):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, V, (a.batch_size, C), generator=g)
    y = torch.randint(0, V, (a.batch_size, C), generator=g)
    dist.barrier()
    t0 = time.perf_counter()
    opt.zero_grad()
    losses = []
    kwargs = {}
    if last:
        kwargs = {"target": y, "losses": losses}
    if first:
        sched.step(x, **kwargs)
    else:
        sched.step(**kwargs)
    opt.step()
    times.append(time.perf_counter() - t0)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"rank {rank}: peak RSS {rss:.0f} MiB", flush=True)
if last:
    med = statistics.median(times[5:]) * 1e3
    print(f"torch {a.schedule} over {pp} ranks, {a.microbatches} microbatches: {med:.1f} ms a step "
          f"(loss {sum(losses).item() / len(losses):.3f})")
dist.destroy_process_group()
