"""A dead rank on the A4 shape, in miniature: 2 nodes x 2 ranks, the other ranks blocked without error as NCCL
peers of a dead rank are (gloo's would fail at once and hide what follows). The rank is SIGKILLed after starting
a helper that inherits its stdout and one that left its group with `setsid`: the node sees the death from the
pid, not from the pipe the helper holds open; the gang stops at once, naming the rank, its node and the signal;
and no process of the launch is left, the helpers included. With a4ray's launcher and with torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import psutil
import pytest
from conftest import REPO, free_port, job
from test_gang import assert_no_leftovers

from a4ray.driver.execute import run
from a4ray.runtime.supervisor import root_cause

PROGRAM = str(REPO / "tests" / "programs" / "dead_rank.py")


def helpers(marker: str) -> list[psutil.Process]:
    """The victim's helpers still alive (found by the marker in their command lines, as `ps` shows them)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if marker in (proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def test_the_launcher_sees_a_dead_rank_by_its_pid_and_stops_every_process_of_the_node():
    """One node's launcher alone: a rank whose helpers hold its stdout open is seen dead, reported in torchrun's
    form, and its peers and helpers (the setsid one too: the launcher is their subreaper) are stopped."""
    marker = f"a4ray-helper-{uuid.uuid4().hex[:8]}"
    argv = [sys.executable, "-m", "a4ray.runtime.ranks", "--nnodes=1", "--node-rank=0", "--nproc=2",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--grace-s=2", "--", PROGRAM, "1", marker]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + 9, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert root_cause(lines) == (1, 1, -9), done.stdout
    assert "exitcode  : -9 (pid terminated by SIGKILL)" in done.stdout
    assert "[default1]:rank 1: helpers started; the last line before the kill" in lines
    assert not helpers(marker), [p.cmdline() for p in helpers(marker)]


@pytest.mark.parametrize("launcher", ["a4ray", "torchrun"])
def test_a_rank_killed_beside_blocked_peers_ends_the_gang_naming_it(local_cluster, tmp_path, launcher):
    marker = f"a4ray-helper-{uuid.uuid4().hex[:8]}"
    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=2", "cluster.stop_grace_s=2",
               f"cluster.launcher={launcher}", f"command.argv=[{PROGRAM}, '3', {marker}]", "command.torchrun=true",
               workspace=tmp_path)
    result = run(spec)
    gang = result.gang
    assert not result.ok and gang.failure_kind == "failed"
    text = gang.failure
    assert text.startswith("rank 3 (local rank 1) on node 1 (") and " was killed by SIGKILL; " in text, text
    assert "helpers started; the last line before the kill" in text  # that rank's last lines
    nodes = {n.rank: n.status for n in gang.nodes}
    assert nodes == {0: "stopped", 1: "failed"}, nodes
    [record] = list(tmp_path.rglob("result.json"))
    recorded = json.loads(record.read_text())
    assert recorded["ok"] is False and recorded["gang"]["failure"] == text
    assert_no_leftovers(gang.launch_id)
    assert not helpers(marker), [p.cmdline() for p in helpers(marker)]


def test_a_sigkill_is_put_down_to_the_oom_killer_only_when_the_kernel_counted_one(tmp_path):
    """The launcher reads its cgroup's memory.events (cgroup v2) at start and again when a rank dies of SIGKILL: only
    a higher oom_kill count names the kernel's OOM killer; any other end, or no count, says nothing."""
    from a4ray.runtime.ranks import OomKills

    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n")
    oom = OomKills()
    oom.path = events
    oom.start = oom.count()
    assert oom.start == 1 and oom.why(-9) is None  # a SIGKILL from someone else
    events.write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert oom.why(-9) == f"the kernel's OOM killer (oom_kill 1 -> 2 in {events})"
    assert oom.why(1) is None and oom.why(-15) is None
    oom.path = None  # no cgroup v2 memory controller here: nothing to go on
    assert oom.why(-9) is None


def test_a_killed_rank_that_printed_nothing_is_a_cause_not_the_echo_of_its_own_peers():
    """A rank SIGKILLed prints nothing; the other ranks of its node fail with gloo's "Connection reset by peer", about
    it. Its node's report is a cause, whatever those peers said; another node whose reported rank failed with those
    words is the echo. Before, the killed rank's node was judged by all its ranks' lines, and a verdict that heard
    the other node first waited 3 s (_ECHO_WAIT_S) for a cause it already had."""
    from a4ray.runtime.ranks import FAILURE_HEADER
    from a4ray.runtime.supervisor import Outcome, Supervisor

    def report(rank: int, local: int, code: int) -> list[str]:
        return [FAILURE_HEADER, "Root Cause (first observed failure):", "  time      : 2026-11-29_04:13:08",
                "  host      : vm", f"  rank      : {rank} (local_rank: {local})", f"  exitcode  : {code}"]

    reset = "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:5274: Connection reset by peer."
    closed = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:65171."
    supervisor = Supervisor.__new__(Supervisor)  # only what _echo reads: the nodes' and the ranks' last lines
    supervisor.outcome = Outcome()
    supervisor.outcome.tails = {0: [reset, *report(1, 1, -9)], 1: [closed, *report(2, 0, 1)]}
    supervisor.rank_tails = {(0, 0): [reset], (1, 0): [closed]}
    assert not supervisor._echo(0)
    assert supervisor._echo(1)
