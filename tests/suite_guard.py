"""The suite leaves nothing behind, and says what it cost: a pytest plugin (tests/conftest.py loads it).

Every process the suite starts carries `A4RAY_TEST_SUITE=<this run's id>` in its environment: pytest's controller
sets it before the xdist workers start, and every driver, Ray node, rank, Prometheus and browser inherits it. So
the controller, once every worker has ended, finds what still runs by that mark (whoever its parent is now: Ray's
daemons are re-parented to init), ends it and fails the run naming it. It fails the run naming what appeared in the
temp directories (`/tmp`, `/dev/shm`) during the run and is still there. While the suite runs it counts the Ray
clusters started (each one's GCS process), which it prints at the end with the slowest tests.

A run inside a run (a test that starts pytest) finds the mark set already and leaves the guarding to the outer one.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

MARK = "A4RAY_TEST_SUITE"
NO_CLUSTERS = "A4RAY_TEST_NO_CLUSTERS"  # set by `make test-quick`: a test that starts a Ray cluster fails the run
TEMP_DIRS = (Path(tempfile.gettempdir()), Path("/dev/shm"))
# Kept on purpose across runs by what made them: the per-user roots of pytest's own numbered directories (it removes
# this run's on a pass and keeps a failed run's for a look), torch inductor's per-user cache (importing megatron-core
# makes it in every process that does, the tests' own included), the JVM's perf-data directory, and a4ray's
# machine-wide lock files of the loopback address blocks its simulated clusters take (an empty file a block), and
# Ray's machine-wide temp root (`ray`, made by any Ray on the machine; each cluster's own directory in it is checked).
KEPT_BY_THEIR_TOOLS = ("pytest-of-", "torchinductor_", "hsperfdata_", "a4ray-loopback")
RAY_TEMP_ROOT = "ray"
GRACE_S = 30  # for processes still winding down as the last worker ends (a Ray node's shutdown takes seconds)


def _marked(proc: psutil.Process, mark: str) -> bool:
    try:
        return proc.environ().get(MARK) == mark
    except psutil.Error:
        return False


class Guard:
    def __init__(self, mark: str):
        self.mark = mark
        self.before = {d: set(os.listdir(d)) for d in TEMP_DIRS if d.is_dir()}
        self.clusters: set[int] = set()  # GCS pids seen with the mark: one per Ray cluster
        self._stop = threading.Event()
        self._seen: dict[int, bool] = {}
        threading.Thread(target=self._count_clusters, daemon=True, name="suite-guard").start()

    def _count_clusters(self) -> None:
        """Every second: a cluster lives for seconds at least (its start alone takes several)."""
        while not self._stop.wait(1.0):
            for proc in psutil.process_iter(["name"]):
                if proc.info["name"] == "gcs_server" and proc.pid not in self._seen:
                    self._seen[proc.pid] = _marked(proc, self.mark)
                    if self._seen[proc.pid]:
                        self.clusters.add(proc.pid)

    def survivors(self) -> list[psutil.Process]:
        me = os.getpid()
        return [p for p in psutil.process_iter() if p.pid != me and _marked(p, self.mark)]

    def left_in_temp(self) -> list[Path]:
        return [d / name for d, before in self.before.items() for name in sorted(set(os.listdir(d)) - before)
                if not name.startswith(KEPT_BY_THEIR_TOOLS) and name != RAY_TEMP_ROOT]

    def finish(self) -> list[str]:
        """What the run left, as lines to fail the run with: its processes still running (ended here) and what it
        made in the temp directories."""
        self._stop.set()
        deadline = time.monotonic() + GRACE_S
        while (alive := self.survivors()) and time.monotonic() < deadline:
            time.sleep(1)
        problems = []
        for proc in alive:
            try:
                problems.append(f"process {proc.pid} still runs: {' '.join(proc.cmdline())[:300]}")
                proc.send_signal(signal.SIGKILL)
            except psutil.Error:
                continue
        # Named, not removed: what appeared in /tmp during the run may be another run's on the same machine.
        problems += [f"left in {path.parent}: {path.name}" for path in self.left_in_temp()]
        return problems


_guard: Guard | None = None


def pytest_configure(config):
    global _guard
    if hasattr(config, "workerinput") or MARK in os.environ or config.option.collectonly:
        return  # a worker (the controller guards), a run inside a run, or nothing to run
    os.environ[MARK] = uuid.uuid4().hex
    _guard = Guard(os.environ[MARK])


@pytest.hookimpl(trylast=True)  # after pytest's own tmp_path clean-up and every worker's end
def pytest_sessionfinish(session):
    if _guard is None:
        return
    session.config.stash[_PROBLEMS] = problems = _guard.finish()
    if os.environ.get(NO_CLUSTERS) and _guard.clusters:
        problems.append(f"{len(_guard.clusters)} Ray cluster(s) started where {NO_CLUSTERS} is set (the quick tier): "
                        "mark the tests that start one slow (tests/conftest.py)")
    if problems and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_PROBLEMS = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, config):
    if _guard is None:
        return
    tr = terminalreporter
    tr.write_sep("-", f"Ray clusters started by this run: {len(_guard.clusters)}")
    problems = config.stash.get(_PROBLEMS, [])
    if problems:
        tr.write_sep("!", f"{len(problems)} problem(s) with what the suite started (its processes ended now)", red=True)
        for line in problems:
            tr.write_line(line)
