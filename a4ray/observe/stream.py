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

A launch's ranks print the same lines (a trainer's config, its model summary), so the stream shows each line once
for every rank that printed it, in order (`RankLines`): `[ranks 0-3] line`, or `[n0 r1] line` where one rank printed
it. A line waits at most `HOLD_S` (half a second) after the driver reads it for its copies from the other ranks:
the same moment's line of every node reaches the driver within about 0.2 s (a node's poll gathers its ranks' lines
for 0.1 s before it answers), and half a second is no delay to a person watching, while showing a line at once and
its copies later would take two lines where one says it. A line every rank printed is shown as its last copy
comes. A copy that comes after its line was shown (a node that started late, common at hundreds of nodes) does not
show the line again: it is counted, and within `FOLD_S` of the first such copy, or before the next line of those
ranks, one line says which ranks printed how many copies of lines shown above (a copy more than `_JOIN_S` after
its line is a line again). Identical means identical text: "rank 3 ready" and "rank 2 ready" are two lines.

A rank's lines stay in its order: a copy joins a line only after the rank's own previous line. A line of the rank's
own that waits ahead of the copy moves to just before the line it copies, so that "rank 2 on host-b" printed before
the config does not split the config; nobody else's lines move. A traceback is one unit, from `Traceback (most
recent call last):` to its exception line: shown together, never split among other ranks' lines, and folded only
with a traceback identical to it line for line. `observe.rank_lines: all` shows every rank's copy at once instead,
each tagged with its rank, as Ray's `RAY_DEDUP_LOGS=0` does; the rank logs keep every copy either way.

What a4ray's own Ray tasks print (the conversion's parts and verifier, the staging tasks) follows the same
rules. Ray would forward a worker's stdout and stderr to the driver raw: every copy of every warning, each
behind a `(task-name pid=N)` prefix in terminal colours. Such a task runs `captured`, which sends the
process's own output (fd 1 and 2: C libraries' too, and the imports of what it runs) into a file of the run's
logs; the driver then shows that file through this filter (`TaskLog.relay`), as `[verify] line`.
"""

from __future__ import annotations

import collections
import importlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from a4ray.core.console import say
from a4ray.core.redact import redact
from a4ray.observe.stacks import ranges
from a4ray.programs.record import RESULT_MARKER

# Python's warnings.formatwarning: "{filename}:{lineno}: {category}: {message}", then the source line, indented.
# A frozen module's file name has a space in it: "<frozen runpy>:128: RuntimeWarning: ..." (python -m of a package
# whose module was imported already).
_PY_WARNING = re.compile(r"^(\S+|<frozen [\w.]+>):\d+: \w*Warning: ")
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
            key = _warning_key(text)
            if key not in self.seen:
                self.seen.add(key)
                return True
            self._held.setdefault(key, set()).add(rank)
            self._held_now.add(rank)
            return False
        return True

    def unhold(self, rank: str, text: str) -> None:
        """A copy of a warning held back that the stream shows after all, among the ranks of the line it copies
        (`RankLines`): not one the summary counts."""
        key = _warning_key(text)
        ranks = self._held.get(key)
        if ranks is not None:
            ranks.discard(rank)
            if not ranks:
                del self._held[key]

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


def _warning_key(text: str) -> str:
    """A warning as every rank prints it: glog's time stamp and thread id, and torch's process-group rank, left out."""
    return _PG_RANK.sub("Rank N]", _GLOG_STAMP.sub("", text))


_RUNS: dict[str, StreamFilter] = {}


def for_run(run: str) -> StreamFilter:
    """The stream filter of run `run` (its id), made on first use."""
    return _RUNS.setdefault(run, StreamFilter())


# ------------------------------------------------------------------------------- the same line from many ranks

HOLD_S = 0.5  # how long a rank line waits for its copies from other ranks (the module's docstring says why)
FOLD_S = 1.0  # how long copies that come after their line was shown are counted before one line says so
# How long a line shown stays one that later copies fold into. A copy later still is shown as a line of its own, with
# its ranks; the bound keeps what the driver remembers to what was shown lately.
_JOIN_S = 60.0
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:")  # torch's prefix on what a rank prints as it fails
_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")

Source = tuple[str, int]  # ("rank", global rank) or ("node", node): who printed a line


@dataclass(eq=False)
class _Group:
    """One line (or one traceback) as the stream shows it, and who printed it."""

    lines: tuple[str, ...]
    kind: str  # "rank" | "node"
    first: str  # the first printer as the stream names it: "n0 r1"
    due_at: float  # when it is shown at the latest
    printers: set[int] = field(default_factory=set)
    order: int | None = None  # its place in the stream, once shown
    shown_at: float = 0.0


@dataclass
class _Traceback:
    lines: list[str]
    started: float


class RankLines:
    """What the stream shows of one launch's rank lines: what the run's `StreamFilter` lets through, each line that
    several ranks printed once, with their ranks (the module's docstring tells the rules). `add` takes each line as
    the driver reads it; `due` prints what is due and says how soon more will be; `flush` prints everything held,
    at the end of the launch. `ranks` and `nodes`: how many print (a line all of them printed waits for nothing)."""

    def __init__(self, stream: StreamFilter, *, ranks: int, nodes: int, every_rank: bool = False,
                 hold_s: float = HOLD_S, fold_s: float = FOLD_S, clock: Callable[[], float] = time.monotonic,
                 write: Callable[[str], None] | None = None):
        self.stream = stream
        self.every_rank = every_rank
        self.counts = {"rank": ranks, "node": nodes}
        self.hold_s = hold_s
        self.fold_s = fold_s
        self.clock = clock
        self.write = write or (lambda text: print(text, flush=True))
        self._waiting: list[_Group] = []  # not shown yet, in the order they will be
        self._known: dict[tuple[str, tuple[str, ...]], list[_Group]] = {}  # waiting or shown lately, by kind and text
        self._last: dict[Source, _Group] = {}  # each printer's latest line: its next may only come after it
        self._tracebacks: dict[Source, _Traceback] = {}  # a traceback each printer is in the middle of
        self._late: dict[Source, int] = {}  # copies of lines already shown, not yet said
        self._late_since: float | None = None
        self._names: dict[Source, str] = {}
        self._shown = 0
        self._shown_lately: collections.deque[_Group] = collections.deque()  # in `_known`, in the order shown

    def add(self, who: str, text: str, *, rank: int | None, node: int, progress: bool = False) -> bool:
        """A line of rank `rank` (global; None: a line of node `node`'s own), `who` as the stream names it ("n0 r3",
        "n0"). Returns whether the run's filter lets it through (it may be shown later, with other ranks)."""
        shown = self.stream.show(who, text, progress=progress)
        if self.every_rank:
            if shown:
                self.write(f"[{who}] {text}")
            return shown
        source: Source = ("rank", rank) if rank is not None else ("node", node)
        self._names[source] = who
        if shown:
            self._take(source, text, self.clock())
        elif not progress and source not in self._tracebacks:
            group = self._joinable(source, (text,))
            if group is not None and group.order is None:  # a warning's copy: shown with the line it copies
                self._join(source, group)
                self.stream.unhold(who, text)  # not counted among the copies held back
        return shown

    def due(self) -> float | None:
        """Print what is due now; returns the seconds until more may be, or None while nothing waits."""
        now = self.clock()
        for source, trace in list(self._tracebacks.items()):
            if now >= trace.started + self.hold_s:  # it never reached its exception line: shown as far as it got
                del self._tracebacks[source]
                self._place(source, tuple(trace.lines), trace.started)
        last_due = max((i for i, group in enumerate(self._waiting) if group.due_at <= now), default=-1)
        for _ in range(last_due + 1):  # in order: what waits before a line due is shown with it
            self._show(self._waiting.pop(0), now)
        while self._waiting and self._complete(self._waiting[0]):
            self._show(self._waiting.pop(0), now)
        if self._late_since is not None and now >= self._late_since + self.fold_s:
            self._say_late()
        self._forget(now)
        wake = [group.due_at for group in self._waiting] + [t.started + self.hold_s for t in self._tracebacks.values()]
        if self._late_since is not None:
            wake.append(self._late_since + self.fold_s)
        return max(0.0, min(wake) - now) if wake else None

    def flush(self) -> None:
        """Print everything held: the launch is ending."""
        now = self.clock()
        for source, trace in list(self._tracebacks.items()):
            del self._tracebacks[source]
            self._place(source, tuple(trace.lines), trace.started)
        while self._waiting:
            self._show(self._waiting.pop(0), now)
        self._say_late()

    def _take(self, source: Source, text: str, now: float) -> None:
        body = _RANK_PREFIX.sub("", text, count=1)
        trace = self._tracebacks.get(source)
        if trace is not None:
            trace.lines.append(text)
            # its exception line: the first line neither indented nor blank, nor a chained traceback's words
            if body.strip() and not body[0].isspace() and not body.startswith((_TRACEBACK, *_CHAINED)):
                del self._tracebacks[source]
                self._place(source, tuple(trace.lines), trace.started)
        elif body.startswith(_TRACEBACK):
            self._tracebacks[source] = _Traceback([text], now)
        else:
            self._place(source, (text,), now)

    def _place(self, source: Source, lines: tuple[str, ...], read_at: float) -> None:
        """The line (or traceback) `lines` of `source`, read at `read_at`: a copy of one waiting or shown lately that
        comes after the source's previous line (or can be made to: `_pull_back`), else a new line, last in the
        stream."""
        group = self._joinable(source, lines) or self._pull_back(source, lines)
        if group is not None:
            self._join(source, group)
            if group.order is not None:  # its line is shown already: a copy to count
                self._late[source] = self._late.get(source, 0) + len(lines)
                self._late_since = self._late_since if self._late_since is not None else read_at
            return
        group = _Group(lines, source[0], self._names[source], read_at + self.hold_s, {source[1]})
        self._waiting.append(group)
        self._known.setdefault((source[0], lines), []).append(group)
        self._last[source] = group

    def _joinable(self, source: Source, lines: tuple[str, ...]) -> _Group | None:
        """The first line with this text, shown lately or waiting, that `source` has not printed and that comes after
        the source's previous line."""
        last = self._last.get(source)
        after = self._place_of(last) if last is not None else (-1, -1)
        candidates = [g for g in self._known.get((source[0], lines), ())
                      if source[1] not in g.printers and self._place_of(g) > after]
        return min(candidates, key=self._place_of, default=None)

    def _pull_back(self, source: Source, lines: tuple[str, ...]) -> _Group | None:
        """A waiting line with this text placed before lines of the source's own that wait after it: where those are
        the source's alone (a rank's line of its own, "rank 2 on host-b", came before the copy), they move to just
        before it, and the copy joins it. Nobody else's order changes, and nothing waits longer."""
        for group in sorted((g for g in self._known.get((source[0], lines), ())
                             if g.order is None and source[1] not in g.printers), key=self._place_of):
            at = self._waiting.index(group)
            movers = [g for g in self._waiting[at + 1:] if source[1] in g.printers]
            if movers and all(g.printers == {source[1]} for g in movers):
                for mover in movers:
                    self._waiting.remove(mover)
                self._waiting[at:at] = movers
                return group
        return None

    def _join(self, source: Source, group: _Group) -> None:
        group.printers.add(source[1])
        self._last[source] = group

    def _place_of(self, group: _Group) -> tuple[int, int]:
        """Where a group is in the stream: shown ones in the order shown, then the waiting ones in theirs."""
        return (0, group.order) if group.order is not None else (1, self._waiting.index(group))

    def _complete(self, group: _Group) -> bool:
        return len(group.printers) >= self.counts[group.kind]

    def _show(self, group: _Group, now: float) -> None:
        if any(self._late.get((group.kind, p)) for p in group.printers):
            self._say_late()  # what those ranks printed before this line
        group.order, group.shown_at = self._shown, now
        self._shown += 1
        self._shown_lately.append(group)
        tag = self._tag(group.kind, group.printers, group.first)
        for text in group.lines:
            self.write(f"[{tag}] {text}")

    def _say_late(self) -> None:
        """One line for the ranks that printed the same number of copies of lines already shown."""
        by_count: dict[tuple[str, int], list[int]] = {}
        for (kind, printer), count in self._late.items():
            by_count.setdefault((kind, count), []).append(printer)
        self._late, self._late_since = {}, None
        for (kind, count), printers in by_count.items():
            tag = self._tag(kind, set(printers), self._names[(kind, printers[0])])
            each = " each" if len(printers) > 1 else ""
            self.write(f"[{tag}] {count} more line{'s' if count > 1 else ''}{each}, copies of lines shown above "
                       f"(every copy is in the {kind} logs)")

    def _forget(self, now: float) -> None:
        """Lines shown long enough ago: later copies of them are lines of their own."""
        while self._shown_lately and now - self._shown_lately[0].shown_at >= _JOIN_S:
            group = self._shown_lately.popleft()
            key = (group.kind, group.lines)
            self._known[key].remove(group)
            if not self._known[key]:
                del self._known[key]

    @staticmethod
    def _tag(kind: str, printers: set[int], first: str) -> str:
        return first if len(printers) == 1 else f"{kind}s {ranges(sorted(printers))}"


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
