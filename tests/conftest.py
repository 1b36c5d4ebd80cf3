"""Shared fixtures: one real multi-node local Ray cluster of simulated A4 nodes for the whole session.

Tests that damage a cluster (remove nodes) start their own with `fresh_cluster`. Subprocess tests that
must not find the session cluster run with `isolated_env()` (their own RAY_TMPDIR, no RAY_ADDRESS).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import ray

from a4ray.runtime.connect import NAMESPACE
from a4ray.runtime.simulated import SimulatedCluster
from a4ray.spec import load_job

REPO = Path(__file__).resolve().parents[1]
SESSION_NODES = 3
SESSION_GPUS = 2
# A secret in the session nodes' environment, as kuberay.secrets puts one on A4 (specs never hold one).
NODE_SECRET = "a4ray-nodeSECRET-0123456789abcdef"


@pytest.fixture(scope="session")
def _session_cluster():
    cluster = SimulatedCluster(SESSION_NODES, SESSION_GPUS,
                               node_env={i: {"A4RAY_TEST_API_KEY": NODE_SECRET} for i in range(SESSION_NODES)})
    cluster.start()
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def local_cluster(_session_cluster):
    """3 simulated A4 nodes x 2 logical GPUs, shared by the session; this process is connected to it."""
    if ray.is_initialized() and ray.get_runtime_context().gcs_address != _session_cluster.address:
        ray.shutdown()
    if not ray.is_initialized():
        ray.init(address=_session_cluster.address, namespace=NAMESPACE)
    return _session_cluster


@pytest.fixture
def fresh_cluster():
    """A private cluster factory for tests that kill nodes; the session cluster is left alone (and
    reconnected afterwards if it was connected)."""
    made: list[SimulatedCluster] = []
    previous = ray.get_runtime_context().gcs_address if ray.is_initialized() else None

    def make(nodes: int = 2, gpus: int = 1, **kw) -> SimulatedCluster:
        if ray.is_initialized():
            ray.shutdown()
        cluster = SimulatedCluster(nodes, gpus, **kw)
        cluster.start()
        ray.init(address=cluster.address, namespace=NAMESPACE)
        made.append(cluster)
        return cluster

    yield make
    if ray.is_initialized():
        ray.shutdown()
    for cluster in made:
        cluster.shutdown()
    if previous:
        ray.init(address=previous, namespace=NAMESPACE)


def job(kind: str, *sets: str, workspace: Path | None = None):
    """A job spec of `kind` with overrides, its local workspace under `workspace` (a tmp dir)."""
    extra = [f"storage.local_workspace={workspace}"] if workspace else []
    return load_job(None, [*extra, *sets], kind=kind)


def isolated_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Env for a subprocess that must start its own embedded cluster (no RAY_ADDRESS, own RAY_TMPDIR)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    ray_tmp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))  # short: Ray's socket paths have a limit
    # RAY_AUTH_MODE=token: what `a4ray local up` tells the same user to submit with (the token is in its file).
    env.update(RAY_TMPDIR=str(ray_tmp), PYTHONPATH=str(REPO), RAY_AUTH_MODE="token", **extra)
    return env


PYTHON = sys.executable


def leftovers(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (a RAY_TMPDIR, a launch id, ...)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(proc.info["cmdline"] or []):
                found.append(" ".join(proc.info["cmdline"]))
        except psutil.Error:
            continue
    return found


def wait_gone(marker: str, within_s: float = 30) -> list[str]:
    deadline = time.monotonic() + within_s
    while (left := leftovers(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_up(cwd: Path, env: dict[str, str], nodes: int = 2, gpus: int = 1):
    """`a4ray local up` (2 simulated nodes x 1 GPU) running while the block runs; yields its job API
    address and its Ray Client address."""
    dashboard, client = free_port(), free_port()
    head = subprocess.Popen([PYTHON, "-m", "a4ray.cli", "local", "up", "--nodes", str(nodes), "--gpus-per-node",
                             str(gpus), "--dashboard-port", str(dashboard), "--client-port", str(client)],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in head.stdout:
            if "ready" in line:
                break
        else:
            pytest.fail("a4ray local up did not come up")
        yield f"http://127.0.0.1:{dashboard}", f"ray://127.0.0.1:{client}"
    finally:
        head.send_signal(signal.SIGINT)
        head.wait(timeout=60)
