"""The DDP test's training program, run by torchrun on every GPU of every node.

Checks what a broken multi-node setup gets wrong: a collective returns the right sum, DDP's gradient
all-reduce keeps every rank's parameters identical after N steps, and the step time per rank. Reports
one `A4RAY_RESULT {...}` line per rank; exits 1 if this rank's checks failed.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from a4ray.programs.distributed import exit_distributed, init_distributed
from a4ray.programs.record import report


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def _max_diff_to_rank0(flat: torch.Tensor) -> float:
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    diff = (flat - reference).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)  # every rank reports the worst rank's difference
    return float(diff)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--backend", default="auto")
    p.add_argument("--tolerance", type=float, default=0.0)
    args = p.parse_args(argv)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    device, backend = init_distributed(args.backend)

    # The seeds' check: every rank contributes its rank; all must see sum(range(world)).
    probe = torch.full((1024,), float(rank), device=device)
    dist.all_reduce(probe)
    allreduce_ok = bool(torch.all(probe == world * (world - 1) / 2))
    # One line per rank in the job's stream (its result record is read, not shown): where it ran, what it saw.
    print(f"ddp_test: rank {rank}/{world} on {socket.gethostname()} ({device}, {backend}): all-reduce "
          f"{'ok' if allreduce_ok else 'WRONG'}", flush=True)

    torch.manual_seed(0)  # identical initial weights on every rank
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    model = nn.Sequential(*layers[:-1]).to(device)
    ddp = DDP(model, device_ids=[local_rank] if backend == "nccl" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1000 + rank)  # different data per rank: DDP must reconcile

    step_times, losses = [], []
    for step in range(args.steps):
        x = torch.randn(args.batch_size, args.hidden, generator=data).to(device)
        y = torch.randn(args.batch_size, args.hidden, generator=data).to(device)
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if rank == 0 and (step % max(1, args.steps // 5) == 0 or step == args.steps - 1):
            print(f" iteration {step + 1:>6}/{args.steps:>6} | lm loss: {losses[-1]:.6E} | "
                  f"elapsed time per iteration (ms): {step_times[-1] * 1000:.1f}", flush=True)

    param_diff = _max_diff_to_rank0(_flat(model.parameters()))
    grad_diff = _max_diff_to_rank0(_flat(p.grad for p in model.parameters()))
    passed = allreduce_ok and param_diff <= args.tolerance and grad_diff <= args.tolerance
    timed = step_times[1:] or step_times  # the first step pays for lazy init
    record = {
        "rank": rank, "local_rank": local_rank, "world_size": world, "host": socket.gethostname(),
        "node_rank": int(os.environ.get("GROUP_RANK", os.environ.get("A4RAY_NODE_RANK", "0"))),
        "device": str(device) if device.type == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})",
        "backend": backend, "step_time_ms": round(statistics.median(timed) * 1000, 3),
        "allreduce_ok": allreduce_ok, "param_max_diff": param_diff, "grad_max_diff": grad_diff,
        "loss_first": losses[0], "loss_last": losses[-1], "passed": passed,
    }
    report(record)
    exit_distributed(0 if passed else 1)


if __name__ == "__main__":
    sys.exit(main())
