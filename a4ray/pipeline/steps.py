"""The steps of a recipe, in order: stage -> convert -> preflight -> train.

Each step says what runs it (`runs`), which of its outputs a later step reads (checked when the step is
skipped), what it would do (`plan`), and runs to one of: `ran`; `cached` (its outputs are current, nothing
to do); `skipped` (by --skip / --from, or not needed with this trainer: the reason is given).
"""

from __future__ import annotations

import hashlib
import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Literal

from pydantic import BaseModel

from a4ray.core.console import say
from a4ray.core.errors import A4RayError, SpecError, StagingFailed, StepError
from a4ray.pipeline import nodefs
from a4ray.core.rundir import RunDir
from a4ray.spec.conversion import ConvertJob
from a4ray.spec.recipes import RecipeJob
from a4ray.workloads.workload import Workload

Status = Literal["ran", "cached", "skipped", "failed", "not-run"]
TRAIN_MARKER = "a4ray-train.json"


class StepResult(BaseModel):
    name: str
    status: Status
    seconds: float = 0.0
    runs: str = ""  # what does the work, here
    detail: str = ""  # what happened, or why not (the first line is the summary)
    outputs: dict[str, str] = {}
    result: dict[str, Any] | None = None  # the step's own typed result, as JSON


@dataclass
class Context:
    spec: RecipeJob
    workspace: str  # the workspace root on the nodes
    run_dir: RunDir
    checkpoint: str = ""  # the Megatron checkpoint the trainer loads (the convert step's output)


class Step(ABC):
    name: ClassVar[str]

    def __init__(self, spec: RecipeJob):
        self.spec = spec

    def not_needed(self) -> str | None:
        """Why this step has nothing to do with this spec (it is then skipped with the reason), or None."""
        return None

    @abstractmethod
    def runs(self) -> str:
        """What does the work of this step (named in plans and in the result table)."""

    def outputs(self, workspace: str) -> dict[str, str]:
        """{what: path} a later step reads; they must exist when the step is skipped."""
        return {}

    def adopt(self, ctx: Context) -> None:
        """Take over the outputs of a skipped run of this step (so later steps find them)."""

    @abstractmethod
    def plan(self, workspace: str) -> list[str]:
        """What the step would do, from the spec alone (for --dry-run)."""

    @abstractmethod
    def run(self, ctx: Context) -> StepResult:
        """Do the step (ran) or find it current (cached); raise an A4RayError naming what went wrong."""


# ------------------------------------------------------------------------------------------ stage


class Stage(Step):
    name = "stage"

    def not_needed(self) -> str | None:
        return None if self.spec.artifacts else "the spec lists no artifacts"

    def runs(self) -> str:
        made = "tiny stand-ins made here, then " if self.spec.standins else ""
        return f"{made}Ray tasks of the staging service (a4ray.staging), one per artifact"

    def outputs(self, workspace: str) -> dict[str, str]:
        out = {}
        for a in self.spec.artifacts:
            target = self.spec.on_nodes(workspace, a.target)
            out[f"artifact {a.name} (staged to {a.target})"] = target
            out.update({f"artifact {a.name}: {f}": f"{target}/{f}" for f in a.files})
        return out

    def plan(self, workspace: str) -> list[str]:
        from a4ray.staging.stager import plan

        made = [f"first: make the tiny local stand-ins in {self.spec.standins} (a4ray.staging.standins)"] \
            if self.spec.standins else []
        return made + plan(self.spec).splitlines()[1:]

    def run(self, ctx: Context) -> StepResult:
        from a4ray.staging import stage

        notes = []
        if self.spec.standins:
            from a4ray.staging.standins import make_all

            t0 = time.monotonic()
            made = make_all(self.spec.standins)
            notes.append(f"stand-ins in {Path(self.spec.standins).resolve()} ({time.monotonic() - t0:.1f}s)")
            say(f"stage: {notes[0]}: {', '.join(made)}")
        try:
            result = stage(self.spec, workspace=ctx.workspace)
        except StagingFailed as failure:
            print(failure.result.table(), flush=True)
            raise
        print(result.table(), flush=True)
        cached = all(a.status == "cached" for a in result.artifacts)
        return StepResult(name=self.name, status="cached" if cached else "ran", detail="; ".join(
            [*notes, result.verdict]), result=result.model_dump(mode="json"),
            outputs={a.name: a.target for a in result.artifacts})


# ---------------------------------------------------------------------------------------- convert


def convert_job(spec: RecipeJob) -> ConvertJob:
    """The conversion this recipe needs, as the `convert` job a4ray.convert runs."""
    c = spec.convert
    section = c.model_copy(update={"input": c.input or spec.model_dir, "output": spec.convert_output})
    if spec.train.trainer == "swift":  # one ms-swift in the image: the trainer's version converts too
        section = section.model_copy(update={"swift": c.swift.model_copy(update={"version": spec.train.version})})
    cluster = spec.cluster.model_copy(update={"nodes": 1}) if c.backend == "swift" else spec.cluster
    return ConvertJob(name=f"{spec.name[:31].rstrip('-')}-convert", cluster=cluster, network=spec.network,
                      storage=spec.storage, restart=spec.restart, observe=spec.observe, convert=section)


def convert_plan(job: ConvertJob) -> str:
    """The conversion's dry-run plan: the native plan of parts, or the pai/swift per-node commands."""
    from a4ray.convert.converter import ConvertWorkload

    return ConvertWorkload(job).plan().render()


class Convert(Step):
    name = "convert"

    def not_needed(self) -> str | None:
        t = self.spec.train
        if t.trainer == "torch" and self.spec.convert.backend != "native":
            return ("the built-in trainer trains from the Hugging Face checkpoint (train.model); with "
                    f"train.trainer=pai this step runs the {self.spec.convert.backend} converter")
        if t.trainer == "swift":
            from a4ray.trainers.swift import trains_from_mcore

            if not trains_from_mcore(t):
                return f"ms-swift {t.version} trains from the Hugging Face weights (--model): no offline conversion"
        return None

    def runs(self) -> str:
        backend = self.spec.convert.backend
        return {"pai": "Pai's distributed converter (toolkits/distributed_checkpoints_convertor) on every node",
                "native": "a4ray's native converter: Ray tasks over layer ranges",
                "swift": "ms-swift's `swift export --to_mcore` on one node"}[backend]

    def latest(self, workspace: str) -> str:
        return str(PurePosixPath(self.spec.on_nodes(workspace, self.spec.convert_output)) / "latest")

    def outputs(self, workspace: str) -> dict[str, str]:
        return {"the converted checkpoint (convert.output/latest)":
                f"{self.latest(workspace)}/latest_checkpointed_iteration.txt"}

    def adopt(self, ctx: Context) -> None:
        ctx.checkpoint = self.latest(ctx.workspace)

    def plan(self, workspace: str) -> list[str]:
        job = convert_job(self.spec)
        source = self.spec.on_nodes(workspace, job.convert.input)
        head = [f"{job.convert.backend} backend: {source} -> {self.latest(workspace)}"]
        return head + convert_plan(job).splitlines()

    def run(self, ctx: Context) -> StepResult:
        from a4ray.convert import convert

        result = convert(convert_job(self.spec))
        if not result.ok:
            raise StepError(self.name, result.verdict)
        ctx.checkpoint = result.checkpoint or self.latest(ctx.workspace)
        status = result.status if result.status in ("ran", "cached", "skipped") else "ran"
        return StepResult(name=self.name, status=status, detail=result.verdict, outputs={"checkpoint": ctx.checkpoint},
                          result=result.model_dump(mode="json", exclude={"gang"}))


# -------------------------------------------------------------------------------------- preflight


class Preflight(Step):
    name = "preflight"

    def runs(self) -> str:
        return ("a4ray doctor on every node of the gang (GPUs, gIB, RDMA, /dev/shm, disk, py-spy, shared workspace, "
                "clocks)")

    def plan(self, workspace: str) -> list[str]:
        return ["a failed check stops the pipeline before the train launch (--skip preflight to go on anyway)"]

    def run(self, ctx: Context) -> StepResult:
        from a4ray.workloads.doctor import doctor, report

        result = doctor(self.spec)
        report(result)
        if not result.ok:
            raise StepError(self.name, result.verdict, hint="fix the node named, or --skip preflight to train anyway")
        return StepResult(name=self.name, status="ran", detail=result.verdict, result=result.model_dump(mode="json"))


# ------------------------------------------------------------------------------------------ train


def train_workload(spec: RecipeJob, workspace: str, checkpoint: str = "") -> Workload:
    trainer = spec.train.trainer
    if trainer == "pai":
        from a4ray.trainers.pai import PaiTrain

        return PaiTrain(spec, workspace=workspace, load=checkpoint or Convert(spec).latest(workspace))
    if trainer == "swift":
        from a4ray.trainers.swift import SwiftTrain

        return SwiftTrain(spec, workspace=workspace, load=checkpoint or Convert(spec).latest(workspace))
    from a4ray.trainers.builtin import TorchTrain

    return TorchTrain(spec, workspace=workspace)


def fingerprint(work: Workload) -> str:
    """What the train launch runs (every node's command and env, rendezvous left out): equal = same training."""
    nodes = [(n.argv, sorted(n.env.items())) for n in work.plan().nodes]
    return hashlib.sha256(json.dumps(nodes).encode()).hexdigest()


class Train(Step):
    name = "train"

    def runs(self) -> str:
        t = self.spec.train
        if t.trainer == "pai":
            return f"Pai-Megatron-Patch {t.pai.script} on every node (bash; the script starts torchrun per node)"
        if t.trainer == "swift":
            return f"ms-swift {t.version} `megatron rlhf --rlhf_type dpo` on every node (its launcher starts torchrun)"
        return "a4ray's built-in trainer: torchrun of a4ray.trainer on every node (DDP)"

    def plan(self, workspace: str) -> list[str]:
        work = train_workload(self.spec, workspace)
        lines = []
        if self.spec.train.trainer == "pai":
            lines += ["run_mcore_qwen3.sh arguments:", *(f"  {line}" for line in work.describe()),
                      f"checkpoints: {work.checkpoint_dir}"]
        return lines + work.plan().render().splitlines()

    def run(self, ctx: Context) -> StepResult:
        from a4ray.runner import run_attempts

        spec = self.spec
        work = train_workload(spec, ctx.workspace, ctx.checkpoint)
        work.check()
        lost = nodefs.missing(spec.cluster, work.inputs())
        if lost:
            raise StepError(self.name, "missing on the nodes: " + "; ".join(lost),
                            hint="run the steps that make them (stage, convert), or fix the paths in the spec")
        self._check_model(ctx)
        marker = str(PurePosixPath(spec.on_nodes(ctx.workspace, spec.train_output)) / TRAIN_MARKER)
        key = fingerprint(work)
        done = nodefs.read_json(spec.cluster, marker)
        if done and done.get("fingerprint") == key and done.get("ok"):
            return StepResult(name=self.name, status="cached", detail=f"finished {done.get('finished')}: "
                              f"{done.get('verdict')}", outputs=done.get("outputs", {}), result=done.get("result"))
        result = run_attempts(spec, work, ctx.run_dir, log_dir=ctx.run_dir.logs / "train")
        if result.table():
            print(result.table(), flush=True)
        outputs = {"output": spec.on_nodes(ctx.workspace, spec.train_output)}
        if getattr(result, "checkpoint", ""):
            outputs["checkpoint"] = result.checkpoint
        if getattr(result, "checkpoint_dir", ""):
            outputs["checkpoints"] = result.checkpoint_dir
        step = StepResult(name=self.name, status="ran" if result.ok else "failed", detail=result.verdict,
                          outputs=outputs, result=result.model_dump(mode="json", exclude={"gang"}))
        if result.ok:
            nodefs.write_text(spec.cluster, marker, json.dumps({
                "fingerprint": key, "ok": True, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "verdict": result.verdict, "outputs": outputs, "result": step.result, "run": str(ctx.run_dir.root)},
                indent=1))
        return step

    def _check_model(self, ctx: Context) -> None:
        """The staged model's config against what the trainer will build (Pai's script hard-codes shapes)."""
        spec = self.spec
        if spec.train.trainer not in ("pai", "swift"):
            return
        where = f"{spec.on_nodes(ctx.workspace, spec.model_dir)}/config.json"
        config = nodefs.read_json(spec.cluster, where)
        if config is None:
            return  # trained from the converted checkpoint alone; nothing to compare
        if spec.train.trainer == "pai":
            from a4ray.trainers.pai import check_hf_config, model_of

            model = model_of(spec)
            problems = check_hf_config(config, model, spec, where) if model else []
        else:
            from a4ray.trainers.swift import check_hf_config

            problems = check_hf_config(config, spec, where)
        if problems:
            raise SpecError(spec.source, problems)


STEP_CLASSES: tuple[type[Step], ...] = (Stage, Convert, Preflight, Train)


def steps_of(spec: RecipeJob) -> list[Step]:
    return [cls(spec) for cls in STEP_CLASSES]


def failed(name: str, error: BaseException, seconds: float, runs: str) -> StepResult:
    text = str(error) if isinstance(error, A4RayError) else f"{type(error).__name__}: {error}"
    return StepResult(name=name, status="failed", seconds=seconds, runs=runs, detail=text)
