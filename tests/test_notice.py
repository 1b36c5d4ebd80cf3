"""The notice's addressees (runtime/notice.py): a launch's rank processes, not the launcher and not a rank's own
forked helpers, which inherit RANK (an async save's writer, a data-loader worker) and would die of the signal's
default action. Real processes: a launcher-like parent without RANK, two ranks, one of which forks a helper.
The whole stop with notice, end to end on 4 simulated nodes: test_pipeline's 4-node cancel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from a4ray.runtime.notice import NOTICE_SIGNAL, give_notice
from a4ray.runtime.notice import main as notice_main
from a4ray.runtime.process import LAUNCH_ID_VAR, launch_processes, rank_processes

# A rank: acts on the notice by printing and ending; its forked helper ignores nothing (the default action ends it).
RANK = """
import os, signal, sys, time
if os.environ["RANK"] == "0" and os.fork() == 0:
    time.sleep(60)
    os._exit(0)
signal.signal(signal.SIGUSR1, lambda *_: (print("noticed", os.environ["RANK"], flush=True), sys.exit(0)))
print("up", flush=True)
time.sleep(60)
"""
LAUNCHER = f"""
import os, subprocess, sys, time
ranks = [subprocess.Popen([sys.executable, "-c", {RANK!r}], env={{**os.environ, "RANK": str(r), "LOCAL_RANK": str(r)}},
                          stdout=sys.stdout) for r in range(2)]
time.sleep(60)
"""


def _launch(tmp_path, launch_id: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], env={**env, LAUNCH_ID_VAR: launch_id},
                                stdout=open(tmp_path / "out", "w"), start_new_session=True)
    deadline = time.monotonic() + 30
    while (tmp_path / "out").read_text().count("up") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return launcher


def _end(launcher: subprocess.Popen, launch_id: str) -> None:
    os.killpg(launcher.pid, signal.SIGKILL)
    for proc in launch_processes(None, launch_id):
        proc.kill()
    launcher.wait()


def test_the_notice_reaches_each_rank_and_nothing_else(tmp_path):
    launch_id = f"notice-test-{os.getpid()}"
    launcher = _launch(tmp_path, launch_id)
    try:
        procs = launch_processes(launcher.pid, launch_id)
        assert len(procs) == 4  # the launcher, two ranks, rank 0's helper
        ranks = rank_processes(procs)
        assert sorted(p.environ()["RANK"] for p in ranks) == ["0", "1"]
        helper = next(p for p in procs if p.pid not in {r.pid for r in ranks} and p.pid != launcher.pid)

        assert give_notice(launcher.pid, launch_id) == 2
        deadline = time.monotonic() + 10
        while sorted((tmp_path / "out").read_text().split("noticed")[1:]) != [" 0\n", " 1\n"] and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted((tmp_path / "out").read_text().split("noticed")[1:]) == [" 0\n", " 1\n"]
        assert launcher.poll() is None and helper.is_running()  # neither was told
        assert NOTICE_SIGNAL == signal.SIGUSR1
    finally:
        _end(launcher, launch_id)


def test_the_pods_prestop_hook_gives_every_launch_here_the_notice_and_waits_for_its_ranks(tmp_path, capsys):
    """`python -m a4ray.runtime.notice`, as a worker pod's preStop hook runs it (k8s/render.py): every a4ray launch's
    ranks on the machine, found by their launch id, are told, and the hook returns once they have ended."""
    launch_id = f"notice-hook-{os.getpid()}"
    launcher = _launch(tmp_path, launch_id)
    try:
        assert notice_main(["--grace-s", "20", "--launch-id", launch_id]) == 0  # not the suite's other launches
        said = capsys.readouterr().out
        assert "a4ray notice: 2 rank(s) told to save and end (SIGUSR1)" in said and "every rank ended" in said
        assert sorted((tmp_path / "out").read_text().split("noticed")[1:]) == [" 0\n", " 1\n"]
        assert launcher.poll() is None
    finally:
        _end(launcher, launch_id)
