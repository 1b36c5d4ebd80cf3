"""Hangs, on the driver's side: the watchdog that decides a launch is hung, and the report of where every
rank was when it did (each node's stacks, from `stacks.py` through its node actor, and a summary).

The supervisor feeds the watchdog what it streams (output, iteration lines) and asks it every second.
"""

from __future__ import annotations

import time
from pathlib import Path

import ray

from a4ray.core.console import say
from a4ray.observe.stacks import StackDump, summarize
from a4ray.spec.resilience import WatchdogSpec

_STACKS_TIMEOUT_S = 120


class Watchdog:
    """A hang is no new iteration for `no_progress_s` once training has started, no iteration line in the
    first `startup_s`, or no output from any node for `no_output_s` (observe.watchdog)."""

    def __init__(self, spec: WatchdogSpec):
        self.spec = spec
        self.started_at = self.last_output_at = time.monotonic()
        self.last_progress_at: float | None = None

    def output(self) -> None:
        self.last_output_at = time.monotonic()

    def progress(self) -> None:
        self.last_progress_at = time.monotonic()

    def why(self, last_iteration: int | None) -> str | None:
        """Why the launch looks hung, or None."""
        w = self.spec
        if not w.enabled:
            return None
        now = time.monotonic()
        if self.last_progress_at is not None:
            if w.no_progress_s and now - self.last_progress_at > w.no_progress_s:
                return (f"no new iteration for {now - self.last_progress_at:.0f}s (after iteration "
                        f"{last_iteration}; observe.watchdog.no_progress_s={w.no_progress_s:g})")
        elif w.startup_s and now - self.started_at > w.startup_s:
            return f"no iteration line in the first {w.startup_s:g}s (observe.watchdog.startup_s)"
        if w.no_output_s and now - self.last_output_at > w.no_output_s:
            return f"no output from any node for {now - self.last_output_at:.0f}s (observe.watchdog.no_output_s)"
        return None


def report(why: str, actors: list, node_names: list[int], report_dir: Path, *, py_spy: bool) -> str:
    """Every rank's stack dump on every node (`actors`: their node actors; `node_names`: what to call them),
    written to `report_dir` with `summary.txt`; returns the one-line summary."""
    say(f"hang detected: {why}; collecting the stacks of every rank")
    report_dir.mkdir(parents=True, exist_ok=True)
    dumps: list[StackDump] = []
    if py_spy:
        refs = {actor.stacks.remote(): rank for rank, actor in enumerate(actors)}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=_STACKS_TIMEOUT_S)
        for ref in ready:
            try:
                dumps += ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a node that cannot answer is named in the summary
                say(f"  node {node_names[refs[ref]]}: no stacks ({type(e).__name__})")
    for d in dumps:
        name = f"rank-{int(d.rank):04d}.txt" if d.rank.isdigit() else f"{d.rank.replace(':', '-')}.txt"
        (report_dir / name).write_text(d.text + (f"\n# py-spy error: {d.error}\n" if d.error else ""))
    summary = summarize(dumps) if dumps else "no stacks collected (observe.watchdog.py_spy is off)"
    (report_dir / "summary.txt").write_text(f"{why}\n{summary}\n")
    say(f"stacks: {summary}")
    say(f"hang report: {report_dir}")
    return summary
