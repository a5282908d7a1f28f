"""Rank 0 of the torch_weight_sync example: a PyTorch trainer.

It trains a linear regression with SGD and, after every step, broadcasts its
weights to the other ranks (consort workers, see main.rs) over the job's
process group (`gloo`, or with BACKEND=nccl torch's `nccl` on the GPU); each
worker scores them on its own held-out data and the scores come back with
one all_gather. Launch it through launch.sh.

With BACKEND=nccl the tensors that cross live on GPU LOCAL_RANK, or on GPU 0
for every rank with CONSORT_SHARE_GPU=1 (one NCCL_HOSTID per rank below NCCL
2.30, as launch.sh sets).
"""
import os
import sys

import torch
import torch.distributed as dist

FEATURES = 16
STEPS = int(os.environ.get("STEPS", "50"))


def target_weights():
    # The weights the data comes from; main.rs uses the same ones.
    return torch.tensor([(i % 5) - 2.0 for i in range(FEATURES)])


def main():
    backend = os.environ.get("BACKEND", "gloo")
    if backend not in ("gloo", "nccl"):
        raise SystemExit(f"BACKEND={backend!r}: expected gloo or nccl")
    dev = torch.device("cpu")
    if backend == "nccl":
        share = os.environ.get("CONSORT_SHARE_GPU") == "1"
        dev = torch.device("cuda", 0 if share else int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    # EAGER=1: the default group's communicator is made at init, bound to
    # the device, and torch's classic backend then splits new_groups from it
    # (launch.sh tells the consort ranks: CONSORT_TORCH_NCCL_EAGER=1).
    eager = backend == "nccl" and os.environ.get("EAGER") == "1"
    dist.init_process_group(backend, device_id=dev if eager else None)
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w_true = target_weights()

    def flat():
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    # Tell the workers how many numbers a weight update holds, and how many
    # updates will come.
    header = torch.tensor([flat().numel(), STEPS], dtype=torch.int64, device=dev)
    dist.broadcast(header, src=0)

    for step in range(STEPS):
        x = torch.randn(64, FEATURES)
        y = x @ w_true + 0.5
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

        weights = flat().contiguous().to(dev)
        dist.broadcast(weights, src=0)
        scores = torch.empty(world, device=dev)
        dist.all_gather_into_tensor(scores, loss.detach().reshape(1).to(dev))
        if step % 10 == 0 or step == STEPS - 1:
            workers = " ".join(f"{s:.4f}" for s in scores[1:].tolist())
            print(f"[{backend}] step {step:3d}  train loss {loss.item():.4f}  worker eval losses {workers}",
                  flush=True)

    # Subgroups across the two libraries: the trainer and the last worker
    # sum their final losses; then the workers' own group, which the
    # trainer is not in (every rank calls new_group, as torch requires).
    pair = dist.new_group([0, world - 1])
    both = torch.tensor([loss.item()], device=dev)
    dist.all_reduce(both, group=pair)
    print(f"[{backend}] subgroup [0, {world - 1}]: sum of final losses {both.item():.4f}", flush=True)
    if world > 2:
        dist.new_group(list(range(1, world)))

    dist.barrier()
    dist.destroy_process_group()


def leave():
    """Ends the process without finalizing the interpreter.

    torch's Gloo worker threads drop their reference to a finished
    collective's work after its waiter has woken, and dropping the tensors
    it holds takes the GIL. torch 2.15 keeps the default group's workers
    running past destroy_process_group (until exit), so when that happens
    as the interpreter finalizes, CPython ends the thread with pthread_exit
    inside a noexcept destructor and the process aborts ("terminate called
    without an active exception"). Peers that answer at once (consort's
    ranks do) make that likely: the final barrier then returns before the
    worker got the GIL. Every call has returned and the group is destroyed,
    so there is nothing left for finalization to do; leave without it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    leave()
