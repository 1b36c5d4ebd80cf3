"""a4ray's per-node rank launcher: torchrun's contract for the ranks, without torchrun's elastic agent.

The gang has already done what torchrun's agent does on a node: the nodes are placed, ranked by
topology and supervised, the master's address and port are chosen, restarts are the gang's decision.
What is left is to start this node's `nproc` rank processes with the environment torchrun gives its
workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ... : `init_process_group()` and every torchrun
script read it unchanged), tag their lines as `torchrun --tee` does, and end the node at the first
failure. The agent costs every node a `torch` import and a rendezvous round per launch (~2 CPU-seconds,
benchmarks/launch.py); this launcher imports only the stdlib and psutil. `cluster.launcher: torchrun` runs torchrun instead.

The process is the truth, output is only output:
  * A rank's end is its pid's exit, seen by polling every 0.1 s (torchrun's `monitor_interval`), never the
    end of its output: a rank's descendant (megatron-core's checkpoint worker, Triton's compile workers, a
    data loader) inherits its stdout and holds the pipe open after the rank is gone. The exit is observed
    without reaping (`waitid(WNOWAIT)`), so the dead rank's pid, and with it its process group's number,
    stays reserved until the node has stopped everything.
  * Each rank runs in its own session. Stopping the node signals every rank's group, the dead rank's too
    (torchrun signals only ranks still alive, pytorch/pytorch#110065), and every descendant of this
    launcher: it is a child subreaper (PR_SET_CHILD_SUBREAPER), so what a rank double-forked out of its
    group with `setsid` comes back to it as an orphan. SIGTERM and SIGCONT, then SIGKILL after the grace period.
  * The first failure is reported at once, in torchrun's "Root Cause" form (the gang names the rank either
    way, and stops every node on it), with what the kernel says about a SIGKILL (its OOM killer's count in
    the cgroup's memory.events); then the node stops its other ranks. Output still in a pipe is drained
    with a deadline: a pipe held by something already killed must not hold the node.

Rank 0 hosts the TCPStore on MASTER_PORT (env:// without an agent store).

With `--warm` the launcher stands by for the next attempt of its node (the node actor starts it while an attempt
trains): its ranks are `a4ray.runtime.warm` processes that import torch and wait. One JSON line on its stdin, the
attempt's own launcher argv and env, makes it that attempt's launcher: each rank is handed torchrun's env for it and
the target, and from then on it is the launcher above. EOF or SIGTERM before that ends it and its ranks.

Usage (built by a4ray.workloads.torchrun, never by hand):
    python -m a4ray.runtime.ranks --nnodes N --node-rank R --nproc P --master-addr A --master-port M
        [--run-id ID] [--restart-count K] [--grace-s S] [--warm] -- (SCRIPT | -m MODULE) [ARGS...]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from a4ray.runtime.process import STOP_SIGNALS, child_pids
from a4ray.runtime.warm import wake

ROLE = "default"  # torchrun's role name: its --tee prefix is "[default<local rank>]:"
MONITOR_INTERVAL_S = 0.1  # torchrun's default monitor_interval
DRAIN_S = 2.0  # how long output left in a pipe may hold the node once its processes are gone
SETTLE_S = 3.0  # after the first failure: how long ranks ending by themselves have before the node stops them
FAILURE_HEADER = "a4ray.runtime.ranks: a rank failed; the node's other ranks are being stopped"
# A rank that ended with exit 0 while others of the node still run: the supervisor judges it at once (its peers
# may wait for it in a collective it will never join). Parsed by `ended_rank`.
ENDED_MARKER = "a4ray.runtime.ranks: rank ended early:"
_PR_SET_CHILD_SUBREAPER = 36
MODULE = "a4ray.runtime.ranks"
# What the gang sets anew for each launch, which a rank reads only when it uses it (after its start): a warm rank
# takes it at the hand-over. The node's place (its rank, the master) is among them: a spare node's warm ranks, or a
# survivor's after the master's node was lost, take a place other than the one they stood by as. Any other difference
# in the launcher's arguments makes the next attempt a cold one.
PER_LAUNCH_ARGS = ("node_rank", "master_addr", "master_port", "run_id", "restart_count", "warm")


def global_rank(args: argparse.Namespace, local_rank: int) -> int:
    return args.node_rank * args.nproc + local_rank


def rank_env(args: argparse.Namespace, local_rank: int, base: dict[str, str]) -> dict[str, str]:
    """The environment torchrun's agent gives local rank `local_rank` of this node."""
    world = args.nnodes * args.nproc
    rank = global_rank(args, local_rank)
    env = {
        **base,
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(args.nproc), "GROUP_RANK": str(args.node_rank),
        "GROUP_WORLD_SIZE": str(args.nnodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": ROLE, "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(args.master_port),
        "TORCHELASTIC_RUN_ID": args.run_id, "TORCHELASTIC_RESTART_COUNT": str(args.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if args.nproc > 1:  # as torchrun: several ranks must not each spawn a thread per core
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def exit_status(pid: int) -> int | None:
    """The exit code of child `pid` if it has ended (negative: the signal that killed it), else None. The
    child is left unreaped, so its pid (and its process group's number) cannot name another process yet."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def become_subreaper() -> bool:
    """Make orphaned descendants (a rank's `setsid` double-fork) this process's children, so that stopping
    the node reaches them. Linux >= 3.4; False where it cannot."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class OomKills:
    """The kernel's OOM-kill count of this node's cgroup (cgroup v2 memory.events), to tell its SIGKILL from another."""

    def __init__(self) -> None:
        self.path = self._events_file()
        self.start = self.count()

    @staticmethod
    def _events_file() -> Path | None:
        try:
            for line in Path("/proc/self/cgroup").read_text().splitlines():
                if line.startswith("0::"):
                    path = Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "memory.events"
                    return path if path.is_file() else None
        except OSError:
            pass
        return None

    def count(self) -> int | None:
        if self.path is None:
            return None
        try:
            for line in self.path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return None

    def why(self, code: int) -> str | None:
        """Why a rank got SIGKILL, where the kernel says so."""
        if code != -signal.SIGKILL:
            return None
        now = self.count()
        if now is not None and self.start is not None and now > self.start:
            return f"the kernel's OOM killer (oom_kill {self.start} -> {now} in {self.path})"
        return None


class Rank:
    """One rank process: its pid, its exit as seen from the pid, and the thread relaying its lines."""

    def __init__(self, local_rank: int, proc: subprocess.Popen, relay: threading.Thread):
        self.local_rank, self.proc, self.relay = local_rank, proc, relay
        self.code: int | None = None  # set once its pid has exited
        self.ended_at: float | None = None

    def check(self) -> bool:
        """True the first time the rank is seen to have ended."""
        if self.code is not None:
            return False
        code = exit_status(self.proc.pid)
        if code is None:
            return False
        self.code, self.ended_at = code, time.time()
        return True


class Node:
    """This node's rank processes, their tagged output and the first failure among them."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.ranks: list[Rank] = []
        self.out_lock = threading.Lock()
        self.first_failure: Rank | None = None
        self.stopping = False
        self.subreaper = become_subreaper()
        self.oom = OomKills()

    def start(self) -> None:
        """Start the node's ranks: the target itself, or with --warm `a4ray.runtime.warm` processes that wait for
        it (`hand_over`)."""
        warm = self.args.warm
        argv = [sys.executable, "-u", *(["-m", "a4ray.runtime.warm"] if warm else self.args.target)]
        base = dict(os.environ)
        for local_rank in range(self.args.nproc):
            proc = subprocess.Popen(argv, env=rank_env(self.args, local_rank, base),
                                    stdin=subprocess.PIPE if warm else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            relay = threading.Thread(target=self._relay, args=(local_rank, proc), daemon=True)
            relay.start()
            self.ranks.append(Rank(local_rank, proc, relay))

    def await_launch(self) -> tuple[list[str], dict[str, str]] | None:
        """(the launcher argv, the env) of the attempt a warm node stood by for, read from stdin; None once told to
        stop, at EOF, or when a warm rank has ended (the node cannot be the attempt: it goes cold)."""
        pending = b""
        while not self.stopping:
            for rank in self.ranks:
                if rank.check():
                    print(f"a4ray.runtime.ranks: warm rank {rank.local_rank} ended with exit code {rank.code} before "
                          "its launch", flush=True)
                    return None
            if not select.select([sys.stdin], [], [], MONITOR_INTERVAL_S)[0]:
                continue
            chunk = os.read(sys.stdin.fileno(), 1 << 20)
            if not chunk:
                return None
            pending += chunk
            if pending.endswith(b"\n"):
                go = json.loads(pending)
                return go["argv"], go["env"]
        return None

    def hand_over(self, args: argparse.Namespace, env: dict[str, str]) -> None:
        """Make the warm ranks the ranks of the launch `args` with launch env `env`: one line to each, its env as
        torchrun's agent gives it, the working directory and the target."""
        self.args = args
        os.environ.clear()
        os.environ.update(env)
        for rank in self.ranks:
            wake(rank.proc.pid)
            line = json.dumps({"env": rank_env(args, rank.local_rank, env), "cwd": os.getcwd(),
                               "target": args.target}) + "\n"
            assert rank.proc.stdin is not None
            try:
                rank.proc.stdin.write(line.encode())
                rank.proc.stdin.close()
            except BrokenPipeError:  # it ended meanwhile: the wait reports it as the attempt's failure
                pass

    def _relay(self, local_rank: int, proc: subprocess.Popen) -> None:
        prefix = f"[{ROLE}{local_rank}]:".encode()
        out = sys.stdout.buffer
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            with self.out_lock:
                out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                out.flush()

    def wait(self) -> int:
        """Watch the ranks' pids until every rank has ended, the first fails, or the node is told to stop; then
        stop every process of the node. Returns the node's exit code."""
        while not self.stopping:
            ended = [rank for rank in self.ranks if rank.check()]
            for rank in ended:
                if rank.code != 0 and self.first_failure is None:
                    self.first_failure = rank
            for rank in ended:  # said before a failure seen with it: a peer's failure may be the echo of its end
                if rank.code == 0 and (self.first_failure is not None or any(r.code is None for r in self.ranks)):
                    self._ended_early(rank)
            if self.first_failure is not None or all(r.code is not None for r in self.ranks):
                break
            self._reap_orphans()
            time.sleep(MONITOR_INTERVAL_S)
        if self.first_failure is not None:
            self.first_failure.relay.join(0.2)  # its last lines, if nothing else holds its pipe
            self._report(self.first_failure)
            self._settle()
        self.stop()
        for rank in self.ranks:
            rank.proc.wait()  # reaped only now: until here their numbers named only their own groups
            rank.check()
        self._reap_orphans()
        deadline = time.monotonic() + DRAIN_S
        for rank in self.ranks:
            rank.relay.join(max(0.0, deadline - time.monotonic()))
        if self.first_failure is not None:
            code = self.first_failure.code or 1
            return code if code > 0 else 128 - code
        return 128 + signal.SIGTERM if self.stopping else 0

    def _processes(self) -> list[int]:
        """Every live process of this node's launch: the ranks' groups (a dead rank's too: its unreaped pid
        holds the number) and every descendant of this launcher (orphans come back to it as its children)."""
        pids: set[int] = set()
        groups = {rank.proc.pid for rank in self.ranks}
        for proc in psutil.process_iter(["pid", "status"]):
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
            try:
                if os.getpgid(proc.pid) in groups:
                    pids.add(proc.pid)
            except OSError:
                continue
        try:
            pids.update(p.pid for p in psutil.Process().children(recursive=True)
                        if p.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            pass
        return sorted(pids)

    def stop(self) -> None:
        """SIGTERM (and SIGCONT, for a stopped rank) every process of the node, SIGKILL what is left after the grace
        period."""
        deadline = time.monotonic() + self.args.grace_s
        for signals in (STOP_SIGNALS, (signal.SIGKILL,)):
            for sig in signals:
                for rank in self.ranks:  # whole groups first: their members may be forking
                    try:
                        os.killpg(rank.proc.pid, sig)
                    except OSError:
                        pass
                for pid in self._processes():
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
            while (left := self._processes()) and time.monotonic() < deadline:
                self._reap_orphans()
                time.sleep(0.05)
            if not left:
                return
            deadline = time.monotonic() + 5  # after SIGKILL: the kernel's time to tear them down

    def _reap_orphans(self) -> None:
        """Reap ended descendants that were reparented here (never a rank: those are reaped by `wait`)."""
        ranks = {rank.proc.pid for rank in self.ranks}
        for pid in child_pids():  # every 0.1 s: psutil's scan of every process cost 4% of a core a launcher
            if pid in ranks:
                continue
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def on_signal(self, signum, _frame) -> None:
        self.stopping = True  # the wait loop sees it within its poll interval; no lock in a handler

    def _settle(self) -> None:
        """After the first failure, a moment for ranks that are ending by themselves: a rank that left cleanly (its
        `destroy_process_group()` closed its connections) fails its gloo peers before its own interpreter has
        exited, and its end, said here, is the cause the supervisor names instead of the peer's echo. The gang's
        stop (SIGTERM to this launcher) ends the wait at once."""
        deadline = time.monotonic() + SETTLE_S
        while not self.stopping and time.monotonic() < deadline and any(r.code is None for r in self.ranks):
            for rank in self.ranks:
                if rank.check() and rank.code == 0:
                    self._ended_early(rank)
            time.sleep(MONITOR_INTERVAL_S)

    def _ended_early(self, rank: Rank) -> None:
        running = [global_rank(self.args, r.local_rank) for r in self.ranks if r.code is None]
        with self.out_lock:
            print(f"{ENDED_MARKER} rank {global_rank(self.args, rank.local_rank)} (local_rank: {rank.local_rank}) "
                  f"exitcode 0 at {rank.ended_at:.3f}; still running here: {running}", flush=True)

    def _report(self, rank: Rank) -> None:
        code = rank.code or 0
        detail = f"exitcode  : {code}" + (f" (pid terminated by {signal.Signals(-code).name})" if code < 0 else "")
        cause = self.oom.why(code)
        when = rank.ended_at or time.time()
        with self.out_lock:
            print(f"{FAILURE_HEADER}\n"
                  "Root Cause (first observed failure):\n"
                  f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S', time.localtime(when))}\n"
                  f"  host      : {os.uname().nodename}\n"
                  f"  rank      : {global_rank(self.args, rank.local_rank)} (local_rank: {rank.local_rank})\n"
                  f"  {detail}" + (f"\n  cause     : {cause}" if cause else ""), flush=True)


_ENDED = re.compile(re.escape(ENDED_MARKER) + r" rank (\d+) \(local_rank: (\d+)\) exitcode (-?\d+) at ([\d.]+)")


def ended_rank(line: str) -> tuple[int, int, int, float] | None:
    """(global rank, local rank, exit code, when) from the launcher's line on a rank that ended early."""
    m = _ENDED.match(line)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3)), float(m.group(4))) if m else None


def launcher_args(argv: list[str]) -> argparse.Namespace | None:
    """The arguments of a launch's command if it is this launcher's (`<python> -m a4ray.runtime.ranks ...`)."""
    if argv[1:3] != ["-m", MODULE]:
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage is for a person at a prompt
            return parse(argv[3:])
    except SystemExit:
        return None


def warm_argv(argv: list[str], restart_count: int | None = None) -> list[str]:
    """The command of a launcher that stands by for the next attempt of the launch `argv` (restart `restart_count`,
    where given: the hand-over sets it anyway, but `ps` shows the attempt it stands by for)."""
    cut = argv.index("--")
    head = [f"--restart-count={restart_count}" if restart_count is not None and a.startswith("--restart-count=")
            else a for a in argv[:cut]]
    return [*head, "--warm", *argv[cut:]]


def warm_mismatch(standby: list[str], launch: list[str]) -> str | None:
    """Why the warm launcher `standby` cannot be the launch `launch` (None: it can): the launchers' arguments, less
    those set anew for each launch (PER_LAUNCH_ARGS), and the interpreter must be the same."""
    ours, theirs = launcher_args(standby), launcher_args(launch)
    if ours is None or theirs is None:
        return "not a4ray's rank launcher"
    if standby[0] != launch[0]:
        return f"the interpreter is {launch[0]}, not {standby[0]}"
    differ = [k for k, v in vars(ours).items() if k not in PER_LAUNCH_ARGS and vars(theirs).get(k) != v]
    words = ["its program or arguments" if k == "target" else "--" + k.replace("_", "-") for k in differ]
    return f"the launch differs in {', '.join(words)}" if differ else None


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m a4ray.runtime.ranks")
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--run-id", default="none")
    p.add_argument("--restart-count", type=int, default=0)
    p.add_argument("--grace-s", type=float, default=10.0)
    p.add_argument("--warm", action="store_true", help="stand by for the next attempt: ranks warm, the launch on stdin")
    p.add_argument("target", nargs=argparse.REMAINDER, help="SCRIPT [ARGS] or -m MODULE [ARGS], after --")
    args = p.parse_args(argv)
    args.target = args.target[1:] if args.target[:1] == ["--"] else args.target
    if not args.target:
        p.error("nothing to run: give the script (or -m MODULE) and its arguments after --")
    if not (0 <= args.node_rank < args.nnodes) or args.nproc < 1:
        p.error(f"--node-rank {args.node_rank} must be in 0..{args.nnodes - 1} and --nproc >= 1")
    return args


def main(argv: list[str]) -> int:
    node = Node(parse(argv))
    signal.signal(signal.SIGTERM, node.on_signal)
    signal.signal(signal.SIGINT, node.on_signal)
    node.start()
    if node.args.warm:
        launch = node.await_launch()
        if launch is None:
            node.stop()
            return 0
        node.hand_over(parse(launch[0]), launch[1])
    code = node.wait()
    # The node's exit code is its first failed rank's: a stop that comes while this process exits (the gang is
    # stopped on its report) must not end it by SIGTERM. Python restores the default action of the signals it
    # handles when it finalizes, but leaves an ignored signal ignored.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
