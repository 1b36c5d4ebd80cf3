"""A warm rank: a rank process started before its launch, which becomes the rank when the launch comes.

A restart's ranks are cold processes: each starts Python and imports torch before it can join the process group
(1.5 CPU-seconds a rank here; ~10 s for 4 ranks on 2 busy cores, most of a restart's recovery). So while an attempt
trains, the node's launcher for the next attempt (`a4ray.runtime.ranks --warm`) already runs its ranks as this
module: each imports torch and waits. On a restart the node actor hands the launcher the attempt's real command and
env, and each warm rank gets one line on its stdin: its env (RANK, MASTER_PORT, ... as torchrun's agent gives them),
its working directory and its target (a script or `-m module` with args). It puts them in place and runs the target
as `python -u <target>` would: `runpy` as `__main__`, with sys.argv and sys.path[0] as Python sets them.

The node actor hands over a launch only where nothing a process reads at its start differs from what the warm ranks
started with (`a4ray.runtime.ranks.warm_mismatch`); else the restart is cold. While warm, a rank takes only CPU the
training leaves, so that the attempt it waits behind keeps its start and its step time:
  * it runs at the idle scheduling class where it may return to the normal one (root, CAP_SYS_NICE: A4's privileged
    pods); where it may not, at the normal class (a machine with cores to spare, as A4's 224 vCPUs for 8 ranks);
  * where the kernel groups processes by session (autogroup: a machine's root cgroup, as here, not a pod's), the class
    counts only within the rank's own session, which competes with every other as an equal: so its session's nice is
    19 while it is warm (raising it needs no privilege, and back to 0 is never below where it started).
At the hand-over, both go back: first from outside, by the launcher, at the normal class in a session of its own
(`wake`), then once more by the rank's own reader. The reader alone came too late on a busy machine: a session at nice
19 gets the CPU so seldom that it read its line 24 s after the launcher wrote it (3 busy sessions on 2 cores), while a
cold rank imported torch and was ready in 5.4 s.

Stdlib only until the import of torch: `python -m a4ray.runtime.warm`, started by the launcher, never by hand.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading

WARM_IMPORTS = ("torch", "torch.distributed")  # what every rank of a torchrun launch imports first


def _idle_class_returns() -> bool:
    """Whether this process may leave the idle scheduling class once in it: tried on a thread of its own (Linux
    keeps the class per thread), so a failed return strands only that thread."""
    ok = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            ok.append(True)
        except (OSError, AttributeError):
            pass

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return bool(ok)


def _autogroup_nice(nice: int | None = None, pid: int | str = "self") -> int | None:
    """The autogroup nice of process `pid`'s session (set it to `nice` first, where given); None where there is none
    ("/autogroup-<n> nice <k>" where the kernel groups by session)."""
    try:
        if nice is not None:
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write(str(nice))
        with open(f"/proc/{pid}/autogroup") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _set_class(policy: int, pid: int | str = "self") -> None:
    """Every thread of process `pid` at `policy` (threads started during the import took the class of their
    creator)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:  # a process already gone
        return
    for tid in threads:
        try:
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        except OSError:
            pass


def wake(pid: int) -> None:
    """Warm rank `pid` back at the normal class, every thread of it, and its session's nice at 0 (where a new
    session's autogroup starts): called by its launcher before the launch's line is written, so that the rank reads
    the line, and finishes an import still under way, at the priority of a cold rank. What may not be changed (a
    rank already gone, a class the rank could not leave either) is left as it is."""
    _set_class(os.SCHED_OTHER, pid)
    _autogroup_nice(0, pid)


def _receive(go: dict, idle: bool, nice: int | None, ready: threading.Event) -> None:
    """Read the launch's line from stdin; leave the idle class and the session's nice at once, so that an import
    still under way finishes at the normal ones."""
    line = sys.stdin.readline()
    if line:
        go.update(json.loads(line))
        if idle:
            _set_class(os.SCHED_OTHER)
        if nice is not None:
            _autogroup_nice(nice)
    ready.set()


def become(target: list[str]) -> None:
    """Run `target` (SCRIPT [ARGS] or -m MODULE [ARGS]) as `python <target>` would, in this process."""
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]  # run_module sets argv[0] to the module's file, as `python -m` does
        sys.path[0] = os.getcwd()
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(target[0])
        sys.argv = [target[0], *target[1:]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


def main() -> None:
    idle = _idle_class_returns()
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    nice = _autogroup_nice()
    if nice is not None and _autogroup_nice(19) is None:
        nice = None
    go: dict = {}
    ready = threading.Event()
    reader = threading.Thread(target=_receive, args=(go, idle, nice, ready), daemon=True)
    reader.start()
    for module in WARM_IMPORTS:
        try:
            __import__(module)
        except ImportError:  # a rank that does not use torch: a warm interpreter still saves its start
            break
    ready.wait()
    if not go:  # stdin closed: the launch this rank stood by for will not come
        sys.exit(0)
    devnull = os.open(os.devnull, os.O_RDONLY)  # as a cold rank's stdin
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(go["env"])
    os.chdir(go["cwd"])
    become(go["target"])


if __name__ == "__main__":
    main()
