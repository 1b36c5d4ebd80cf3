"""SIGTERM to `a4ray run`'s whole process group, as `timeout` and CI runners send it: the run ends within seconds,
cancelled, with nothing of it left. The embedded cluster's processes run in sessions of their own, so the signal
reaches the driver alone, which stops the gang and shuts the cluster down as on Ctrl-C; in the driver's group the
GCS and raylets died with it and the driver waited 60 s for the GCS before dying without a record. (A SIGTERM to the
driver's pid alone, as `kill` sends it, is the same signal to the same process: this test is that proof too.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil
import pytest
from conftest import PYTHON, REPO, isolated_env, wait_gone

pytestmark = pytest.mark.slow

ENDS_WITHIN_S = 10.0
SLEEPER = "import os, time\nprint(f'rank {os.environ[\"RANK\"]} up', flush=True)\ntime.sleep(600)\n"


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `procs` still running (psutil tells a reused pid from the process it was)."""
    left = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(proc)
        except psutil.Error:
            continue
    return left


def _named(procs: list[psutil.Process], word: str) -> list[psutil.Process]:
    found = []
    for proc in procs:
        try:
            if word in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_sigterm_to_the_run_s_process_group_cancels_it_in_seconds_leaving_nothing(tmp_path):
    program = tmp_path / "sleeper.py"
    program.write_text(SLEEPER)
    spec = tmp_path / "sleep.yaml"
    spec.write_text(f"kind: command\nname: group-signal\ncommand: {{argv: [{program}], torchrun: true}}\n"
                    f"cluster: {{nodes: 2, gpus_per_node: 2}}\nstorage: {{local_workspace: {tmp_path / 'ws'}}}\n")
    env = isolated_env(tmp_path)
    result = tmp_path / "result.json"
    proc = subprocess.Popen([PYTHON, "-m", "a4ray.cli", "run", "-f", str(spec), "--result", str(result)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # a process group of its own, as `timeout` gives its command
    try:
        seen: list[str] = []
        while sum("] rank " in line and line.rstrip().endswith(" up") for line in seen) < 4:  # every rank runs
            line = proc.stdout.readline()
            assert line, "".join(seen)
            seen.append(line)
        # Everything the run started: the cluster's GCS, raylets and agents, the node actors, the launchers, the ranks.
        started = psutil.Process(proc.pid).children(recursive=True)
        assert len(_named(started, str(program))) >= 4 and _named(started, "gcs_server"), \
            [" ".join(p.cmdline()) for p in started]
        assert len(_named(started, "raylet/raylet")) == 3  # the head and 2 nodes
        signalled = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=3 * ENDS_WITHIN_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"the run still ran {3 * ENDS_WITHIN_S:g}s after its group's SIGTERM:\n"
                        + "".join(seen) + proc.communicate()[0])
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(seen) + out
    assert proc.returncode == 130, text
    assert took < ENDS_WITHIN_S, f"the run ended {took:.1f}s after the group's SIGTERM:\n{text}"
    assert "a4ray: cancelled" in out and "Failed to connect to GCS" not in out, text
    [record] = (tmp_path / "ws").glob("runs/group-signal-*/result.json")
    assert json.loads(record.read_text())["verdict"].startswith("CANCELLED"), record.read_text()
    assert json.loads(result.read_text())["cancelled"] is True  # --result says so too
    deadline = signalled + ENDS_WITHIN_S
    while (left := _alive(started)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [" ".join(p.cmdline()) for p in _alive(started)]
    assert not wait_gone(env["RAY_TMPDIR"], within_s=0), "no process of the embedded cluster is left"
