"""Checkpoint policy: how often a trainer saves (a fixed number of iterations, or `auto`: the interval Meta's ETTR
model finds best for this run's own measured save cost), and which checkpoint a restart resumes from. Beside
goodput (observe/goodput.py), which projects the same model from a run's record.

Meta's model (Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research Clusters", HPCA
2025): E[ETTR] ~ (1 - N r_f (u0 + dt/2)) / (1 + w/dt); its best interval dt* = sqrt(2 w / (N r_f)), with w the time a
save blocks training, N the nodes and r_f each node's failure rate. A save that blocks less can be made more often,
and a fault then redoes less: w is measured by the trainer at each save, and the interval follows it.
"""

from __future__ import annotations

import math

from a4ray.core.node_history import PUBLISHED_RATE  # noqa: F401 - the policy's default rate, where the history has none


def best_interval_s(save_blocking_s: float, nodes: int, failures_per_1000_node_days: float) -> float:
    """dt* = sqrt(2 w / (N r_f)) in seconds (0 for a save that does not block)."""
    failures_per_s = nodes * failures_per_1000_node_days / 1000 / 86400
    return math.sqrt(2 * save_blocking_s / failures_per_s) if save_blocking_s > 0 else 0.0


class Interval:
    """When to save one kind of checkpoint: every `every` iterations, or (every=None: auto) every dt* at the run's
    pace, reckoned again after each save from that save's blocking time; the first auto save comes after the first
    iteration, to measure it."""

    def __init__(self, name: str, every: int | None, *, nodes: int, failures_per_1000_node_days: float,
                 rate_source: str, start: int):
        self.name, self.every, self.nodes = name, every, nodes
        self.rate, self.rate_source = failures_per_1000_node_days, rate_source
        self.next_at = start + 1 if every is None else None
        self.chosen: int | None = None

    def due(self, done: int) -> bool:
        if self.every is not None:
            return done % self.every == 0
        return done >= self.next_at

    def saved(self, done: int, blocking_s: float, step_s: float) -> str | None:
        """After a save at `done` that blocked `blocking_s`, at `step_s` a step: an auto interval's next save; returns
        what it chose and why when that changes."""
        if self.every is not None:
            return None
        seconds = best_interval_s(blocking_s, self.nodes, self.rate)
        iterations = max(1, round(seconds / step_s)) if step_s > 0 else 1
        self.next_at = done + iterations
        if iterations == self.chosen:
            return None
        self.chosen = iterations
        return (f"{self.name} interval auto: every {iterations} iteration(s) = dt* {seconds:.0f}s = sqrt(2 w / (N r_f)) "
                f"with w {blocking_s:.2f}s blocked by this save, N {self.nodes} node(s), r_f {self.rate:g} failures per "
                f"1000 node-days ({self.rate_source}); a step takes {step_s:.3f}s")


def resume_from(persistent: int | None, local: int | None) -> tuple[str | None, int | None]:
    """Which checkpoint a restart resumes from: the newest; a persistent one where both are of one iteration (it
    outlives the nodes). Returns (kind: "persistent" / "local" / None, iteration)."""
    if local is not None and (persistent is None or local > persistent):
        return "local", local
    if persistent is not None:
        return "persistent", persistent
    return None, None
