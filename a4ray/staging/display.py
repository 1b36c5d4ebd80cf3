"""Progress of staging: what a staging task reports, and how a driver shows it.

A staging task measures the bytes in its partial directory once a second (whatever tool writes them:
huggingface_hub, hf_xet, gcsfs, git, our own GETs), and publishes a `Progress` snapshot to the staging
service (every requester of the artifact, in any job, polls it from there) and as Ray metrics.

Ray metrics (`ray.util.metrics`, exported by each node's metrics agent to Prometheus and the Ray
dashboard), tagged `artifact` (its name) and `target` (its absolute target directory):

    a4ray_stage_bytes             gauge    bytes staged so far (in the partial directory)
    a4ray_stage_total_bytes       gauge    bytes of the whole artifact (0 while unknown)
    a4ray_stage_rate_bytes_per_s  gauge    transfer rate over the last few seconds
    a4ray_stage_runs_total        counter  finished staging tasks, also tagged `outcome`: ran | cached | failed

A driver prints one line per artifact every few seconds in the job log, or a live bar on a terminal.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from a4ray.core.console import say
from a4ray.staging.layout import tree_bytes

Phase = Literal["queued", "waiting", "listing", "downloading", "copying", "verifying", "publishing", "done", "failed"]
MOVING: tuple[Phase, ...] = ("downloading", "copying")  # bytes arrive: a rate and an ETA mean something


class Progress(BaseModel):
    artifact: str
    target: str
    phase: Phase = "queued"
    bytes: int = 0
    total: int | None = None
    rate: float = 0.0  # bytes/s
    node: str = ""
    pid: int = 0
    note: str = ""

    @property
    def eta_s(self) -> float | None:
        if self.total is None or self.rate <= 0 or self.phase not in MOVING:
            return None
        return max(0.0, (self.total - self.bytes) / self.rate)

    def line(self) -> str:
        size = f"{human_bytes(self.bytes)}" + (f" / {human_bytes(self.total)}" if self.total else "")
        pct = f" ({100 * self.bytes / self.total:.0f}%)" if self.total else ""
        rate = f", {human_bytes(self.rate)}/s" if self.rate > 0 and self.phase in MOVING else ""
        eta = f", ETA {human_seconds(self.eta_s)}" if self.eta_s is not None else ""
        note = f" - {self.note}" if self.note else ""
        where = f" on {self.node}" if self.node else ""
        return f"stage {self.artifact}: {self.phase}{where} {size}{pct}{rate}{eta}{note}"


def human_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_seconds(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


_METRICS: dict[str, object] = {}


def _metrics() -> dict[str, object]:
    if not _METRICS:
        from ray.util.metrics import Counter, Gauge

        tags = ("artifact", "target")
        _METRICS.update(
            bytes=Gauge("a4ray_stage_bytes", "bytes staged so far", tag_keys=tags),
            total=Gauge("a4ray_stage_total_bytes", "bytes of the whole artifact (0 while unknown)", tag_keys=tags),
            rate=Gauge("a4ray_stage_rate_bytes_per_s", "staging transfer rate", tag_keys=tags),
            runs=Counter("a4ray_stage_runs_total", "finished staging tasks", tag_keys=(*tags, "outcome")),
        )
    return _METRICS


class Reporter:
    """Inside a staging task: the current phase and bytes, sent to `sink` and to Ray metrics."""

    def __init__(self, artifact: str, target: str, sink: Callable[[Progress], None] | None = None):
        self.state = Progress(artifact=artifact, target=target, node=socket.gethostname(), pid=os.getpid())
        self.sink = sink
        self.tags = {"artifact": artifact, "target": target}
        self._lock = threading.Lock()

    def update(self, **changes) -> None:
        with self._lock:
            self.state = self.state.model_copy(update=changes)
            snapshot = self.state
        try:
            m = _metrics()
            m["bytes"].set(snapshot.bytes, tags=self.tags)
            m["total"].set(snapshot.total or 0, tags=self.tags)
            m["rate"].set(snapshot.rate, tags=self.tags)
        except Exception:  # noqa: BLE001 - metrics are best effort (no metrics agent outside Ray)
            pass
        if self.sink:
            try:
                self.sink(snapshot)
            except Exception:  # noqa: BLE001 - progress must never fail a download
                pass

    def finished(self, outcome: str) -> None:
        try:
            _metrics()["runs"].inc(tags={**self.tags, "outcome": outcome})
        except Exception:  # noqa: BLE001
            pass

    @contextlib.contextmanager
    def watching(self, root: Path, interval_s: float = 1.0) -> Iterator[None]:
        """Measure the bytes under `root` every `interval_s` while the body runs."""
        stop = threading.Event()
        window: list[tuple[float, int]] = []

        def poll() -> None:
            while True:
                now, size = time.monotonic(), tree_bytes(root)
                window.append((now, size))
                del window[:-6]  # rate over the last ~5 samples: steady, yet follows changes
                t0, b0 = window[0]
                rate = (size - b0) / (now - t0) if now > t0 else 0.0
                self.update(bytes=size, rate=max(rate, 0.0))
                if stop.wait(interval_s):
                    return

        thread = threading.Thread(target=poll, name="a4ray-stage-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)


class Display:
    """In a driver: show the progress of the artifacts it waits for (job log lines, or a bar on a TTY)."""

    def __init__(self, every_s: float = 5.0, tty: bool | None = None):
        self.every_s = every_s
        self.tty = sys.stdout.isatty() if tty is None else tty
        self._last: dict[str, tuple[float, str, int]] = {}
        self._since: float | None = None
        self._bar = None
        self._tasks: dict[str, int] = {}

    def show(self, snapshots: list[Progress]) -> None:
        if self.tty:
            return self._show_bar(snapshots)
        now = time.monotonic()
        if self._since is None:
            self._since = now
        for p in snapshots:
            last = self._last.get(p.artifact)
            # Quiet for what finishes at once (cache hits): nothing before the first interval has passed.
            if now - self._since < min(self.every_s, 2.0):
                continue
            changed = last is None or last[1] != p.phase
            due = last is not None and now - last[0] >= self.every_s and last[2] != p.bytes
            if changed or due:
                say(p.line())
                self._last[p.artifact] = (now, p.phase, p.bytes)

    def _show_bar(self, snapshots: list[Progress]) -> None:
        from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn
        from rich.progress import Progress as Bar

        if self._bar is None:
            self._bar = Bar(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TimeRemainingColumn(), transient=False)
            self._bar.start()
        for p in snapshots:
            if p.artifact not in self._tasks:
                self._tasks[p.artifact] = self._bar.add_task(p.artifact, total=p.total)
            self._bar.update(self._tasks[p.artifact], completed=p.bytes, total=p.total,
                             description=f"{p.artifact} ({p.phase})")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
