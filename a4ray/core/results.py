"""What every typed result can do in a notebook, and how results are read back from `result.json`.

A result is a pydantic model (`kind`, `ok`, `verdict`, plus its own fields). On top of that:
`rows()` is its data as records, `to_pandas()` those records as a DataFrame, `summary()` the few numbers
a sweep compares, `plot()` its natural chart (busbw vs size, loss vs iteration) and `_repr_html_` the
verdict and table Jupyter shows. pandas and matplotlib are imported only when asked for
(`pip install a4ray[notebook]`).
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from a4ray.core.errors import A4RayError

# job kind -> the result class its `result.json` is read back as (see `register_result`)
RESULT_TYPES: dict[str, type[Result]] = {}


class Result(BaseModel):
    kind: str  # the job kind (a pipeline step's own: the trainer's name for the train step)
    ok: bool  # it passed
    verdict: str  # one line: PASS or FAIL (OK or FAILED for a pipeline), and why

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        kind = cls.model_fields["kind"].default
        if isinstance(kind, str):
            RESULT_TYPES.setdefault(kind, cls)

    @property
    def exit_code(self) -> int:
        """The exit code of a command that ran this job: 0 if it passed, else 1."""
        return 0 if self.ok else 1

    def table(self) -> str:
        """The result as plain-text tables (job logs, terminals)."""
        return ""

    def rows(self) -> list[dict[str, Any]]:
        """The result's data, one record per row (what `to_pandas()` holds)."""
        return []

    def summary(self) -> dict[str, Any]:
        """The few numbers that compare runs (a sweep's columns)."""
        return {}

    def to_pandas(self):
        return dataframe(self.rows())

    def plot(self, ax=None):
        """Its natural chart on `ax` (default: a new figure); returns the axes."""
        raise A4RayError(f"a {self.kind} result has no chart", hint="its data is in .to_pandas()")

    def _repr_html_(self) -> str:
        colour = "#1a7f37" if self.ok else "#cf222e"
        parts = [f'<p style="color:{colour}"><b>{html.escape(self.verdict)}</b></p>']
        if self.rows():
            try:
                parts.append(self.to_pandas().to_html(index=False, max_rows=60))
            except ImportError:
                parts.append(f"<pre>{html.escape(self.table())}</pre>")
        elif self.table():
            parts.append(f"<pre>{html.escape(self.table())}</pre>")
        return "\n".join(parts)


def dataframe(rows: list[dict[str, Any]]):
    """`rows` as a pandas DataFrame (pandas is imported here, on first use: `pip install 'a4ray[notebook]'`)."""
    try:
        import pandas
    except ImportError:
        raise ImportError("pandas is needed for .to_pandas(): pip install 'a4ray[notebook]'") from None
    return pandas.DataFrame(rows)


def axes(ax=None, *, title: str, xlabel: str, ylabel: str):
    """`ax`, or the axes of a new figure, labelled."""
    if ax is None:
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("matplotlib is needed for .plot(): pip install 'a4ray[notebook]'") from None
        _, ax = plt.subplots(figsize=(7, 4))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return ax


def register_result(cls: type[Result], *kinds: str) -> type[Result]:
    """Read `result.json` of these job kinds as `cls` (a subclass with a `kind` default registers itself)."""
    for kind in kinds:
        RESULT_TYPES[kind] = cls
    return cls


def load_result(data: dict | str | Path) -> Result:
    """A typed result from `result.json` (its path, its text or its parsed dict). The modules that define
    result classes must be imported (the driver imports every job's)."""
    if isinstance(data, Path):
        data = data.read_text()
    if isinstance(data, str):
        data = json.loads(data)
    if set(data) <= set(Result.model_fields):  # how a run ended without a typed result (cancelled, refused)
        return Result.model_validate(data)
    return RESULT_TYPES.get(data.get("kind", ""), Result).model_validate(data)
