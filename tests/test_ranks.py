"""a4ray's rank launcher against torchrun itself: the same env contract for the ranks, a rendezvous
across two "nodes" (two launchers), the first failure named in torchrun's form and nothing left running."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
    # torchrun's agent keeps its ranks' logs in a temp directory of its own that it never removes: the launch's.
    with tempfile.TemporaryDirectory(prefix="launch-") as tmp:
        procs = [subprocess.Popen(launcher(kind, r, nnodes, nproc, port, *extra), cwd=REPO, text=True,
                                  env={**os.environ, "TMPDIR": tmp}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for r in range(nnodes)]
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
    children = started_ranks(proc, 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive


ORPHAN = """
import os, time
if os.fork() == 0:  # a daemon, as a data loader or a checkpoint writer may start: it outlives its parent
    os.setsid()
    if os.fork() == 0:
        time.sleep(0.3)
        os._exit(0)
    os._exit(0)
os.wait()
print("daemon started", flush=True)
time.sleep(30)
"""


def test_an_orphan_that_ends_while_the_ranks_run_is_reaped(tmp_path):
    """A rank's daemon whose parent has gone comes back to the launcher (a child subreaper); when it ends, the
    launcher reaps it while the ranks run (read from the kernel's list of its children every 0.1 s), so no zombie
    is left holding a pid for the node's whole run."""
    (tmp_path / "orphan.py").write_text(ORPHAN)
    proc = subprocess.Popen([sys.executable, "-m", "a4ray.runtime.ranks", "--nnodes=1", "--node-rank=0",
                             "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--nproc=1", "--grace-s=2",
                             "--", str(tmp_path / "orphan.py")], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert "daemon started" in proc.stdout.readline()
        launcher_proc = psutil.Process(proc.pid)
        deadline = time.monotonic() + 10
        while len(launcher_proc.children()) > 1 and time.monotonic() < deadline:  # the rank, the daemon or its zombie
            time.sleep(0.1)
        children = launcher_proc.children()
        assert len(children) == 1 and children[0].status() != psutil.STATUS_ZOMBIE, \
            [(c.pid, c.status(), c.cmdline()) for c in children]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def _stopped(proc: psutil.Process) -> None:
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while proc.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.status() == psutil.STATUS_STOPPED


def test_a_stopped_rank_ends_with_the_stop_not_after_the_grace_period():
    """A stopped rank (SIGSTOP: the chaos tests' and the soak's hang, a debugger, Ctrl-Z) acts on SIGTERM only once it
    is continued: each stop waited out its whole grace period for it before the SIGKILL, 10 s by default after every
    such hang. Both of a4ray's stops send SIGCONT after SIGTERM, as systemd does: the launcher's, of its ranks, and the
    node actor's, of the launch's process tree. Here the grace is 60 s."""
    argv = launcher("a4ray", 0, 1, 2, free_port(), "--fail-rank=99")
    argv[argv.index("--grace-s=2")] = "--grace-s=60"
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children = started_ranks(proc, 2)
    _stopped(children[1])
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 128 + signal.SIGTERM
    assert time.monotonic() - start < 30, "the stopped rank was left for the grace period"
    assert not psutil.wait_procs(children, timeout=10)[1]

    from a4ray.runtime.process import terminate_launch

    tree = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, "
                             "'-c', 'import time; time.sleep(600)']); time.sleep(600)"], start_new_session=True)
    deadline = time.monotonic() + 30
    while not psutil.Process(tree.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    (rank,) = psutil.Process(tree.pid).children()
    _stopped(rank)
    start = time.monotonic()
    assert terminate_launch(tree.pid, None, 60.0) == 2
    assert time.monotonic() - start < 30, "the stopped process was left for the grace period"
    assert tree.wait(timeout=10) == -signal.SIGTERM
    with contextlib.suppress(psutil.NoSuchProcess):  # ended: gone, or a zombie until its new parent reaps it
        assert rank.status() == psutil.STATUS_ZOMBIE


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


# ------------------------------------------------------------------------------------------ warm ranks
def procs(output: str) -> dict[int, list[str]]:
    """{pid: [__name__, argv0, CPU class, session nice, A4RAY_PROBE, cwd]} from the probes' PROC lines."""
    found = {}
    for line in output.splitlines():
        if "]:PROC " in line:
            pid, *rest = line.split("PROC ", 1)[1].split()
            found[int(pid)] = rest
    return found


def started_ranks(proc: subprocess.Popen, n: int) -> list[psutil.Process]:
    """The launcher's n rank processes once each has started (a warm launcher's: before any launch was handed
    to them)."""
    deadline = time.monotonic() + 30
    children: list[psutil.Process] = []
    while len(children) < n and time.monotonic() < deadline:
        children = psutil.Process(proc.pid).children()
        time.sleep(0.05)
    assert len(children) == n, children
    return children


def idle_class_available() -> bool:
    """Whether this process may go to the idle CPU class and back (as a warm rank does where it can)."""
    from a4ray.runtime.warm import _idle_class_returns

    return _idle_class_returns()


def test_warm_ranks_become_the_launch_handed_to_them(tmp_path):
    """Two nodes' launchers stand by with their ranks warm (started for restart 0, on one port), then are handed
    restart 1 on another port with an env of its own, each in the other's place (as a spare node takes a lost one's,
    or a survivor the master's): the very processes started before become the ranks, with
    torchrun's env for the launch handed over (not the one they started with), run the script as `python SCRIPT`
    would (__main__, its argv, its cwd), rendezvous and all-reduce. While they wait they take only idle CPU (the idle
    class and a session nice of 19, where the kernel allows); the launch gets them back at the normal ones."""
    from a4ray.runtime.ranks import warm_argv

    old_port, new_port = free_port(), free_port()
    launchers = [subprocess.Popen(warm_argv(launcher("a4ray", r, 2, 2, old_port)), cwd=REPO, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  start_new_session=True) for r in range(2)]
    warm = {r: started_ranks(p, 2) for r, p in enumerate(launchers)}
    if idle_class_available():  # each goes idle first thing, then imports torch
        deadline = time.monotonic() + 20
        while {os.sched_getscheduler(r.pid) for node in warm.values() for r in node} != {os.SCHED_IDLE}:
            assert time.monotonic() < deadline, "the warm ranks did not take the idle class"
            time.sleep(0.05)
    for r, proc in enumerate(launchers):
        argv = launcher("a4ray", 1 - r, 2, 2, new_port)
        argv[argv.index("--grace-s=2")] = "--restart-count=1"
        env = {**os.environ, "A4RAY_PROBE": "handed"}
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"argv": argv[3:], "env": env}) + "\n")
        proc.stdin.close()
    outs = [p.stdout.read() for p in launchers]  # type: ignore[union-attr]
    for p, out in zip(launchers, outs):
        assert p.wait(timeout=120) == 0, out
    ranks = {k: v for out in outs for k, v in envs(out).items()}
    assert sorted(ranks) == ["0", "1", "2", "3"]
    assert [sorted(envs(out)) for out in outs] == [["2", "3"], ["0", "1"]]  # the places handed over
    assert {(e["MASTER_PORT"], e["TORCHELASTIC_RESTART_COUNT"]) for e in ranks.values()} == {(str(new_port), "1")}
    ran = {pid: what for out in outs for pid, what in procs(out).items()}
    assert sorted(ran) == sorted(r.pid for node in warm.values() for r in node)  # the warm processes, no others
    for name, argv0, policy, nice, probe, cwd in ran.values():
        assert (name, argv0, int(policy), probe, cwd) == ("__main__", PROBE, os.SCHED_OTHER, "handed", str(REPO))
        assert nice in ("0", "-")
    assert sum(out.count("all_reduce ok on rank") for out in outs) == 4


def _autogroup_nice(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def test_a_warm_rank_is_woken_by_its_launcher_before_it_reads_its_launch():
    """`wake(pid)`, which the launcher calls before it writes a warm rank's line: every thread of the rank back at
    the normal class and its session's nice at 0, while the rank has read nothing yet (its stdin open, empty). On a
    busy machine its own reader, in a session at nice 19, read the line only 24 s after it was written (3 busy
    sessions on 2 cores; a cold rank was ready in 5.4 s): that wait made a restart's recovery slower than a cold one."""
    from a4ray.runtime.warm import wake

    rank = subprocess.Popen([sys.executable, "-u", "-m", "a4ray.runtime.warm"], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        # Grouped where the kernel gave the rank's new session an autogroup of its own (not where the session it left
        # had one: a container's first session may sit in the root group while new ones get theirs).
        idle, niced = idle_class_available(), _autogroup_nice(rank.pid) is not None
        deadline = time.monotonic() + 20
        while (idle and os.sched_getscheduler(rank.pid) != os.SCHED_IDLE) or (niced and _autogroup_nice(rank.pid) != 19):
            assert time.monotonic() < deadline, "the warm rank did not go idle"
            time.sleep(0.05)
        wake(rank.pid)
        threads = [int(t) for t in os.listdir(f"/proc/{rank.pid}/task")]
        assert {os.sched_getscheduler(t) for t in threads} == {os.SCHED_OTHER}
        assert _autogroup_nice(rank.pid) == (0 if niced else None)
        assert rank.poll() is None  # still waiting for its line
    finally:
        assert rank.stdin is not None
        rank.stdin.close()  # no launch: it ends
    assert rank.wait(timeout=60) == 0


def test_a_warm_launcher_ends_with_its_ranks_when_no_launch_comes():
    """EOF on its stdin (its node actor gone) or SIGTERM (the node's stop): the launcher and its warm ranks end."""
    from a4ray.runtime.ranks import warm_argv

    for end in ("eof", "sigterm"):
        proc = subprocess.Popen(warm_argv(launcher("a4ray", 0, 1, 2, free_port())), cwd=REPO, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        children = started_ranks(proc, 2)
        assert proc.stdin is not None
        if end == "eof":
            proc.stdin.close()
        else:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, end


def test_a_warm_launcher_fits_only_a_launch_that_differs_in_what_each_launch_sets():
    from a4ray.runtime.ranks import warm_argv, warm_mismatch

    this = launcher("a4ray", 0, 2, 2, 1000)
    standby = warm_argv(this)
    assert warm_mismatch(standby, launcher("a4ray", 0, 2, 2, 2000)) is None  # another master port
    restart = this[:3] + ["--restart-count=1", "--run-id=x-r1"] + this[3:]
    assert warm_mismatch(standby, restart) is None
    assert warm_mismatch(standby, launcher("a4ray", 0, 2, 4, 1000)) == "the launch differs in --nproc"
    assert warm_mismatch(standby, launcher("a4ray", 1, 2, 2, 1000)) is None  # another place: a spare's, a survivor's
    assert warm_mismatch(standby, launcher("a4ray", 0, 3, 2, 1000)) == "the launch differs in --nnodes"
    assert warm_mismatch(standby, [*this, "--extra"]) == "the launch differs in its program or arguments"
    assert warm_mismatch(standby, ["/other/python", *this[1:]]) == f"the interpreter is /other/python, not {this[0]}"
    assert warm_mismatch(standby, launcher("torchrun", 0, 2, 2, 1000)) == "not a4ray's rank launcher"


def test_a_standby_names_the_variables_that_differ_never_their_values():
    """The node actor starts a restart cold where its env differs from the standby's in anything but what each
    launch sets anew (the attempt, the master port, the flight recorder's paths): it says which variables, and no
    value (a token changed between attempts must not reach the node log)."""
    from a4ray.runtime.node_actor import _Standby
    from a4ray.runtime.process import ManagedProcess

    argv = launcher("a4ray", 0, 2, 2, 1000)
    env = {"PATH": "/usr/bin", "A4RAY_ATTEMPT": "0", "MASTER_PORT": "1000", "HF_TOKEN": "hf_secret_one"}
    standby = _Standby(argv, env, "/work")
    standby.process = ManagedProcess(["sleep", "30"], env={}, cwd=None, launch_id="t", on_line=lambda _: None)
    standby.process.start()
    try:
        same = {**env, "A4RAY_ATTEMPT": "1", "MASTER_PORT": "2000", "A4RAY_NODE_RANK": "1", "NODE_RANK": "1",
                "MASTER_ADDR": "10.0.0.2"}  # another place in the gang: a spare taking a lost node's
        assert standby.mismatch(argv, same, "/work") is None
        why = standby.mismatch(argv, {**same, "HF_TOKEN": "hf_secret_two", "NEW": "1"}, "/work")
        assert why == "the env differs in HF_TOKEN, NEW" and "secret" not in why
        assert standby.mismatch(argv, same, "/elsewhere") == \
            "the working directory is /elsewhere, not /work"
    finally:
        standby.process.terminate(grace_s=1)
    assert standby.mismatch(argv, same, "/work").startswith("the warm launcher had ended")


def test_a_nodes_poll_gathers_ranks_lines_and_answers_the_launchers_own_at_once(monkeypatch):
    """The node actor's buffer, as the driver's long poll reads it: a rank that prints a line every 10 ms is answered
    in batches (one Ray call for several lines), while the launcher's own line (a failed rank's report) and the
    command's end are answered the moment they come. The gathering is set to 2 s here, so that "at once" stands out
    from it on a loaded machine."""
    import threading

    from a4ray.runtime import node_actor
    from a4ray.runtime.node_actor import _Output

    monkeypatch.setattr(node_actor, "_GATHER_S", 2.0)
    out, running = _Output(1000), threading.Event()
    running.set()

    def rank_prints(n: int) -> None:
        for i in range(n):
            out.append(f"iteration {i}", local_rank=0)
            time.sleep(0.01)

    printer = threading.Thread(target=rank_prints, args=(30,))
    printer.start()
    cursor, polls = 0, 0
    while cursor < 30:
        poll = out.poll(cursor, 5.0, running.is_set, lambda: None)
        cursor, polls = poll.cursor, polls + 1
    printer.join()
    assert polls <= 3, f"{polls} polls for 30 lines printed over 0.3 s"

    # the launcher's own line answers a poll at once, though a rank's line came just before it
    out.append("a rank's traceback", local_rank=1)
    t0 = time.monotonic()
    threading.Timer(0.01, out.append, args=("a4ray.runtime.ranks: a rank failed",)).start()
    poll = out.poll(cursor, 5.0, running.is_set, lambda: None)
    if len(poll.lines) == 1:  # answered before the launcher's line came: it is the next poll's, at once
        poll = out.poll(poll.cursor, 5.0, running.is_set, lambda: None)
    assert poll.lines[-1].text.startswith("a4ray.runtime.ranks:") and time.monotonic() - t0 < 1.0
    cursor = poll.cursor

    # and so does the command's end
    out.append("last words", local_rank=0)
    threading.Timer(0.01, lambda: (running.clear(), out.wake())).start()
    t0 = time.monotonic()
    poll = out.poll(cursor, 5.0, running.is_set, lambda: 0)
    assert time.monotonic() - t0 < 1.0 and [line.text for line in poll.lines] == ["last words"]
