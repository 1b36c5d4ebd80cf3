"""The trivial DDP program the launch benchmark starts three ways (benchmarks/launch.py).

As a torchrun script (`python -m torch.distributed.run ... ddp_trivial.py`, bare or through a4ray's gang)
it joins the process group from torchrun's env over gloo; as Ray Train's `train_loop_per_worker` it finds
the group Ray Train has set up. Either way the same user code runs: a tiny nn.Linear under DDP for a few
steps, then an all-reduce every rank checks. It imports neither Ray nor a4ray.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def user_code(steps: int = 3) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    expected = world * (world + 1) / 2
    if total.item() != expected:
        raise RuntimeError(f"rank {rank}: all_reduce gave {total.item()}, expected {expected}")
    print(f"ddp_trivial rank {rank}/{world}: {steps} steps, all_reduce ok", flush=True)


def train_loop_per_worker(config: dict | None = None) -> None:
    """Ray Train's entry: the process group is Ray Train's to create and destroy."""
    user_code(**(config or {}))


def main() -> None:
    dist.init_process_group("gloo")  # torchrun's env: MASTER_ADDR/PORT, RANK, WORLD_SIZE (its agent's store)
    try:
        user_code(int(os.environ.get("DDP_TRIVIAL_STEPS", "3")))
        dist.barrier()  # no rank tears gloo down while a peer still talks to it (an abort at exit otherwise)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
