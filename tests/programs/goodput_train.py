"""A rank program for the goodput tests: a training loop without torch (cheap to start), in step with its peers through
files (each iteration begins once every rank has reached it, as a collective would hold them). Rank 0 prints Megatron-LM's iteration line every iteration and saves a checkpoint every
`SAVE_EVERY` iterations, in Megatron-LM's words ("saving checkpoint at iteration", "successfully saved
checkpoint"); on the first attempt the victim rank SIGKILLs itself once iteration `KILL_AT` is done. A restart
resumes after the checkpoint, so the iterations past it are done again.

    python goodput_train.py STATE ITERATIONS STEP_S SAVE_EVERY SAVE_S KILL_AT VICTIM
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

state, total, step_s, every, save_s, kill_at, victim = (Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                                                        int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]),
                                                        int(sys.argv[7]))
rank, world, attempt = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("A4RAY_ATTEMPT", "0"))
reached = [state.with_name(f"{state.name}.attempt{attempt}.rank{r}") for r in range(world)]


def in_step(it: int) -> None:
    """Begin iteration `it` once every rank has reached it: a peer that died holds the others here, as NCCL's
    collectives do (without this, a rank whose node started late fell behind, and rank 0 saved past the kill)."""
    mine = reached[rank]
    mine.with_name(mine.name + ".tmp").write_text(str(it))
    mine.with_name(mine.name + ".tmp").replace(mine)
    while not all(p.exists() and int(p.read_text()) >= it for p in reached):
        time.sleep(0.005)


start = json.loads(state.read_text())["iteration"] if state.exists() else 0
for it in range(start + 1, total + 1):
    in_step(it)
    time.sleep(step_s)
    if rank == victim and attempt == 0 and it == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        print(f" iteration {it:8d}/{total:8d} | elapsed time per iteration (ms): {step_s * 1000:.1f} |"
              f" lm loss: {1 / it:.4E} |", flush=True)
        if it % every == 0:
            print(f"saving checkpoint at iteration {it:7d} to {state}", flush=True)
            time.sleep(save_s)
            state.with_suffix(".tmp").write_text(json.dumps({"iteration": it}))
            state.with_suffix(".tmp").replace(state)
            print(f"  successfully saved checkpoint from iteration {it:7d} to {state}", flush=True)
    elif it % every == 0:
        time.sleep(save_s)  # a blocking save holds every rank
