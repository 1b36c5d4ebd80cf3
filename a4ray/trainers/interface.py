"""What the pipeline asks of a trainer. Each trainer (`train.trainer`: pai, swift, torch, ...) is the gang
workload of the train step, and answers the pipeline's questions: does the convert step have work for it,
what must exist on the nodes, does the staged model fit what it builds, what does it report. The pipeline
asks; it never looks at the trainer's name.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

from a4ray.core.errors import SpecError
from a4ray.spec.conversion import ConvertSpec
from a4ray.spec.recipes import RecipeJob
from a4ray.workloads.workload import Workload, WorkloadResult


class Trainer(Workload[RecipeJob]):
    name: ClassVar[str]  # its `train.trainer` value
    checks_model: ClassVar[bool] = False  # whether the staged HF config.json is held against `check_model`

    def __init__(self, spec: RecipeJob, *, workspace: str, checkpoint: str = ""):
        """`workspace`: the workspace root as the nodes see it; `checkpoint`: the convert step's output, if
        it ran (default: the newest conversion of the model)."""
        super().__init__(spec)
        self.workspace = workspace
        self.checkpoint = checkpoint or spec.converted(workspace)
        self.output = spec.on_nodes(workspace, spec.train_output)

    @abstractmethod
    def runs(self) -> str:
        """What does the work (named in plans and in the pipeline's table)."""

    def problems(self) -> list[str]:
        """What this trainer would reject later, beyond the batch and parallelism check every trainer runs."""
        return []

    def check(self) -> None:
        problems = self.spec.batch_problems() + self.problems()
        if problems:
            raise SpecError(self.spec.source, problems)

    def conversion_skipped(self) -> str | None:
        """Why the convert step has nothing to do for this trainer (it is skipped with the reason), or None."""
        return None

    def convert_section(self, section: ConvertSpec) -> ConvertSpec:
        """The convert step's options as this trainer needs them (default: the recipe's `convert:`)."""
        return section

    def inputs(self) -> dict[str, str]:
        """{what: path} that must exist on the nodes before the launch (named if missing)."""
        return {}

    def check_model(self, config: dict, where: str) -> list[str]:
        """Problems of the staged model (its HF config.json at `where`) against what this trainer builds."""
        return []

    def plan_lines(self) -> list[str]:
        """What the plan shows before every node's command."""
        return []

    @property
    def checkpoints(self) -> str:
        """Where it saves its checkpoints, as the nodes see it."""
        return self.output

    def outputs(self, result: WorkloadResult) -> dict[str, str]:
        """{what: path} the train step reports."""
        return {"output": self.output}
