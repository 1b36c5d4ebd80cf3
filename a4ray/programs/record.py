"""What a training loop reports when it ends: one `A4RAY_RESULT {...}` line, which the node actor collects
and the trainer's typed result reads back (`a4ray.trainers.interface.LoopResult`); and the other contracts
between a4ray's rank programs and the node actor (stdlib only: the node actor imports them without torch)."""

from __future__ import annotations

import json
import statistics

RESULT_MARKER = "A4RAY_RESULT "  # what the node actor looks for at the start of a rank's output line
# A window of every rank's own compute time per step (`programs/compute_time.py`), for the straggler check.
COMPUTE_MARKER = "A4RAY_COMPUTE "
# Where a4ray's rank programs serve their flight record (`programs/distributed.py`; read by `observe/flight.py`):
# the launch's directory, set by the node actor; each rank's socket is rank_<RANK>.sock in it.
FR_SOCKET_DIR_ENV = "A4RAY_FR_SOCKETS"


def fr_socket_path(directory: str, rank: int | str) -> str:
    return f"{directory}/rank_{rank}.sock"


def report(record: dict) -> None:
    """Print `record` as the one result line the node actor collects."""
    print(RESULT_MARKER + json.dumps(record), flush=True)


def report_loop(trainer: str, *, world_size: int, backend: str, devices: list, iterations: int, start: int,
                losses: list[float], step_times: list[float], tokens_per_step: int, checkpoint: str,
                **extra) -> None:
    """Print the record of a loop over iterations `start + 1 .. iterations`: its losses, and its median step
    time (the first step, which compiles and warms caches, left out) with the tokens/s it makes."""
    timed = step_times[1:] or step_times
    median = statistics.median(timed) if timed else 0.0
    record = {"trainer": trainer, "world_size": world_size, "backend": backend, "devices": devices,
              "iterations": iterations, "start_iteration": start, "trained": len(losses),
              "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
              "losses": [round(v, 5) for v in losses], "step_time_ms": round(median * 1000, 2),
              "tokens_per_s": round(tokens_per_step / median, 1) if median else None, "checkpoint": checkpoint,
              **extra}
    report(record)
