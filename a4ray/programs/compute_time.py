"""Each rank's own compute time per step, for the straggler check: the time from the start of the step to
the start of the gradient reduction (forward and backward over the step's micro-batches), so that time spent
waiting for other ranks does not count: a slow rank waits least, its peers wait for it.

Every `report` (one per logging window, on every rank at once) gathers each rank's median over the window
and the last rank prints one line, which the node actor reads and the gang's straggler check judges:

    A4RAY_COMPUTE {"iteration": 30, "seconds": [0.031, 0.030, 0.094, ...]}     (seconds[rank])
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist

from a4ray.programs.record import COMPUTE_MARKER


class ComputeTimer:
    def __init__(self, device: torch.device):
        self.device = device
        self.started: float | None = None
        self.window: list[float] = []

    def start(self) -> None:
        self.started = time.perf_counter()

    def stop(self) -> None:
        """The step's compute ended (the first call after `start` counts)."""
        if self.started is not None:
            if self.device.type == "cuda":  # the kernels queued, not only their launch
                torch.cuda.synchronize(self.device)
            self.window.append(time.perf_counter() - self.started)
            self.started = None

    def before(self, fn):
        """`fn` with the compute stopped as it is called (wraps megatron-core's finalize_model_grads, where the
        data-parallel gradient reduction begins)."""
        def timed(*args, **kwargs):
            self.stop()
            return fn(*args, **kwargs)
        return timed

    def report(self, iteration: int) -> None:
        """Gather every rank's median compute time over the window (a collective: every rank calls it at the
        same iteration) and print the line on the last rank; the window starts again."""
        mine = statistics.median(self.window) if self.window else float("nan")
        self.window = []
        world = dist.get_world_size()
        gathered = [torch.zeros(1, dtype=torch.float64, device=self.device) for _ in range(world)]
        dist.all_gather(gathered, torch.tensor([mine], dtype=torch.float64, device=self.device))
        if dist.get_rank() == world - 1:
            seconds = [round(float(t.item()), 6) for t in gathered]
            print(COMPUTE_MARKER + json.dumps({"iteration": iteration, "seconds": seconds}), flush=True)
