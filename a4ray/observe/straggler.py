"""Stragglers, on the driver's side: which node's ranks compute slower than the gang's, window after window.

The Megatron trainer reports, once per logging window, every rank's median own compute time per step
(`programs/compute_time.py`: forward and backward up to the gradient reduction, less the time inside their
collectives, EP's token dispatch, TP's and PP's transfers: waiting for others does not count). Here each
node's time is the median of its ranks', the gang's the median of the nodes' (of 2 nodes: their mean, so a
node k times slower than the other reads 2k/(k+1) of it, under 2x); a node slower than the gang's by more
than `observe.straggler.threshold` (and by `min_slower_s`) for `observe.straggler.windows` windows in a row is flagged: a progress
line naming node, host and how much slower, the `a4ray_node_straggler` metric, and the launch's `stragglers`
(so the run record and the node history). Every window sets every node's `a4ray_node_step_time_seconds` and
`a4ray_node_straggler`, so their series exist from the first window; the straggler gauge stays 1 once a node
is flagged, as the run record does (the step time shows any recovery).

megatron-core's `StragglerDetector` (megatron.core.utils) does not fit: it times whole steps (waits
included, so the slow rank looks fastest), and reports the min/max ranks, not a node.

Pai and ms-swift run Megatron-LM's own loop, which prints no per-rank compute time (its `--log-straggler`
reports only min/max ranks of the whole step, waits included): the check is off for those trainers.
"""

from __future__ import annotations

import json
import math
import statistics

from pydantic import BaseModel

from a4ray.core.console import say
from a4ray.observe import metrics
from a4ray.observe.verdicts import NodeRef, Straggler
from a4ray.programs.record import COMPUTE_MARKER  # the line a rank program prints per window
from a4ray.spec.resilience import StragglerSpec


class ComputeWindow(BaseModel):
    iteration: int
    seconds: list[float]  # by global rank: own compute per step (the window's median)
    waits: list[float] = []  # by global rank: time in the collectives inside forward and backward, not judged

    @classmethod
    def parse(cls, line: str) -> ComputeWindow | None:
        try:
            return cls.model_validate(json.loads(line[len(COMPUTE_MARKER):]))
        except ValueError:
            return None


class StragglerCheck:
    """Judges each window of a launch (`nodes`: who its nodes are; `nproc`: each one's ranks)."""

    def __init__(self, spec: StragglerSpec, nodes: list[NodeRef], nproc: list[int], tags: tuple[str, str]):
        self.spec = spec
        self.nodes = nodes
        self.nproc = nproc
        self.tags = tags
        self.slow_windows = [0] * len(nodes)
        self.flagged: list[Straggler] = []

    def window(self, w: ComputeWindow) -> list[Straggler]:
        """Judge one window; returns `flagged`: one entry per node ever flagged in the launch. A node flagged
        again after it caught up is said again, and its entry counts it and takes the latest figures."""
        if not self.spec.enabled or len(w.seconds) != sum(self.nproc) or len(self.nodes) < 2:
            return self.flagged
        per_node, first = [], 0
        for n in self.nproc:
            times = [t for t in w.seconds[first:first + n] if math.isfinite(t)]
            per_node.append(statistics.median(times) if times else None)
            first += n
        known = [t for t in per_node if t is not None]
        if len(known) < 2:
            return self.flagged
        gang = statistics.median(known)
        for i, (node, t) in enumerate(zip(self.nodes, per_node)):
            slow = (t is not None and gang > 0 and t > gang * (1 + self.spec.threshold)
                    and t - gang >= self.spec.min_slower_s)
            self.slow_windows[i] = self.slow_windows[i] + 1 if slow else 0
            flagged = self.slow_windows[i] >= self.spec.windows
            if t is not None:
                try:
                    ever = flagged or any(s.node == node for s in self.flagged)
                    metrics.record_node_window(*self.tags, node, t, ever)
                except Exception:  # noqa: BLE001 - metrics are an aid; a metrics hiccup must not end the launch
                    pass
            if flagged and self.slow_windows[i] == self.spec.windows:  # flagged now (again after a recovery)
                earlier = [k for k, s in enumerate(self.flagged) if s.node == node]
                straggler = Straggler(node=node, iteration=w.iteration, step_time_s=t, gang_median_s=gang,
                                      slower_pct=(t / gang - 1) * 100, windows=self.spec.windows,
                                      times=self.flagged[earlier[0]].times + 1 if earlier else 1)
                say(straggler.line())
                if earlier:
                    self.flagged[earlier[0]] = straggler
                else:
                    self.flagged.append(straggler)
        return self.flagged
