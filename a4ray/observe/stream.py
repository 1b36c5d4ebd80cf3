"""What the driver shows of a launch's rank output: the stream a person watches says each thing once. Every
line still goes, unchanged, to its node's and rank's log (the node actor writes them); only the stream is
shorter:

- a library warning (Python's `path.py:LINE: SomeWarning: message`, or a logger's warning line) is shown
  the first time any rank of the run prints it; the same warning from other ranks or later launches, and
  the source line Python prints under it, are not. When a launch ends, one line says how many warnings came
  again, from how many ranks, and where the rank logs are;
- iteration lines (Megatron-LM's `iteration N/M | ... | lm loss: ...`) are not shown: the supervisor's
  `progress:` line says the same, once per `observe.summary_every` iterations;
- a rank's result record (`A4RAY_RESULT {...}`) is data for the driver, not a line for a person.

Anything else, errors and tracebacks above all, is shown whole.

What a4ray's own Ray tasks print (the conversion's parts and verifier, the staging tasks) follows the same
rules. Ray would forward a worker's stdout and stderr to the driver raw: every copy of every warning, each
behind a `(task-name pid=N)` prefix in terminal colours. Such a task runs `captured`, which sends the
process's own output (fd 1 and 2: C libraries' too, and the imports of what it runs) into a file of the run's
logs; the driver then shows that file through this filter (`TaskLog.relay`), as `[verify] line`.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from a4ray.core.console import say
from a4ray.core.redact import redact
from a4ray.programs.record import RESULT_MARKER

# Python's warnings.formatwarning: "{filename}:{lineno}: {category}: {message}", then the source line, indented.
_PY_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ")
# Loggers: "WARNING:name:msg" (logging's default), "[WARNING | name]: msg" (megatron-core), "W1125 ... ]" (glog),
# "[transformers] msg" (transformers 5's handler, transformers/utils/logging.py: it prints WARNING and above).
_LOG_WARNING = re.compile(r"^(\[rank\d+\]:)?(WARNING:|\[WARNING\b|\[?W\d{4} \d\d:\d\d:\d\d|\[transformers\] )")
# glog's prefix (time, thread id) differs on every copy of one warning: "[W1128 09:24:13.912000 4738 file.cpp:1730] ",
# and torch's process-group prefix names the rank: "[PG ID 0 PG GUID 0(default_pg) Rank 1] ".
_GLOG_STAMP = re.compile(r"^(\[rank\d+\]:)?\[?W\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")
_PG_RANK = re.compile(r"\bRank \d+\]")
# What C++ prints under a warning: the frames of its stack (torch's TORCH_WARN with a backtrace).
_CPP_FRAME = re.compile(r"^(frame #\d+: |Exception raised from )")


class StreamFilter:
    """Decides, line by line, what of a run's rank output the driver prints. One per run (`for_run`): a
    warning shown in one launch (the preflight, an attempt before a restart) is not shown again in the next."""

    def __init__(self) -> None:
        self.seen: set[str] = set()  # warnings shown (glog's time stamp left out)
        self._after_warning: set[str] = set()  # ranks whose previous line was a warning: its source line is next
        self._held_now: set[str] = set()  # ranks whose previous line was held back: its C++ frames are too
        self._held: dict[str, set[str]] = {}  # since the last summary: warning -> ranks whose copies were held

    def show(self, rank: str, text: str, *, progress: bool = False) -> bool:
        """Whether to print `text`, a line of `rank` ("n0 r3"); `progress`: it is an iteration line."""
        follows_warning = rank in self._after_warning
        self._after_warning.discard(rank)
        if rank in self._held_now and _CPP_FRAME.match(text):
            return False  # a frame of the C++ stack under a warning held back
        self._held_now.discard(rank)
        if progress or text.startswith(RESULT_MARKER):
            return False
        if follows_warning and text.startswith((" ", "\t")) and text.strip():
            return False  # the warning's source line (`  warnings.warn(`): in the rank's log
        if _PY_WARNING.match(text) or _LOG_WARNING.match(text):
            self._after_warning.add(rank)
            key = _PG_RANK.sub("Rank N]", _GLOG_STAMP.sub("", text))
            if key not in self.seen:
                self.seen.add(key)
                return True
            self._held.setdefault(key, set()).add(rank)
            self._held_now.add(rank)
            return False
        return True

    def summary(self, logs: str, sources: str = "rank") -> str | None:
        """One line on the warnings held back since the last summary, if any: how many, from how many ranks
        (or tasks: `sources`), where they are."""
        if not self._held:
            return None
        ranks = set().union(*self._held.values())
        distinct = len(self._held)
        self._held = {}
        return (f"library warnings: {distinct} shown once above came again from {len(ranks)} {sources}(s); every "
                f"copy is in the {sources} logs ({logs})")


_RUNS: dict[str, StreamFilter] = {}


def for_run(run: str) -> StreamFilter:
    """The stream filter of run `run` (its id), made on first use."""
    return _RUNS.setdefault(run, StreamFilter())


# ------------------------------------------------------------------------------- a4ray's own Ray tasks

_COLOUR = re.compile(rb"\x1b\[[0-9;]*m")  # SGR: terminal colours and styles
_DRAIN_S = 5.0  # after the call: how long what it printed last has to reach the log (a child that kept the fd)


def captured(log: str, target: str | Callable, *args: Any, **kwargs: Any) -> Any:
    """Run in a Ray task: call `target` with this process's stdout and stderr appended, line by line and redacted,
    to `log`. `target`: "module:function", imported here, so that what its import prints is captured too; or a
    function (its module already imported)."""
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    out = open(log, "a", encoding="utf-8")  # noqa: SIM115 - the copier closes it
    read, write = os.pipe()
    copier = threading.Thread(target=_copy, args=(read, out), name="a4ray-task-output", daemon=True)
    copier.start()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(write, 1)
    os.dup2(write, 2)
    os.close(write)
    try:
        if isinstance(target, str):
            module, _, name = target.partition(":")
            target = getattr(importlib.import_module(module), name)
        return target(*args, **kwargs)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)  # the pipe's last writers closed: the copier reads to its end
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        copier.join(_DRAIN_S)


def _copy(fd: int, out) -> None:
    with open(fd, "rb") as pipe, out:
        for raw in pipe:
            # A progress bar redraws its line with \r: the log keeps where it got to. A log is no terminal: no
            # colour codes.
            text = _COLOUR.sub(b"", raw.rstrip(b"\r\n").rsplit(b"\r", 1)[-1]).decode(errors="replace")
            try:
                out.write(redact(text) + "\n")
                out.flush()
            except OSError:
                pass  # a full disk: reading on keeps the task from blocking on a full pipe


@dataclass
class TaskLog:
    """The driver's side of a task that runs `captured`: its file in the run's logs, and `relay`, which shows
    what the task added to it in the stream."""

    run: str  # the run's id: whose filter (a warning shown by a rank of the run is not shown again)
    who: str  # the task, as the stream names it: [verify]
    path: Path
    start: int = 0  # what an earlier task of the same name wrote to the file was shown then

    @classmethod
    def open(cls, log_dir: Path, who: str) -> TaskLog:
        """The log of task `who` in `log_dir`: the run's `logs/` or a step's `logs/<step>/` (core/rundir.py)."""
        path = log_dir / f"{who.replace(' ', '-')}.log"
        run = next((d.parent.name for d in (log_dir, *log_dir.parents) if d.name == "logs"), str(log_dir))
        return cls(run, who, path, path.stat().st_size if path.is_file() else 0)

    def show(self) -> None:
        """Print what the task wrote since `start`, through the run's filter."""
        if not self.path.is_file():
            return
        with self.path.open("rb") as f:
            f.seek(self.start)
            added = f.read()
        self.start += len(added)
        stream = for_run(self.run)
        for text in added.decode(errors="replace").splitlines():
            if stream.show(self.who, text):
                print(f"[{self.who}] {text}", flush=True)


def relay(logs: list[TaskLog]) -> None:
    """Show what these tasks printed, then the one line on the warnings held back."""
    for log in logs:
        log.show()
    if logs and (held := for_run(logs[0].run).summary(str(logs[0].path.parent / "*.log"), "task")):
        say(held)
