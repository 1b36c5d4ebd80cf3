"""Hang forensics: `py-spy dump` of every rank process, and a one-line answer to "where is everyone?".

    ranks 0, 2-3 in all_reduce (distributed_c10d.py:2810); rank 1 in time.sleep <- load_batch (train.py:12)

py-spy attaches with ptrace: root, or the SYS_PTRACE capability and kernel.yama.ptrace_scope <= 1.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
from pydantic import BaseModel

# Innermost frames that say what a rank waits for. `_coalescing_manager` waits for a coalesced collective (the
# gradient reduction of megatron-core's DDP, its buckets' all-reduces) in its exit, in C++ (`work.wait()`): no
# Python frame of the collective is left on the stack.
_COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "reduce", "gather", "scatter",
    "all_reduce_coalesced", "all_gather_coalesced", "batch_isend_irecv", "_coalescing_manager",
    "wait", "synchronize", "_wait_for_workers",
}
_FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>[^()]*?):(?P<line>\d+)\)\s*$")
_THREAD = re.compile(r'^Thread (?P<tid>\S+) \((?P<state>[^)]*)\): "(?P<name>[^"]*)"')


class StackDump(BaseModel):
    rank: str  # global rank, or "n<node>:pid<pid>" for processes without one
    node: int
    pid: int
    text: str = ""
    error: str | None = None
    where: str = ""
    stopped: bool = False  # the process was stopped (state T: SIGSTOP, a debugger) when dumped

    @property
    def in_collective(self) -> bool:
        """Blocked inside a collective: its main thread's innermost telling frame is one, and it runs."""
        return not self.stopped and self.where.split(" ", 1)[0] in _COLLECTIVES


def py_spy() -> str | None:
    """The py-spy binary: next to this Python (pip installs it there) or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def ptrace_hint() -> str:
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    level = scope.read_text().strip() if scope.is_file() else "unknown"
    return ("py-spy needs ptrace: run the Ray workers as root or add the SYS_PTRACE capability (KubeRay: "
            f"securityContext.capabilities.add [SYS_PTRACE]); kernel.yama.ptrace_scope is {level}")


def is_stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def dump(pid: int, timeout_s: float = 30, *, stopped: bool = False) -> tuple[str, str | None]:
    """(stack text, error) of one process. A stopped process is read without pausing it (`--nonblocking`):
    py-spy's pause waits for a stop that never comes from a process already stopped."""
    binary = py_spy()
    if binary is None:
        return "", "py-spy is not installed on this node (pip install py-spy)"
    try:
        argv = [binary, "dump", "--pid", str(pid)] + (["--nonblocking"] if stopped else [])
        out = subprocess.run(argv, capture_output=True, text=True,
                             timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return "", f"py-spy dump timed out after {timeout_s:g}s"
    if out.returncode != 0:
        error = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["py-spy failed"]
        if re.search(r"ermission denied|not permitted|ptrace", out.stderr or ""):
            return "", f"{error[0]} ({ptrace_hint()})"
        return out.stdout, error[0]
    return out.stdout, None


def dump_all(targets: list[tuple[str, int, int]], timeout_s: float = 30) -> list[StackDump]:
    """Dump (rank, node, pid) targets in parallel; each result says where its main thread is."""

    def one(target: tuple[str, int, int]) -> StackDump:
        rank, node, pid = target
        stopped = is_stopped(pid)
        text, error = dump(pid, timeout_s, stopped=stopped)
        place = where(text) if text else ""
        if stopped:
            place = f"a stopped process (state T){' in ' + place if place else ''}"
        return StackDump(rank=rank, node=node, pid=pid, text=text, error=error, where=place, stopped=stopped)

    with ThreadPoolExecutor(max_workers=min(16, max(1, len(targets)))) as pool:
        return list(pool.map(one, targets))


def _main_thread_frames(text: str) -> list[tuple[str, str, int]]:
    frames: list[tuple[str, str, int]] = []
    in_main = False
    for line in text.splitlines():
        thread = _THREAD.match(line)
        if thread:
            if frames:  # the first thread with frames that is MainThread (py-spy lists it first)
                break
            in_main = thread.group("name") == "MainThread"
            continue
        frame = _FRAME.match(line)
        if frame and in_main:
            frames.append((frame.group("func"), frame.group("file"), int(frame.group("line"))))
    return frames


def _is_library(path: str) -> bool:
    return any(part in path for part in ("site-packages", "dist-packages", "/lib/python", "<frozen"))


def where(text: str) -> str:
    """Where a rank's main thread is: the collective it waits in, data loading, or its innermost own frame."""
    frames = _main_thread_frames(text)  # innermost first
    if not frames:
        return "unknown (no Python frames)"
    for func, file, line in frames:
        name = func.split(".")[-1]
        if name in _COLLECTIVES:
            return f"{name} ({Path(file).name}:{line})"
    for func, file, _ in frames:
        if "dataloader" in file.lower() or func in ("_next_data", "_get_data", "__next__"):
            return "data loading"
    innermost = frames[0]
    own = next((f for f in frames if not _is_library(f[1])), innermost)
    inner = f"{innermost[0]} <- " if own is not innermost else ""
    return f"{inner}{own[0]} ({Path(own[1]).name}:{own[2]})"


def ranges(ranks: list[int]) -> str:
    """[0, 2, 3] -> "0, 2-3"."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def summarize(dumps: list[StackDump]) -> str:
    """"ranks 0-7 in all_reduce (...); rank 12 in data loading" — the biggest group first."""
    groups: dict[str, list] = {}
    for d in dumps:
        groups.setdefault(d.where or f"unknown ({d.error})", []).append(d.rank)
    parts = []
    for place, ranks in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        numeric = sorted(int(r) for r in ranks if r.isdigit())
        other = sorted(r for r in ranks if not r.isdigit())
        label = ", ".join(filter(None, [ranges(numeric), ", ".join(other)]))
        plural = "ranks" if len(ranks) > 1 else "rank"
        parts.append(f"{plural} {label} in {place}")
    return "; ".join(parts)
