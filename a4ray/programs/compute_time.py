"""Each rank's own compute time per step, for the straggler check: the time from the start of the step to the
start of the gradient reduction (forward and backward over the step's micro-batches), less the time spent in
the collectives and point-to-point transfers inside them, so that waiting for other ranks does not count.

Forward and backward hold collectives of their own under model parallelism: expert parallelism's token
dispatch (megatron-core's all-gather or all-to-all dispatcher), tensor and sequence parallelism's all-reduce,
all-gather and reduce-scatter, pipeline parallelism's sends and receives, the router's load-balancing
all-reduce. A rank waits in them for the slowest of its peers: timed from wall to wall, a fast rank looks as
slow as the straggler it waits for (the qwen3_next rehearsal, EP=2 across 2 nodes, one node stopped 70% of the
time: both ranks read 0.52 and 0.59 s, nothing flagged). So the time inside each of them is taken off. A slow
rank waits least in them, its peers wait for it: what is left is each rank's own work.

How a collective is timed: `exclude_collectives` wraps torch.distributed's collectives and point-to-point
functions (`COLLECTIVES`) where megatron-core calls them: the `torch.distributed` module's attributes, and the
aliases megatron-core binds at import (`tensor_parallel.mappings.dist_all_gather_func`, ...). Only calls made
while a step is timed, on the thread that times it, are counted; a nested call counts once.
- on the CPU (gloo): wall time around the call; for an asynchronous op (`async_op=True`, `batch_isend_irecv`),
  around its `wait()`, where the rank waits;
- on GPUs (NCCL): CUDA events on the current stream around the call (an asynchronous op: around its `wait()`):
  the time the compute stream stood behind the collective. The step's own ends are events too, read once the
  step's last event has completed, or at the window's report: no synchronization is added to any step.
Point-to-point ops issued one by one (`isend` / `irecv`) are not wrapped: torch's `P2POp` accepts only the
functions themselves. megatron-core's schedules batch them (`batch_isend_irecv`, its default).

Every `report` (one per logging window, on every rank at once) gathers each rank's median over the window
(own compute, and time in collectives) and the last rank prints one line, which the node actor reads and the
gang's straggler check judges:

    A4RAY_COMPUTE {"iteration": 30, "seconds": [0.031, 0.030, 0.094, ...], "waits": [0.06, 0.06, 0.001, ...]}
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

from a4ray.programs.record import COMPUTE_MARKER

# torch.distributed's functions that move data between ranks inside forward and backward (megatron-core's
# tensor_parallel/mappings.py, transformer/moe/token_dispatcher.py and router.py, pipeline_parallel/
# p2p_communication.py call these; `_all_gather_base` / `_reduce_scatter_base` where an older torch lacks the
# newer names).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single", "broadcast",
               "reduce", "send", "recv", "batch_isend_irecv")


class _Step:
    def __init__(self, begin):
        self.begin = begin
        self.end = None
        self.spans: list[tuple] = []  # (before, after) of each collective: wall times, or CUDA events


class ComputeTimer:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.step: _Step | None = None  # the step being timed
        self.pending: list[_Step] = []  # ended, not read yet (GPU: until their last event completed)
        self.window: list[float] = []  # own compute per step
        self.waits: list[float] = []  # time in collectives per step
        self._thread: int | None = None
        self._depth = 0  # inside a counted collective (a nested one is not counted again)

    # ------------------------------------------------------------------ marks
    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, before, after) -> float:
        return before.elapsed_time(after) / 1e3 if self.cuda else after - before

    # ------------------------------------------------------------------ steps
    def start(self) -> None:
        self.step = _Step(self._mark())
        self._thread = threading.get_ident()

    def stop(self) -> None:
        """The step's compute ended (the first call after `start` counts)."""
        if self.step is not None:
            self.step.end = self._mark()
            self.pending.append(self.step)
            self.step = None
            self._read(wait=False)

    def before(self, fn):
        """`fn` with the compute stopped as it is called (wraps megatron-core's finalize_model_grads, where the
        data-parallel gradient reduction begins)."""
        def timed(*args, **kwargs):
            self.stop()
            return fn(*args, **kwargs)
        return timed

    def _read(self, wait: bool) -> None:
        """Steps whose marks are all known go into the window (on GPUs: those whose end event completed; with
        `wait`, every one, waiting for the device)."""
        while self.pending:
            step = self.pending[0]
            if self.cuda:  # a collective may have run on a stream of its own: every event, not only the last
                events = [step.begin, step.end, *(e for span in step.spans for e in span)]
                if not wait and not all(e.query() for e in events):
                    return
                for event in events:
                    event.synchronize()
            waited = sum(self._seconds(a, b) for a, b in step.spans)
            self.window.append(max(0.0, self._seconds(step.begin, step.end) - waited))
            self.waits.append(waited)
            self.pending.pop(0)

    # ------------------------------------------------------------------ collectives
    def exclude_collectives(self) -> ComputeTimer:
        """Count the time inside torch.distributed's collectives as waiting, not compute (see the module's
        docstring). Call it once megatron-core's modules are imported (the model is built): their aliases of
        the functions are rebound too."""
        wrapped = {}  # id(torch's function) -> its timed wrapper
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if callable(fn) and not getattr(fn, "_a4ray_timed", False):
                wrapped[id(fn)] = self._timed(fn)
                setattr(dist, name, wrapped[id(fn)])
        for module_name, module in list(sys.modules.items()):
            if module_name.startswith("megatron.") and module is not None:
                for attr, value in list(vars(module).items()):
                    if id(value) in wrapped:
                        setattr(module, attr, wrapped[id(value)])
        return self

    def _counting(self) -> bool:
        return self.step is not None and self._depth == 0 and threading.get_ident() == self._thread

    def _timed(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self._counting():
                return fn(*args, **kwargs)
            step, before = self.step, self._mark()
            self._depth += 1
            try:
                result = fn(*args, **kwargs)
            finally:
                self._depth -= 1
            if isinstance(result, list) and result and all(hasattr(w, "wait") for w in result):
                return [_TimedWork(w, self, step) for w in result]  # batch_isend_irecv: each waited for later
            if hasattr(result, "wait"):  # async_op=True: the rank waits in wait()
                return _TimedWork(result, self, step)
            step.spans.append((before, self._mark()))
            return result
        timed._a4ray_timed = True
        return timed

    # ------------------------------------------------------------------ report
    def report(self, iteration: int) -> None:
        """Gather every rank's median compute time (and time in collectives) over the window (a collective:
        every rank calls it at the same iteration) and print the line on the last rank; the window starts
        again."""
        self._read(wait=True)
        mine = [statistics.median(v) if v else float("nan") for v in (self.window, self.waits)]
        self.window, self.waits = [], []
        world = dist.get_world_size()
        gathered = [torch.zeros(2, dtype=torch.float64, device=self.device) for _ in range(world)]
        dist.all_gather(gathered, torch.tensor(mine, dtype=torch.float64, device=self.device))
        if dist.get_rank() == world - 1:
            seconds = [round(float(t[0].item()), 6) for t in gathered]
            waits = [round(float(t[1].item()), 6) for t in gathered]
            print(COMPUTE_MARKER + json.dumps({"iteration": iteration, "seconds": seconds, "waits": waits}),
                  flush=True)


class _TimedWork:
    """An asynchronous op's handle whose `wait()` counts as waiting in the step that issued it (while that step
    is still timed); everything else is the handle's own."""

    def __init__(self, work, timer: ComputeTimer, step: _Step):
        self._work, self._timer, self._step = work, timer, step

    def wait(self, *args, **kwargs):
        if self._timer.step is not self._step or not self._timer._counting():
            return self._work.wait(*args, **kwargs)
        before = self._timer._mark()
        self._timer._depth += 1
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._timer._depth -= 1
            self._step.spans.append((before, self._timer._mark()))

    def __getattr__(self, name):
        return getattr(self._work, name)
