"""A pipeline's typed result (`result.json` of every recipe kind): its steps, each ran | cached | skipped (or
failed). Apart from the runner, so that reading one back, or a driver of another kind, never imports the
converter and torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from a4ray.core.console import table
from a4ray.core.errors import A4RayError
from a4ray.core.results import Result, axes, register_result
from a4ray.observe.progress import Progress, history
from a4ray.spec.recipes import RECIPE_KINDS

Status = Literal["ran", "cached", "skipped", "failed", "cancelled", "not-run"]


class StepResult(BaseModel):
    name: str
    status: Status
    seconds: float = 0.0
    runs: str = ""  # what does the work, here
    detail: str = ""  # what happened, or why not (the first line is the summary)
    outputs: dict[str, str] = {}
    result: dict[str, Any] | None = None  # the step's own typed result, as JSON


class PipelineResult(Result):
    job: str
    run_dir: str = ""
    workspace: str = ""
    cancelled: bool = False
    steps: list[StepResult] = []

    def table(self) -> str:
        rows = [[s.name, s.status, f"{s.seconds:.1f}s" if s.status != "not-run" else "-", s.runs,
                 first_line(s.detail)] for s in self.steps]
        return table(f"pipeline {self.job}", ["step", "status", "time", "runs", "detail"], rows)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 130 if self.cancelled else 1

    def rows(self) -> list[dict[str, Any]]:
        return [{"step": s.name, "status": s.status, "seconds": s.seconds, "runs": s.runs,
                 "detail": first_line(s.detail)} for s in self.steps]

    def step(self, name: str) -> StepResult:
        try:
            return next(s for s in self.steps if s.name == name)
        except StopIteration:
            names = ", ".join(s.name for s in self.steps)
            raise KeyError(f"no step {name!r} in this pipeline (steps: {names})") from None

    def progress(self) -> list[Progress]:
        """The train step's logged iterations (loss, step time, ...), from its rank logs in the run directory."""
        return history(Path(self.run_dir) / "logs" / "train")

    def summary(self) -> dict[str, Any]:
        last = (self.progress() or [None])[-1]
        return {**{s.name: s.status for s in self.steps},
                "iteration": last.iteration if last else None, "loss": last.loss if last else None,
                "step ms": last.step_time_ms if last else None}

    def plot(self, ax=None):
        points = [(p.iteration, p.loss) for p in self.progress() if p.loss is not None]
        if not points:
            raise A4RayError(f"no training iterations logged in {Path(self.run_dir) / 'logs' / 'train'}",
                             hint="the train step did not run here, or its logs are not visible from this machine")
        ax = axes(ax, title=f"{self.job}: lm loss", xlabel="iteration", ylabel="lm loss")
        ax.plot(*zip(*points), marker=".")
        return ax


def first_line(text: str, width: int = 110) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= width else line[: width - 3] + "..."


register_result(PipelineResult, *RECIPE_KINDS)
