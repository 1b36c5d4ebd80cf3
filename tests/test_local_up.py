"""`a4ray local up` as a newcomer meets it: started as `.venv/bin/a4ray local up` with the virtualenv not
activated, in a fresh checkout, then `ray job submit` onto it. One cluster for the module:

- its control plane is closed: token authentication, the head on loopback; an unauthenticated submission
  is refused, the same user's `RAY_AUTH_MODE=token ray job submit` (the line it prints) is accepted;
- jobs find the Python a4ray runs in, not the caller's `python`;
- `a4ray stage -f jobs/qwen3_next_local.yaml` on a fresh checkout makes the stand-ins it stages;
- the headline command with no --config, submitted as a Ray job after that, rehearses on simulated nodes, saying so
  in one line, and finds stage cached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from conftest import PYTHON, fresh_checkout, isolated_env, local_up, run_to_end, wait_gone

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).parent / "ray")  # the venv's CLI, by path: PATH below does not have it


def _without_venv(path: str) -> str:
    venv_bin = os.path.dirname(sys.executable)
    return os.pathsep.join(p for p in path.split(os.pathsep) if p and p != venv_bin)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """`a4ray local up` in a fresh checkout (jobs/ only), its venv not on PATH, RAY_AUTH_MODE not set."""
    checkout = fresh_checkout(tmp_path_factory)
    env = isolated_env(checkout, PATH=_without_venv(os.environ["PATH"]))
    env.pop("RAY_AUTH_MODE")
    with local_up(checkout, env) as up:
        yield up


def _submit(up, *command: str, auth: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(up.env, **({"RAY_AUTH_MODE": "token"} if auth else {}))
    return run_to_end([RAY, "job", "submit", "--address", up.address, "--working-dir", ".", "--", *command],
                      cwd=up.root, env=env, timeout=timeout)


def test_the_control_plane_is_closed_and_says_how_to_submit(up):
    said = up.said
    assert f"RAY_AUTH_MODE=token RAY_ADDRESS={up.address} ray job submit --working-dir . --" in said
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    assert token and token not in said
    assert oct((Path.home() / ".ray" / "auth_token").stat().st_mode & 0o777) == "0o600"
    # Unauthenticated: the Jobs API (remote code execution for whoever reaches it) refuses.
    request = urllib.request.Request(f"{up.address}/api/jobs/", method="POST", data=json.dumps(
        {"entrypoint": "echo pwned"}).encode(), headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 401
    denied = _submit(up, "echo", "pwned", auth=False, timeout=60)
    assert denied.returncode != 0 and "pwned" not in denied.stdout
    # The head listens on loopback only: GCS, dashboard and job API, Ray Client.
    tree = [up.head.pid] + [p.pid for p in psutil.Process(up.head.pid).children(recursive=True)]
    head_ports = {int(up.address.rsplit(":", 1)[1]), up.client_port}
    listening = [c for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.pid in tree]
    gcs = [c for c in listening if "gcs_server" in " ".join(psutil.Process(c.pid).cmdline()[:1])]
    assert gcs and all(c.laddr.ip in ("127.0.0.1", "::ffff:127.0.0.1") for c in gcs), gcs
    for c in listening:
        if c.laddr.port in head_ports:
            assert c.laddr.ip in ("127.0.0.1", "::ffff:127.0.0.1"), c


def test_a_submitted_job_finds_the_python_a4ray_runs_in(up):
    # The caller's PATH has no virtualenv: `python` here is another Python, without Ray or a4ray.
    done = _submit(up, "python", "-c", "import sys, ray, a4ray; print('python:', sys.executable)")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"python: {os.path.dirname(sys.executable)}/" in done.stdout


@pytest.fixture(scope="module")
def staged_directly(up) -> str:
    """`a4ray stage -f jobs/qwen3_next_local.yaml` on the module's fresh checkout, once, on an embedded cluster
    (its own RAY_TMPDIR: it does not find the local one); what it printed."""
    direct = run_to_end([PYTHON, "-m", "a4ray.stage", "-f", "jobs/qwen3_next_local.yaml"], cwd=up.root,
                        env=isolated_env(up.root), timeout=600)
    assert direct.returncode == 0, direct.stdout[-3000:] + direct.stderr[-3000:]
    return direct.stdout


def test_stage_on_a_fresh_checkout_makes_the_standins_it_stages(staged_directly):
    assert "stand-ins in" in staged_directly and "3 artifact(s) (3 ran)" in staged_directly  # none there before


def test_the_headline_command_after_staging_directly_rehearses_on_simulated_nodes_and_finds_stage_cached(
        up, staged_directly):
    """`python -m a4ray.qwen3_next` (no --config) submitted as a Ray job after `a4ray stage` on the same checkout: it
    says in one line that it rehearses on simulated nodes with the local profile, and its stage step is a cache hit
    (its driver runs in a copy of the working dir, and stages into the checkout's workspace all the same)."""
    checkout = up.root
    # The stand-ins made again by hand are the same: kept as they are, so what was staged stays current.
    made = subprocess.run([PYTHON, "-m", "a4ray.cli", "standins", "--out", ".a4ray/standins"], cwd=checkout,
                          env=up.env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    # Its stage step alone: the other steps as a Ray job onto `local up` are test_dashboard's notebook run's (converted,
    # verified, preflighted, trained there).
    headline = _submit(up, PYTHON, "-m", "a4ray.qwen3_next", "--skip", "convert,preflight,train")
    out = headline.stdout + headline.stderr
    assert headline.returncode == 0, out[-4000:]
    said = [line for line in out.splitlines() if "rehearsing" in line]
    assert len(said) == 1 and "simulated A4 nodes" in said[0] and "qwen3_next_local.yaml" in said[0], said
    assert "3 artifact(s) (3 cached)" in out, out[-4000:]
    assert "step convert: skipped: --skip convert (no step after it runs)" in out, out[-4000:]


def test_a_process_record_outlives_a_step_of_the_wall_clock(monkeypatch):
    """A record of a running process (this `local up`, a run's driver, a node actor owning its pipes) names it by pid
    and a start mark. psutil's create_time() moves with the kernel's boot time, which moves when the wall clock is
    stepped: CI once saw `a4ray local status` find its own running cluster's record stale and remove it. The mark
    does not move; a process that has ended, or another with its pid, is not the one marked."""
    import psutil._pslinux

    from a4ray.core.liveness import start_mark, still_running

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        mark, created = start_mark(child.pid), psutil.Process(child.pid).create_time()
        booted = psutil._pslinux.boot_time()
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: booted + 2.0)  # the wall clock stepped 2 s
        assert psutil.Process(child.pid).create_time() != created  # what the records held: read as another process
        assert still_running(child.pid, mark) and not still_running(os.getpid(), mark)
        monkeypatch.undo()
        assert still_running(child.pid, created)  # a record written before marks: its create_time, within 1 s
    finally:
        child.kill()
        child.wait()
    assert not still_running(child.pid, mark) and not still_running(child.pid, created)


def test_local_status_then_local_down_stops_it(up):
    """Last in the module: it stops the module's cluster the way a person does from another terminal."""
    said = up.said
    assert "python -m a4ray.qwen3_next" in said and "ddp_test" not in said  # the README's headline job
    assert "local Ray cluster (a4ray local up) at" in said and "embedded" not in said
    cli = [PYTHON, "-m", "a4ray.cli", "local"]
    status = subprocess.run([*cli, "status"], cwd=up.root, env=up.env, capture_output=True, text=True,
                            timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"pid {up.head.pid}" in status.stdout and "2 simulated a4-highgpu-8g node(s) x 1 GPUs" in status.stdout
    assert f"dashboard and job API: {up.address}" in status.stdout
    down = subprocess.run([*cli, "down"], cwd=up.root, env=up.env, capture_output=True, text=True,
                          timeout=180)
    assert down.returncode == 0 and "stopped" in down.stdout, down.stdout + down.stderr
    assert up.head.wait(timeout=30) == 0
    assert not wait_gone(up.env["RAY_TMPDIR"])  # its nodes and head are gone with it
    after = subprocess.run([*cli, "status"], cwd=up.root, env=up.env, capture_output=True, text=True,
                           timeout=120)
    assert after.returncode == 1 and "no a4ray local up is running" in after.stdout
