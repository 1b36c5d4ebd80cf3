"""a4ray's rank launcher against torchrun itself: the same env contract for the ranks, a rendezvous
across two "nodes" (two launchers), the first failure named in torchrun's form and nothing left running."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
from conftest import REPO, free_port

from a4ray.runtime.supervisor import root_cause

PROBE = str(REPO / "tests" / "programs" / "rank_probe.py")
# What legitimately differs: the run id is the launch's, and without an agent rank 0 hosts the store.
DIFFERENT_BY_DESIGN = {"TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID"}


def launcher(kind: str, node_rank: int, nnodes: int, nproc: int, port: int, *extra: str) -> list[str]:
    common = [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}"]
    if kind == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *common, f"--nproc-per-node={nproc}",
                "--max-restarts=0", "--tee=3", PROBE, *extra]
    return [sys.executable, "-m", "a4ray.runtime.ranks", *common, f"--nproc={nproc}", "--grace-s=2", "--",
            PROBE, *extra]


def envs(output: str) -> dict[str, dict]:
    """{RANK: env} from the probes' ENV lines, each prefixed by its local rank as torchrun --tee does."""
    found = {}
    for line in output.splitlines():
        if "]:ENV " in line:
            prefix, payload = line.split("ENV ", 1)
            env = json.loads(payload)
            assert prefix == f"[default{env['LOCAL_RANK']}]:", line
            found[env["RANK"]] = env
    return found


def run_nodes(kind: str, nnodes: int, nproc: int, *extra: str) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = [subprocess.Popen(launcher(kind, r, nnodes, nproc, port, *extra), cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(nnodes)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in zip(procs, outs)]


def test_ranks_get_torchruns_env_and_rendezvous_across_two_nodes():
    ours = run_nodes("a4ray", nnodes=2, nproc=2)
    theirs = run_nodes("torchrun", nnodes=2, nproc=2)
    for done in ours + theirs:
        assert done.returncode == 0, done.stdout
    ours_env = {k: v for d in ours for k, v in envs(d.stdout).items()}
    theirs_env = {k: v for d in theirs for k, v in envs(d.stdout).items()}
    assert sorted(ours_env) == sorted(theirs_env) == ["0", "1", "2", "3"]
    for rank in ours_env:
        mine = {k: v for k, v in ours_env[rank].items() if k not in DIFFERENT_BY_DESIGN | {"MASTER_PORT"}}
        torchruns = {k: v for k, v in theirs_env[rank].items() if k not in DIFFERENT_BY_DESIGN | {"MASTER_PORT"}}
        assert mine == torchruns, rank
    assert sum(d.stdout.count("all_reduce ok on rank") for d in ours) == 4


def test_first_failing_rank_stops_the_node_and_is_named():
    start = time.monotonic()
    [done] = run_nodes("a4ray", 1, 3, "--fail-rank=1", "--code=7")
    assert done.returncode == 7, done.stdout
    assert time.monotonic() - start < 60  # the sleeping ranks were stopped, not waited for (they sleep 120s)
    assert root_cause(done.stdout.splitlines()) == (1, 1, 7)
    assert not [p for p in psutil.process_iter(["cmdline"]) if PROBE in " ".join(p.info["cmdline"] or [])]


def test_sigterm_ends_every_rank():
    port = free_port()
    proc = subprocess.Popen(launcher("a4ray", 0, 1, 2, port, "--fail-rank=99"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children: list[psutil.Process] = []
    deadline = time.monotonic() + 30
    while len(children) < 2 and time.monotonic() < deadline:
        children = psutil.Process(proc.pid).children()
        time.sleep(0.05)
    assert len(children) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive


def test_a_stop_while_the_node_exits_keeps_the_failed_ranks_code():
    """The gang stops every node on a launcher's report, its own too: the SIGTERM can land while the launcher is
    exiting with the failed rank's code, after Python has put back SIGTERM's default action. The code stays the
    rank's (CI once recorded the node 'exited with code -15')."""
    port = free_port()
    proc = subprocess.Popen(launcher("a4ray", 0, 1, 2, port, "--fail-rank=1", "--code=7"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "Root Cause" in line:
            break
    while proc.poll() is None:  # as the node actor's stop would, at any moment of the exit
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            break
        time.sleep(0.0005)
    proc.communicate(timeout=30)
    assert proc.returncode == 7
