"""Rank 0 of the torch_weight_sync example: a PyTorch trainer.

It trains a linear regression with SGD and, after every step, broadcasts its
weights to the other ranks (consort workers, see main.rs) over the job's
`gloo` process group; each worker scores them on its own held-out data and
the scores come back with one all_gather. Launch it through launch.sh.
"""
import os

import torch
import torch.distributed as dist

FEATURES = 16
STEPS = int(os.environ.get("STEPS", "50"))


def target_weights():
    # The weights the data comes from; main.rs uses the same ones.
    return torch.tensor([(i % 5) - 2.0 for i in range(FEATURES)])


def main():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w_true = target_weights()

    def flat():
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    # Tell the workers how many numbers a weight update holds, and how many
    # updates will come.
    header = torch.tensor([flat().numel(), STEPS], dtype=torch.int64)
    dist.broadcast(header, src=0)

    for step in range(STEPS):
        x = torch.randn(64, FEATURES)
        y = x @ w_true + 0.5
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

        weights = flat().contiguous()
        dist.broadcast(weights, src=0)
        scores = torch.empty(world)
        dist.all_gather_into_tensor(scores, loss.detach().reshape(1))
        if step % 10 == 0 or step == STEPS - 1:
            workers = " ".join(f"{s:.4f}" for s in scores[1:].tolist())
            print(f"step {step:3d}  train loss {loss.item():.4f}  worker eval losses {workers}",
                  flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
