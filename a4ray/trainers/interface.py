"""What the pipeline asks of a trainer. Each trainer (`train.trainer`: pai, swift, torch, ...) is the gang
workload of the train step, and answers the pipeline's questions: does the convert step have work for it,
what must exist on the nodes, does the staged model fit what it builds, what does it report. The pipeline
asks; it never looks at the trainer's name.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

from a4ray.core.console import table
from a4ray.core.errors import SpecError
from a4ray.core.results import axes
from a4ray.mcore.architecture import PUBLISHED_CONFIGS
from a4ray.runtime.launch import GangResult
from a4ray.spec.conversion import ConvertSpec
from a4ray.spec.recipes import RecipeJob
from a4ray.workloads.workload import Workload, WorkloadResult


class Trainer(Workload[RecipeJob]):
    name: ClassVar[str]  # its `train.trainer` value
    checks_model: ClassVar[bool] = False  # whether the staged HF config.json is held against `check_model`

    def __init__(self, spec: RecipeJob, *, workspace: str, checkpoint: str = "", simulated: bool = False):
        """`workspace`: the workspace root as the nodes see it; `checkpoint`: the convert step's output, if
        it ran (default: the newest conversion of what it trains); `simulated`: the nodes are simulated A4
        nodes on this machine (a rehearsal)."""
        super().__init__(spec)
        self.workspace = workspace
        self.simulated = simulated
        self.output = spec.on_nodes(workspace, spec.train_output)
        self._checkpoint = checkpoint

    @property
    def checkpoint(self) -> str:
        """The Megatron checkpoint it starts from: the convert step's output, else the newest conversion of
        what it trains (the last of `convert_inputs`)."""
        return self._checkpoint or self.converted(self.convert_inputs()[-1])

    def converted(self, model: str) -> str:
        """Where the newest conversion of `model` (a spec path) is, as the nodes see it."""
        if model == (self.spec.convert.input or self.spec.model_dir):
            return self.spec.converted(self.workspace)
        return str(PurePosixPath(self.spec.on_nodes(self.workspace, f"{model}-to-mcore")) / "latest")

    def model_config(self) -> tuple[dict, str] | None:
        """The HF config.json of the model it trains, and where it was read: the staged one where this machine
        sees it, else the published config of the Hub model the spec stages there; None if neither."""
        staged = Path(self.spec.on_nodes(self.workspace, self.spec.model_dir)) / "config.json"
        if staged.is_file():
            return json.loads(staged.read_text()), str(staged)
        hub = next((a.source.removeprefix("hf://").split("@")[0] for a in self.spec.artifacts
                    if a.target == self.spec.model_dir and a.source.startswith("hf://")), "")
        published = PUBLISHED_CONFIGS.get(hub)
        return (published, f"{hub}'s published config.json") if published else None

    def convert_inputs(self) -> list[str]:
        """The HF checkpoints (spec paths) the convert step converts for this trainer; it trains from the
        last one's conversion."""
        return [self.spec.convert.input or self.spec.model_dir]

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

    def straggler_check(self) -> str:
        """Whether the gang's straggler check (observe.straggler) sees this trainer's ranks, and why not."""
        return "off: this trainer's loop reports no per-rank compute time"

    @property
    def checkpoints(self) -> str:
        """Where it saves its checkpoints, as the nodes see it."""
        return self.output

    def checkpoints_kept(self) -> int | None:
        """How many of its checkpoints it keeps (the newest); None: every one it saves."""
        return None

    def outputs(self, result: WorkloadResult) -> dict[str, str]:
        """{what: path} the train step reports."""
        return {"output": self.output}


def fit_problems(field: str, par: Any, where: str, *, experts: int, heads: int | None = None,
                 groups: int | None = None, layers: int | None = None) -> list[str]:
    """What megatron-core would refuse about splitting the model `where` over `par` (the spec at `field`,
    e.g. train.parallel): tp must divide the heads and query groups, pp the layers, ep the experts; the
    sizes a trainer does not know are None."""
    problems = []
    for name, count in (("attention heads", heads), ("query groups", groups)):
        if count is not None and count % par.tp:
            problems.append(f"{field}.tp={par.tp} does not divide the {count} {name} of {where}")
    if layers is not None and layers % par.pp:
        problems.append(f"{field}.pp={par.pp} does not divide the {layers} layers of {where}")
    if experts and experts % par.ep:
        problems.append(f"{field}.ep={par.ep} does not divide the {experts} experts of {where}")
    if not experts and par.ep > 1:
        problems.append(f"{field}.ep={par.ep}: {where} is a dense model (no experts)")
    return problems


class LoopResult(WorkloadResult):
    """What a trainer with its own loop (the built-in one, the Megatron one) reports: its `A4RAY_RESULT`
    record, from the rank that has the loss."""

    world_size: int = 0
    backend: str = ""
    devices: list[str] = []
    iterations: int = 0
    start_iteration: int = 0
    loss_first: float | None = None
    loss_last: float | None = None
    losses: list[float] = []
    step_time_ms: float | None = None
    tokens_per_s: float | None = None
    checkpoint: str = ""

    def table(self) -> str:
        if not self.losses:
            return ""
        first = self.start_iteration + 1
        n = len(self.losses)
        marks = sorted({0, n // 4, n // 2, 3 * n // 4, n - 1})
        rows = [[first + i, f"{self.losses[i]:.4f}"] for i in marks]
        return table("lm loss", ["iteration", "lm loss"], rows)

    def rows(self) -> list[dict[str, Any]]:
        return [{"iteration": self.start_iteration + 1 + i, "loss": loss} for i, loss in enumerate(self.losses)]

    def summary(self) -> dict[str, Any]:
        return {"loss": self.loss_last, "step ms": self.step_time_ms, "tokens/s": self.tokens_per_s}

    def plot(self, ax=None):
        ax = axes(ax, title=f"lm loss ({self.world_size} ranks, {self.backend})", xlabel="iteration", ylabel="lm loss")
        rows = self.rows()
        ax.plot([r["iteration"] for r in rows], [r["loss"] for r in rows], marker=".")
        return ax

    @classmethod
    def of(cls, gang: GangResult) -> LoopResult:
        """The result of a launch, from the record of this trainer (`kind`) its nodes reported."""
        kind = cls.model_fields["kind"].default
        record = next((r for r in gang.records if r.get("trainer") == kind), None)
        fields = {k: v for k, v in (record or {}).items() if k in cls.model_fields and k != "kind"}
        ok = gang.ok and record is not None
        if ok:
            trained = record.get("trained", 0)
            resumed = f", resumed from iteration {record['start_iteration']}" if record.get("start_iteration") else ""
            loss = (f"; lm loss {record['loss_first']:.3f} -> {record['loss_last']:.3f}"
                    if trained and record.get("loss_first") is not None else "")
            verdict = (f"PASS: {trained} iteration(s) to {record['iterations']} on {record['world_size']} rank(s) "
                       f"({record['backend']}){resumed}{loss}; checkpoint {record['checkpoint']}")
        else:
            verdict = f"FAIL: {gang.brief or 'the trainer reported no result'}"
        return cls(ok=ok, verdict=verdict, gang=gang, **fields)
