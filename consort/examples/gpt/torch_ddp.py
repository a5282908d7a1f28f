"""The GPT example's model and data, trained with torch's DDP: the anchor
for `examples/gpt --backend nccl --device cuda` (one sitting, same shape).

Same corpus (the example's generator, byte for byte), same windows
(stride 3), torch's DistributedSampler with the same arguments (shuffle,
seed 0, drop_last), the same model shape (token and position embeddings,
pre-norm GELU transformer blocks with 16-wide heads and a 4x MLP, a final
LayerNorm, a linear head), Adam at the same learning rate. Initial values
differ (each library's own initializers), so losses agree in trend, not
digit for digit.

    torchrun --nproc-per-node 8 consort/examples/gpt/torch_ddp.py --device cuda

(or under `consort run`: it reads torchrun's variables). The last line
rank 0 prints is `summary {...}`, as the Rust example's.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

VOCAB = b"0123456789+=\n"
MASK = (1 << 64) - 1


def corpus(lines):
    """The example's data::corpus: sums from a fixed 64-bit LCG."""
    s = 0x9E3779B97F4A7C15

    def nxt():
        nonlocal s
        s = (s * 6364136223846793005 + 1442695040888963407) & MASK
        return (s >> 33) % 100

    out = bytearray()
    for _ in range(lines):
        a, b = nxt(), nxt()
        out += f"{a}+{b}={a + b}\n".encode()
    return torch.tensor([VOCAB.index(c) for c in out], dtype=torch.long)


def fnv1a(tokens):
    """The Rust example's data::fnv1a: FNV-1a (64-bit) of the token ids."""
    h = 0xCBF29CE484222325
    for t in tokens.tolist():
        h = ((h ^ t) * 0x100000001B3) & MASK
    return h


class Gpt(nn.Module):
    def __init__(self, vocab, context, d_model, layers):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(context, d_model)
        block = nn.TransformerEncoderLayer(
            d_model, d_model // 16, 4 * d_model, dropout=0.0, activation="gelu",
            batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids):
        seq = ids.shape[1]
        pos = torch.arange(seq, device=ids.device)
        x = self.tokens(ids) + self.positions(pos)[None]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=ids.device)
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.head(self.norm(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", help="a directory for summary.json (rank 0)")
    a = p.parse_args()

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if a.device == "cuda":
        gpu = 0 if os.environ.get("CONSORT_SHARE_GPU") == "1" else local
        device = torch.device("cuda", gpu)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    data = corpus(20_000)
    stride = 3
    windows = (len(data) - (a.context + 1)) // stride
    sampler = DistributedSampler(range(windows), world, rank, shuffle=True, seed=0,
                                 drop_last=True)
    per_epoch = (windows // world) // a.batch_size
    offsets = torch.arange(a.context + 1)

    model = Gpt(len(VOCAB), a.context, a.d_model, a.layers).to(device)
    ddp = DDP(model, device_ids=[device.index] if a.device == "cuda" else None)
    opt = torch.optim.Adam(ddp.parameters(), lr=a.lr)
    ce = nn.CrossEntropyLoss()

    epoch, picks = None, None
    warm = 2 if a.steps >= 4 else 0
    t0 = time.perf_counter()
    last = float("nan")
    for step in range(a.steps):
        if step == warm:
            if a.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        if step // per_epoch != epoch:
            epoch = step // per_epoch
            sampler.set_epoch(epoch)
            picks = list(sampler)
        k = step % per_epoch * a.batch_size
        starts = torch.tensor(picks[k:k + a.batch_size]) * stride
        w = data[starts[:, None] + offsets].to(device)
        x, y = w[:, :-1], w[:, 1:]
        loss = ce(ddp(x).reshape(-1, len(VOCAB)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        last = mean.item() / world
        if rank == 0 and ((step + 1) % 20 == 0 or step + 1 == a.steps):
            print(f"step {step + 1:>4}/{a.steps}: loss {last:.4f}", flush=True)
    if a.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        timed = a.steps - warm
        summary = {
            "library": "torch",
            "world": world,
            "path": f"{a.device}, torch DDP",
            "d_model": a.d_model,
            "layers": a.layers,
            "parameters": sum(p.numel() for p in model.parameters()),
            "timed_steps": timed,
            "tokens_per_s": timed * world * a.batch_size * a.context / elapsed,
            "final_loss": last,
            "corpus_fnv1a": f"{fnv1a(data):016x}",
        }
        print("summary " + json.dumps(summary, sort_keys=True), flush=True)
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "summary.json"), "w") as f:
                json.dump(summary, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
