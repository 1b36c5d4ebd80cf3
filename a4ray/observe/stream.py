"""What the driver shows of a launch's rank output: the stream a person watches says each thing once. Every
line still goes, unchanged, to its node's and rank's log (the node actor writes them); only the stream is
shorter:

- a library warning (Python's `path.py:LINE: SomeWarning: message`, or a logger's `WARNING` line) is shown
  the first time any rank of the run prints it; the same warning from other ranks or later launches, and
  the source line Python prints under it, are not. When a launch ends, one line says how many warnings came
  again, from how many ranks, and where the rank logs are;
- iteration lines (Megatron-LM's `iteration N/M | ... | lm loss: ...`) are not shown: the supervisor's
  `progress:` line says the same, once per `observe.summary_every` iterations;
- a rank's result record (`A4RAY_RESULT {...}`) is data for the driver, not a line for a person.

Anything else, errors and tracebacks above all, is shown whole.
"""

from __future__ import annotations

import re

from a4ray.programs.record import RESULT_MARKER

# Python's warnings.formatwarning: "{filename}:{lineno}: {category}: {message}", then the source line, indented.
_PY_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ")
# Loggers: "WARNING:name:msg" (logging's default), "[WARNING | name]: msg" (megatron-core), "W1125 ... ]" (glog).
_LOG_WARNING = re.compile(r"^(WARNING:|\[WARNING\b|\[?W\d{4} \d\d:\d\d:\d\d)")


class StreamFilter:
    """Decides, line by line, what of a run's rank output the driver prints. One per run (`for_run`): a
    warning shown in one launch (the preflight, an attempt before a restart) is not shown again in the next."""

    def __init__(self) -> None:
        self.seen: set[str] = set()  # warnings shown
        self._after_warning: set[str] = set()  # ranks whose previous line was a warning: its source line is next
        self._held: dict[str, set[str]] = {}  # since the last summary: warning -> ranks whose copies were held

    def show(self, rank: str, text: str, *, progress: bool = False) -> bool:
        """Whether to print `text`, a line of `rank` ("n0 r3"); `progress`: it is an iteration line."""
        follows_warning = rank in self._after_warning
        self._after_warning.discard(rank)
        if progress or text.startswith(RESULT_MARKER):
            return False
        if follows_warning and text.startswith((" ", "\t")) and text.strip():
            return False  # the warning's source line (`  warnings.warn(`): in the rank's log
        if _PY_WARNING.match(text) or _LOG_WARNING.match(text):
            self._after_warning.add(rank)
            if text not in self.seen:
                self.seen.add(text)
                return True
            self._held.setdefault(text, set()).add(rank)
            return False
        return True

    def summary(self, logs: str) -> str | None:
        """One line on the warnings held back since the last summary, if any: how many, from how many ranks,
        where they are."""
        if not self._held:
            return None
        ranks = set().union(*self._held.values())
        distinct = len(self._held)
        self._held = {}
        return (f"library warnings: {distinct} shown once above came again from {len(ranks)} rank(s); every "
                f"copy is in the rank logs ({logs})")


_RUNS: dict[str, StreamFilter] = {}


def for_run(run: str) -> StreamFilter:
    """The stream filter of run `run` (its id), made on first use."""
    return _RUNS.setdefault(run, StreamFilter())
