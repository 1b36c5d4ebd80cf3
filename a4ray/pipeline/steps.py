"""The steps of a recipe, in order: stage -> convert -> preflight -> train.

Each step says what runs it (`runs`), which of its outputs a later step reads (checked when the step is
skipped), what it would do (`plan`), and runs to one of: `ran`; `cached` (its outputs are current, nothing
to do); `skipped` (by --skip / --from, or not needed with this trainer: the reason is given). Every step
runs on the pipeline's connection and logs under the pipeline's run directory (`logs/<step>/`). What the
train step runs, and whether the convert step has work, the trainer says (`a4ray.trainers`).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import ClassVar

from a4ray.core.console import say
from a4ray.core.errors import A4RayError, SpecError, StagingFailed, StepError, UnsupportedModel
from a4ray.core.rundir import RunDir
from a4ray.hf2mcore.converter import ConvertWorkload
from a4ray.hf2mcore.mapping import parameters
from a4ray.mcore.architecture import Architecture
from a4ray.pipeline import nodefs
from a4ray.pipeline.pipeline_result import StepResult
from a4ray.runtime.connect import Connection
from a4ray.spec.conversion import ConvertJob
from a4ray.spec.recipes import RecipeJob
from a4ray.staging.stager import make_standins, stage
from a4ray.staging.stager import plan as staging_plan
from a4ray.trainers import Trainer, trainer_for
from a4ray.workloads.doctor import CheckpointNeed, Doctor, report

TRAIN_MARKER = "a4ray-train.json"


@dataclass
class Context:
    spec: RecipeJob
    conn: Connection
    workspace: str  # the workspace root on the nodes
    run_dir: RunDir
    checkpoint: str = ""  # the Megatron checkpoint the trainer loads (the convert step's output)

    def trainer(self) -> Trainer:
        return trainer_for(self.spec, self.workspace, self.checkpoint, simulated=self.conn.simulated)


class Step(ABC):
    name: ClassVar[str]

    def __init__(self, spec: RecipeJob, trainer: Trainer):
        self.spec = spec
        self.trainer = trainer

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
        return staging_plan(self.spec).splitlines()[1:]

    def run(self, ctx: Context) -> StepResult:
        made = make_standins(self.spec)
        notes = [made] if made else []
        try:
            result = stage(self.spec, workspace=ctx.workspace, conn=ctx.conn, log_dir=ctx.run_dir.step_logs(self.name))
        except StagingFailed as failure:
            print(failure.result.table(), flush=True)
            raise
        print(result.table(), flush=True)
        cached = all(a.status == "cached" for a in result.artifacts)
        return StepResult(name=self.name, status="cached" if cached else "ran", detail="; ".join(
            [*notes, result.verdict]), result=result.model_dump(mode="json"),
            outputs={a.name: a.target for a in result.artifacts})


# ---------------------------------------------------------------------------------------- convert


class Convert(Step):
    name = "convert"

    def jobs(self) -> list[ConvertJob]:
        """The conversions this recipe's trainer needs (`Trainer.convert_inputs`), as `convert` jobs
        (a4ray.hf2mcore.converter runs each)."""
        spec, c = self.spec, self.spec.convert
        cluster = spec.cluster.model_copy(update={"nodes": 1}) if c.backend == "swift" else spec.cluster
        jobs = []
        for model in self.trainer.convert_inputs():
            main = model == (c.input or spec.model_dir)
            section = self.trainer.convert_section(c.model_copy(update={
                "input": model, "output": spec.convert_output if main else f"{model}-to-mcore"}))
            jobs.append(ConvertJob(name=f"{spec.name[:31].rstrip('-')}-convert", cluster=cluster, network=spec.network,
                                   storage=spec.storage, restart=spec.restart, observe=spec.observe, convert=section))
        return jobs

    def not_needed(self) -> str | None:
        return self.trainer.conversion_skipped()

    def runs(self) -> str:
        backend = self.jobs()[0].convert.backend
        return {"pai": "Pai's distributed converter (toolkits/distributed_checkpoints_convertor) on every node",
                "native": "a4ray's native converter: Ray tasks over layer ranges",
                "swift": "ms-swift's `swift export --to_mcore` on one node"}[backend]

    def outputs(self, workspace: str) -> dict[str, str]:
        return {"the converted checkpoint (convert.output/latest)":
                f"{self.trainer.checkpoint}/latest_checkpointed_iteration.txt"}

    def adopt(self, ctx: Context) -> None:
        ctx.checkpoint = self.trainer.checkpoint

    def plan(self, workspace: str) -> list[str]:
        lines = []
        for job in self.jobs():
            source = self.spec.on_nodes(workspace, job.convert.input)
            lines += [f"{job.convert.backend} backend: {source} -> {self.trainer.converted(job.convert.input)}",
                      *ConvertWorkload(job).plan().render().splitlines()]
        return lines

    def run(self, ctx: Context) -> StepResult:
        jobs = self.jobs()
        results = [ConvertWorkload(job).run(ctx.conn, ctx.run_dir, log_dir=ctx.run_dir.step_logs(self.name))
                   for job in jobs]
        failed = next((r for r in results if not r.ok), None)
        if failed is not None:
            raise StepError(self.name, failed.verdict)
        result = results[-1]  # what the trainer trains from
        ctx.checkpoint = result.checkpoint or self.trainer.checkpoint
        status = "cached" if all(r.status == "cached" for r in results) else \
            result.status if result.status in ("ran", "skipped") else "ran"
        return StepResult(name=self.name, status=status, detail="\n".join(r.verdict for r in results),
                          outputs={"checkpoint": ctx.checkpoint, **{f"checkpoint of {Path(j.convert.input).name}":
                                                                    r.checkpoint for j, r in zip(jobs, results[:-1])}},
                          result=result.model_dump(mode="json", exclude={"gang"}))


# -------------------------------------------------------------------------------------- preflight


# A checkpoint's bytes per parameter with mixed precision: the bf16 weights (2 B) and the optimizer's fp32 main
# weights and Adam's two moments (4 B each), as megatron-core's distributed optimizer saves them.
CHECKPOINT_BYTES_PER_PARAMETER = 14


def checkpoint_need(trainer: Trainer, found: tuple[dict, str] | None) -> CheckpointNeed | None:
    """What the train step will save, from the model's config.json (`found`: it and where it was read)."""
    if found is None:
        return None
    config, where = found
    try:
        params = parameters(Architecture.from_config(config, where))
    except (UnsupportedModel, KeyError):
        return None  # a model the native mapping does not know: the floor alone
    train = trainer.spec.train
    iterations, every = getattr(train, "iterations", None), getattr(train, "save_interval", None)
    count = math.ceil(iterations / every) if iterations and isinstance(every, int) else None  # auto: not known
    kept = trainer.checkpoints_kept()
    if kept is not None:  # the newest is written before the oldest goes
        count = min(count, kept + 1) if count else kept + 1
    each = params * CHECKPOINT_BYTES_PER_PARAMETER
    local = {}
    if getattr(train, "trainer", None) == "megatron" and train.local_save_interval:  # the node's share, the replicas
        # it holds, twice while one is written (other trainers take no local checkpoints)
        nodes = trainer.spec.cluster.nodes
        replicas = 1 if trainer.local_replication(nodes) else train.local_replicas
        local = {"local_path": trainer.spec.storage.local_checkpoints, "local_bytes": 2 * replicas * each // nodes}
    return CheckpointNeed(
        path=trainer.checkpoints, each_bytes=each, count=count, **local,
        reckoned=f"{params:,} parameters x {CHECKPOINT_BYTES_PER_PARAMETER} B: bf16 weights, fp32 main weights "
                 "and Adam's two moments")


class Preflight(Step):
    name = "preflight"

    def runs(self) -> str:
        return ("a4ray doctor on every node of the gang (GPUs, gIB, RDMA, /dev/shm, disk for the checkpoints, py-spy, "
                "shared workspace, clocks)")

    def plan(self, workspace: str) -> list[str]:
        need = checkpoint_need(self.trainer, self.trainer.model_config())
        room = [] if need is None else [
            f"checkpoints: ~{need.each} each ({need.reckoned})" + (f", {need.count} on disk at most" if need.count else "")
            + f" under {need.path}: the disk check fails without room for one above the "
            f"{self.spec.doctor.min_free_disk_gb:g} GiB floor and warns without room for all"]
        return [*room, "a failed check stops the pipeline before the train launch (--skip preflight to go on anyway)"]

    def run(self, ctx: Context) -> StepResult:
        trainer = ctx.trainer()
        where = f"{self.spec.on_nodes(ctx.workspace, self.spec.model_dir)}/config.json"
        config = nodefs.read_json(self.spec.cluster, where)  # as staged on the nodes, else the published one
        need = checkpoint_need(trainer, (config, where) if config else trainer.model_config())
        result = Doctor(self.spec).run(ctx.conn, ctx.run_dir, log_dir=ctx.run_dir.step_logs(self.name),
                                       checkpoints=need)
        report(result)
        if not result.ok:
            raise StepError(self.name, result.verdict, hint="fix the node named, or --skip preflight to train anyway")
        return StepResult(name=self.name, status="ran", detail=result.verdict, result=result.model_dump(mode="json"))


# ------------------------------------------------------------------------------------------ train


def fingerprint(work: Trainer) -> str:
    """What the train launch runs (every node's command and env, rendezvous left out): equal = same training."""
    nodes = [(n.argv, sorted(n.env.items())) for n in work.plan().nodes]
    return hashlib.sha256(json.dumps(nodes).encode()).hexdigest()


class Train(Step):
    name = "train"

    def runs(self) -> str:
        return self.trainer.runs()

    def plan(self, workspace: str) -> list[str]:
        return self.trainer.plan_lines() + self.trainer.plan().render().splitlines()

    def run(self, ctx: Context) -> StepResult:
        spec = self.spec
        trainer = ctx.trainer()
        lost = nodefs.missing(spec.cluster, trainer.inputs())
        if lost:
            raise StepError(self.name, "missing on the nodes: " + "; ".join(lost),
                            hint="run the steps that make them (stage, convert), or fix the paths in the spec")
        self._check_model(trainer, ctx)
        marker = str(PurePosixPath(trainer.output) / TRAIN_MARKER)
        key = fingerprint(trainer)
        done = nodefs.read_json(spec.cluster, marker)
        if done and done.get("fingerprint") == key and done.get("ok"):
            return StepResult(name=self.name, status="cached", detail=f"finished {done.get('finished')}: "
                              f"{done.get('verdict')}", outputs=done.get("outputs", {}), result=done.get("result"))
        say(f"train: straggler check {trainer.straggler_check()}")
        result = trainer.run(ctx.conn, ctx.run_dir, log_dir=ctx.run_dir.step_logs(self.name))
        if result.table():
            print(result.table(), flush=True)
        outputs = trainer.outputs(result)
        record = result.model_dump(mode="json", exclude={"gang"})
        if result.gang is not None:  # the node verdicts of the last attempt stay in the run record
            record.update(result.gang.model_dump(mode="json", include={"stragglers", "hang_verdict"}))
        step = StepResult(name=self.name, status="ran" if result.ok else "failed", detail=result.verdict,
                          outputs=outputs, result=record)
        if result.ok:
            nodefs.write_text(spec.cluster, marker, json.dumps({
                "fingerprint": key, "ok": True, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "verdict": result.verdict, "outputs": outputs, "result": step.result, "run": str(ctx.run_dir.root)},
                indent=1))
        return step

    def _check_model(self, trainer: Trainer, ctx: Context) -> None:
        """The staged model's config against what the trainer will build (Pai's script hard-codes shapes)."""
        if not trainer.checks_model:
            return
        where = f"{self.spec.on_nodes(ctx.workspace, self.spec.model_dir)}/config.json"
        config = nodefs.read_json(self.spec.cluster, where)
        if config is None:
            return  # trained from the converted checkpoint alone; nothing to compare
        problems = trainer.check_model(config, where)
        if problems:
            raise SpecError(self.spec.source, problems)


STEP_CLASSES: tuple[type[Step], ...] = (Stage, Convert, Preflight, Train)


def steps_of(spec: RecipeJob, workspace: str, *, simulated: bool = False) -> list[Step]:
    trainer = trainer_for(spec, workspace, simulated=simulated)
    return [cls(spec, trainer) for cls in STEP_CLASSES]


def failed(name: str, error: BaseException, seconds: float, runs: str) -> StepResult:
    text = str(error) if isinstance(error, A4RayError) else f"{type(error).__name__}: {error}"
    return StepResult(name=name, status="failed", seconds=seconds, runs=runs, detail=text)
