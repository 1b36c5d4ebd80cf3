"""A rank program for the rank-launcher tests: prints its torchrun environment as one JSON line, joins the
process group over gloo and checks an all-reduce; `--fail-rank R --code C` makes rank R exit with C at
once while the others sleep (they must be stopped by the launcher)."""

import argparse
import json
import os
import sys
import time

CONTRACT = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING"]

p = argparse.ArgumentParser()
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--code", type=int, default=3)
args = p.parse_args()
print("ENV " + json.dumps({k: os.environ.get(k) for k in CONTRACT}), flush=True)
try:
    with open("/proc/self/autogroup") as f:
        autogroup = f.read().split()[-1]
except OSError:
    autogroup = "-"
# who runs this: its pid, how Python ran it, its CPU class and its session's nice (a warm rank must have left its own)
print(f"PROC {os.getpid()} {__name__} {sys.argv[0]} {os.sched_getscheduler(0)} {autogroup} "
      f"{os.environ.get('A4RAY_PROBE', '-')} {os.getcwd()}", flush=True)
if args.fail_rank >= 0:
    if int(os.environ["RANK"]) == args.fail_rank:
        sys.exit(args.code)
    time.sleep(120)
    sys.exit(0)

import torch
import torch.distributed as dist

from a4ray.programs.distributed import exit_distributed

dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
world = dist.get_world_size()
assert total.item() == world * (world + 1) / 2, total
print(f"all_reduce ok on rank {dist.get_rank()}/{world}", flush=True)
exit_distributed(0)
