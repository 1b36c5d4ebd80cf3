"""What the driver shows of a launch's rank output: the stream a person watches says each thing once. Every
line still goes, unchanged, to its node's and rank's log (the node actor writes them); only the stream is
shorter:

- a library warning (Python's `path.py:LINE: SomeWarning: message`, or a logger's `WARNING` line) is shown
  the first time any rank prints it; the same warning from other ranks, and the source line Python prints
  under it, are not. When the launch ends, one line says how many ranks printed warnings and where the
  rank logs are;
- iteration lines (Megatron-LM's `iteration N/M | ... | lm loss: ...`) are not shown: the supervisor's
  `progress:` line says the same, once per `observe.summary_every` iterations;
- a rank's result record (`A4RAY_RESULT {...}`) is data for the driver, not a line for a person.

Anything else, errors and tracebacks above all, is shown whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from a4ray.programs.record import RESULT_MARKER

# Python's warnings.formatwarning: "{filename}:{lineno}: {category}: {message}", then the source line, indented.
_PY_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ")
# Loggers: "WARNING:name:msg" (logging's default), "[WARNING | name]: msg" (megatron-core), "W1125 ... ]" (glog).
_LOG_WARNING = re.compile(r"^(WARNING:|\[WARNING\b|\[?W\d{4} \d\d:\d\d:\d\d)")


@dataclass
class _Warning:
    ranks: set[str] = field(default_factory=set)
    copies: int = 0


class StreamFilter:
    """Decides, line by line, what of a launch's rank output the driver prints."""

    def __init__(self) -> None:
        self.warnings: dict[str, _Warning] = {}
        self._after_warning: set[str] = set()  # ranks whose previous line was a warning: its source line is next

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
            seen = self.warnings.setdefault(text, _Warning())
            seen.ranks.add(rank)
            seen.copies += 1
            return seen.copies == 1
        return True

    def summary(self, logs: str) -> str | None:
        """One line on the warnings held back, if any: how many, from how many ranks, where they are."""
        repeated = sum(w.copies - 1 for w in self.warnings.values())
        if not repeated:
            return None
        ranks = set().union(*(w.ranks for w in self.warnings.values()))
        return (f"library warnings: {len(self.warnings)} distinct, each shown once above; {repeated} more "
                f"copies from {len(ranks)} rank(s) are only in the rank logs ({logs})")
