"""What a4ray says to the user: one prefixed, redacted, flushed line at a time (read in `ray job logs`)."""

from __future__ import annotations

import sys

from a4ray.core.redact import redact


def say(message: str) -> None:
    for line in message.splitlines() or [""]:
        print(f"a4ray: {redact(line)}", flush=True)


def warn(message: str) -> None:
    for line in message.splitlines() or [""]:
        print(f"a4ray: warning: {redact(line)}", file=sys.stderr, flush=True)


def table(title: str, columns: list[str], rows: list[list[object]]) -> str:
    """A plain-text table (rich, no colour) for job logs and terminals alike, at its natural width: a cell is
    never cut or folded (a path cut mid-way cannot be copied), however long."""
    import io

    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, title_justify="left", show_lines=False)
    for column in columns:
        t.add_column(column)
    for row in rows:
        t.add_row(*("" if v is None else str(v) for v in row))
    buffer = io.StringIO()
    Console(file=buffer, width=_UNBOUNDED, color_system=None, force_terminal=False).print(t)
    return redact("\n".join(line.rstrip() for line in buffer.getvalue().rstrip().splitlines()))


_UNBOUNDED = 100_000  # columns: rich sizes a table to its content, up to the console's width
