"""Whether a process recorded earlier still runs: a run's driver, a `local up`, a node actor that owns its pipes.

pids are reused, so a record names a process by its pid and when it started; and that must read the same in every
process that asks, for the process's whole life. psutil's `create_time()` does not: it adds the boot time the kernel
gives at the moment of asking (/proc/stat `btime`: the wall clock less the uptime), which moves whenever the wall
clock is stepped (NTP, a VM's clock sync). A record of a running process then read as stale: `a4ray local status`
found its own running cluster's record so, and removed it. The start in clock ticks since boot (/proc/<pid>/stat,
field 22) never moves; where there is no /proc, `create_time()` within a second stands in, as it does for a record
written before marks (a float).
"""

from __future__ import annotations

import os

import psutil

_CLOCK_SKEW_S = 1.0  # how far create_time() may move between two reads of one process (a record without ticks)


def start_mark(pid: int | None = None) -> str:
    """When process `pid` (this one by default) started, as an opaque mark: the same from any process of this host
    for as long as the process lives. Raises psutil.NoSuchProcess where there is none."""
    pid = os.getpid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError as gone:
        if os.path.isdir("/proc/self"):
            raise psutil.NoSuchProcess(pid) from gone
        return f"ctime:{psutil.Process(pid).create_time()!r}"
    return f"ticks:{stat[stat.rindex(')') + 2:].split()[19]}"  # field 22, starttime; the name (field 2) may hold spaces


def still_running(pid: int, mark: str | float) -> bool:
    """Whether process `pid` is the one `start_mark` marked `mark` (a float: an older record's create_time)."""
    try:
        if isinstance(mark, str) and mark.startswith("ticks:"):
            return start_mark(pid) == mark
        recorded = float(mark.removeprefix("ctime:")) if isinstance(mark, str) else float(mark)
        return abs(psutil.Process(pid).create_time() - recorded) < _CLOCK_SKEW_S
    except (psutil.Error, OSError, ValueError, IndexError):
        return False
