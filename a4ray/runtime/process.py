"""One launched command per node: its own session, its output as lines, and a guaranteed kill.

torchrun's workers are grandchildren of the node actor; killing the actor's child is not enough. So a
launch runs in its own session (process group) and carries `A4RAY_LAUNCH_ID` in its environment; to
stop it, every process of the group *and* every process carrying the id (in case one called setsid)
gets SIGTERM, a bounded wait, then SIGKILL. A small reaper process watches a pipe from the owner and
does the same when the owner dies by any means (SIGKILL, node actor killed), so nothing survives to
hold a GPU. A command's end is its pid's exit; its output is drained after, with a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import psutil

LAUNCH_ID_VAR = "A4RAY_LAUNCH_ID"
DRAIN_S = 2.0  # how long output left in a pipe may hold a command's end once it has exited


def launch_processes(pgid: int | None = None, launch_id: str | None = None) -> list[psutil.Process]:
    """Live processes of a launch: members of process group `pgid` or carrying `launch_id` in env."""
    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        if proc.pid == me or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            member = pgid is not None and os.getpgid(proc.pid) == pgid
            if not member and launch_id is not None:
                member = proc.environ().get(LAUNCH_ID_VAR) == launch_id
        except (psutil.Error, OSError):
            continue
        if member:
            found.append(proc)
    return found


def rank_processes(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The ranks among a launch's processes: RANK and LOCAL_RANK in their env (torchrun's contract), and a parent that
    is not a rank: a rank's forked helpers (a data-loader worker, an async save's writer) inherit its env."""
    ranks = {}
    for proc in procs:
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if "RANK" in env and "LOCAL_RANK" in env:
            ranks[proc.pid] = proc
    mains = []
    for pid, proc in ranks.items():
        try:
            if proc.ppid() not in ranks:
                mains.append(proc)
        except psutil.Error:
            continue
    return mains


def child_pids() -> list[int]:
    """This process's children, read from the kernel's own lists (/proc/self/task/<tid>/children, one per thread)
    where it keeps them; else psutil's answer, a scan of every process's /proc/<pid>/stat (4 ms with ~200
    processes)."""
    if not os.path.exists(f"/proc/self/task/{os.getpid()}/children"):  # a kernel without CONFIG_PROC_CHILDREN
        try:
            return [child.pid for child in psutil.Process().children()]
        except psutil.Error:
            return []
    pids: list[int] = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += map(int, f.read().split())
        except OSError:  # a thread that has ended since
            continue
    return pids


# A stopped process (SIGSTOP: a chaos test's hang, a debugger, Ctrl-Z) acts on SIGTERM only once it is continued;
# without SIGCONT the stop waited out the whole grace period for it (10 s, on every restart after such a hang).
# systemd does the same. SIGCONT to a running process does nothing.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGCONT)


def terminate_launch(pgid: int | None, launch_id: str | None, grace_s: float) -> int:
    """SIGTERM (and SIGCONT) every process of the launch, wait up to `grace_s`, SIGKILL what is left; returns how
    many it signalled."""
    procs = launch_processes(pgid, launch_id)
    for sig in STOP_SIGNALS:
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
    alive = wait_gone(procs, grace_s)
    # Children may have been forked after the first scan; look once more before the hard kill.
    alive = list({p.pid: p for p in alive + launch_processes(pgid, launch_id)}.values())
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    wait_gone(alive, 5)
    return len(procs)


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to `timeout_s` for `procs` to end; returns those still running. Never reaps: psutil's own wait
    reaps a child of this process, and its Popen then reads the status as 0 (the launch stopped while it was
    exiting with the failed rank's code reported "exited with code 0")."""
    deadline = time.monotonic() + timeout_s
    while True:
        procs = [p for p in procs if _running(p)]
        if not procs or time.monotonic() >= deadline:
            return procs
        time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class ManagedProcess:
    """Runs `argv` in a new session; feeds each output line (stdout+stderr) to `on_line`."""

    def __init__(self, argv: list[str], *, env: dict[str, str], cwd: str | None, launch_id: str,
                 on_line: Callable[[str], None], grace_s: float = 10.0,
                 on_exit: Callable[[], None] | None = None, settle: Callable[[], None] | None = None,
                 stdin: bool = False):
        self.argv = argv
        self.env = {**env, LAUNCH_ID_VAR: launch_id}
        self.cwd = cwd
        self.launch_id = launch_id
        self.grace_s = grace_s
        self._on_line = on_line
        self._on_exit = on_exit  # called once the command has ended and every line was handed to on_line
        self._settle = settle  # called after the command has exited, before it counts as ended (GPU memory freed)
        self._stdin = stdin  # a pipe that `send` writes once, else /dev/null
        self._proc: subprocess.Popen | None = None
        self._reaper: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self.returncode: int | None = None
        self.stopped = False  # True if a stop was requested while it ran: its exit code is ours, not its
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self._done = threading.Event()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.PIPE if self._stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.started_at = time.time()
        # The reaper holds the read end of a pipe; when this process dies, EOF tells it to clean up.
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "a4ray.runtime.reaper", str(self._proc.pid), self.launch_id,
             str(self.grace_s)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env={**os.environ, "PYTHONPATH": _a4ray_pythonpath()},
        )
        self._reader = threading.Thread(target=self._read, name="a4ray-output", daemon=True)
        self._reader.start()
        threading.Thread(target=self._watch, name="a4ray-exit", daemon=True).start()

    def send(self, line: str) -> bool:
        """Write `line` to the command's stdin and close it (the command was started with `stdin=True`). False
        where the command is gone."""
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(line.encode() + b"\n")
            self._proc.stdin.close()
            return True
        except (BrokenPipeError, ValueError):
            return False

    def _read(self) -> None:
        assert self._proc and self._proc.stdout
        pending = b""
        # Split on \n and \r: progress bars redraw with \r and would otherwise be one endless line.
        for chunk in iter(lambda: self._proc.stdout.read1(65536), b""):
            pending += chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line:
                    self._on_line(line.decode(errors="replace"))
        if pending:
            self._on_line(pending.decode(errors="replace"))

    def _watch(self) -> None:
        """The command's end is its pid's exit, not the end of its output: a descendant that inherited the pipe
        (a daemon it forked) holds it open for as long as it lives. Once the command has exited, what it left
        behind is stopped (the reaper), then the output still in the pipe is drained, with a deadline."""
        assert self._proc is not None
        self.returncode = self._proc.wait()
        self.ended_at = time.time()
        self._release_reaper()  # leftovers of a finished command (daemons it forked) are killed too
        assert self._reader is not None
        self._reader.join(DRAIN_S)
        if self._reader.is_alive():  # a pipe held by something the reaper has not ended yet
            self._reader.join(self.grace_s + DRAIN_S)
        if self._settle is not None:
            self._settle()
        self._done.set()
        if self._on_exit is not None:
            self._on_exit()

    def _release_reaper(self) -> None:
        if self._reaper and self._reaper.stdin and not self._reaper.stdin.closed:
            try:
                self._reaper.stdin.close()
            except OSError:
                pass

    def wait(self, timeout: float | None = None) -> int | None:
        self._done.wait(timeout)
        return self.returncode

    @property
    def running(self) -> bool:
        return self._proc is not None and not self._done.is_set()

    def terminate(self, grace_s: float | None = None) -> int | None:
        """Stop every process of the launch; returns the command's exit code."""
        if self._proc is None:
            return None
        self.stopped = self.running
        # The process group is the launch's only while its leader is unreaped: once the command has ended and
        # been waited for, the number may come round again (pids wrap, at 32768 by default) as some other
        # process's group, a Ray worker's say. What the command left behind still carries the launch id.
        pgid = self._proc.pid if self._proc.returncode is None else None
        terminate_launch(pgid, self.launch_id, self.grace_s if grace_s is None else grace_s)
        self.wait(timeout=self.grace_s + 75)  # bounded: the drain's deadlines and the node's GPU wait
        self._release_reaper()
        return self.returncode


def _a4ray_pythonpath() -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
