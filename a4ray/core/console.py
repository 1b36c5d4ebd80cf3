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
    """A plain-text table (rich, no colour) for job logs and terminals alike. Cells wrap at spaces, never
    inside a word or a path (a path cut mid-way cannot be copied): each column is at least as wide as its
    longest word, and the table grows past the usual width where those need it."""
    import io

    from rich.console import Console
    from rich.table import Table

    cells = [["" if v is None else str(v) for v in row] for row in rows]
    t = Table(title=title, title_justify="left", show_lines=False)
    widest = []
    for i, column in enumerate(columns):
        words = [w for row in cells for w in row[i].split()] + column.split()
        widest.append(max(map(len, words), default=1))
        t.add_column(column, min_width=widest[-1], overflow="fold")
    for row in cells:
        t.add_row(*row)
    buffer = io.StringIO()
    width = max(_WIDTH, sum(widest) + 3 * len(columns) + 1)  # the borders and padding of each column
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(t)
    return redact("\n".join(line.rstrip() for line in buffer.getvalue().rstrip().splitlines()))


_WIDTH = 160  # columns a table may take before its cells wrap (at spaces)
