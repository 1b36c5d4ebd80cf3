"""Specs of the training recipes: pipelines `stage -> convert -> preflight -> train` of one model each.

    qwen3_next   Qwen3-Next-80B-A3B-Instruct, pretraining or SFT with Pai-Megatron-Patch   (python -m a4ray.qwen3_next)
    qwen3        Qwen3-30B-A3B pretraining with Pai-Megatron-Patch (seed 002)               (python -m a4ray.qwen3)
    swift_dpo    DPO of Qwen3-30B-A3B-Instruct-2507 with ms-swift (seed 004)                (python -m a4ray.swift_dpo)

A recipe's defaults are the A4 run of its seed (`recipe_defaults`, layered under what the YAML and `--set`
give, field by field); `jobs/<kind>_local.yaml` is the local rehearsal profile. Paths are relative to
the workspace unless absolute.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from a4ray.spec.artifacts import Staged
from a4ray.spec.conversion import ConvertSpec
from a4ray.spec.fields import PathStr, Spec, on_nodes
from a4ray.spec.job import JOB_KINDS, JobSpec, job_kind
from a4ray.spec.train import SwiftTrainSpec, TrainSpec

STEPS = ("stage", "convert", "preflight", "train")
StepName = Literal["stage", "convert", "preflight", "train"]

PAI_REPO = "git+https://github.com/alibaba/Pai-Megatron-Patch.git@a098ca5acbdeaf7172ce0393fa309b39a77506db"
PAI_DATA = "https://atp-modelzoo-wlcb-pai.oss-cn-wulanchabu.aliyuncs.com/release/models/pai-megatron-patch"
_PAI_ARTIFACTS = [
    {"name": "pretrain-mmap", "source": f"{PAI_DATA}/qwen-datasets/", "target": "datasets/qwen-mmap",
     "files": ["mmap_qwen3_datasets_text_document.bin", "mmap_qwen3_datasets_text_document.idx"]},
    {"name": "sft-alpaca", "source": f"{PAI_DATA}/datasets/", "target": "datasets/alpaca",
     "files": ["alpaca_zh-train-general.json", "alpaca_zh-valid-general.json"]},
    {"name": "pai-megatron-patch", "source": PAI_REPO, "target": "Pai-Megatron-Patch"},
]


class PipelineSpec(Spec):
    """Which steps run. A skipped step's outputs must exist (they are checked, and named if missing)."""

    skip: list[StepName] = Field(default_factory=list, description="steps not to run (--skip stage,convert)")
    start: StepName | None = Field(None, description="--from: begin at this step; the ones before it are skipped")

    def skipped(self, step: str) -> bool:
        return step in self.skip or (self.start is not None and STEPS.index(step) < STEPS.index(self.start))

    def read_later(self, step: str) -> bool:
        """Whether a step after `step` runs, and so may read what `step` makes (a skipped step's outputs must exist
        only then: `--skip convert,preflight,train` stages and nothing else)."""
        return any(not self.skipped(later) for later in STEPS[STEPS.index(step) + 1:])


def _merged(defaults: Any, given: Any) -> Any:
    """`given` layered over `defaults`, mapping by mapping; anything else given replaces the default."""
    if isinstance(defaults, dict) and isinstance(given, dict):
        out = dict(defaults)
        for key, value in given.items():
            out[key] = _merged(defaults.get(key), value) if key in defaults else value
        return out
    return given


class RecipeJob(Staged, JobSpec):
    """A pipeline job. Subclasses set `kind`, `train` and `recipe_defaults` (their seed's A4 run)."""

    pipeline: PipelineSpec = PipelineSpec()
    convert: ConvertSpec = ConvertSpec()
    standins: PathStr | None = Field(None, description="local rehearsals: make the tiny stand-ins (a4ray.staging.standins) "
                                 "in this directory, relative to the current one, before staging them")
    recipe_defaults: ClassVar[dict] = {}
    rehearses_locally: ClassVar[bool] = True

    @model_validator(mode="before")
    @classmethod
    def _layer_over_defaults(cls, data: Any) -> Any:
        return _merged(cls.recipe_defaults, data) if isinstance(data, dict) else data

    def write_paths(self) -> list[tuple[tuple[str | int, ...], str]]:
        """The staged targets, the conversions and the trainer's output (checkpoints, logs)."""
        return [*super().write_paths(), (("convert", "output"), self.convert_output),
                (("train", "output"), self.train_output)]

    @field_validator("standins")
    @classmethod
    def _standins_here(cls, path: str | None) -> str | None:
        # Made relative to the directory the (simulated) cluster started in, not the workspace.
        if path is not None and (".." in PurePosixPath(path).parts or path.startswith("/")):
            raise ValueError(f"{path!r}: give a directory relative to the current one, without '..'")
        return path

    on_nodes = staticmethod(on_nodes)

    @property
    def model_dir(self) -> str:
        """The Hugging Face checkpoint the pipeline converts and trains."""
        return self.train.model

    @property
    def convert_output(self) -> str:
        """Where conversions of the model go (one directory per input and options, `latest` the newest)."""
        return self.convert.output or f"{self.convert.input or self.model_dir}-to-mcore"

    def converted(self, workspace: str) -> str:
        """The newest conversion of the model, as the nodes see it: what a trainer loads by default."""
        return str(PurePosixPath(self.on_nodes(workspace, self.convert_output)) / "latest")

    @property
    def train_output(self) -> str:
        t = self.train
        mode = getattr(t, "mode", "dpo")
        return t.output or f"logs/output_{t.trainer}_{self.kind}_{mode}"

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks: the job's GPUs over the trainer's model parallelism (tp * pp * cp)."""
        parallel, _ = self.train.parallelism()
        return max(1, self.cluster.world_size // parallel.model_parallel)

    @property
    def global_batch(self) -> int:
        """`train.global_batch_size`, or its default: one micro-batch per data-parallel rank. Every trainer
        takes it from here."""
        return self.train.global_batch_size or self.train.micro_batch_size * self.data_parallel

    def batch_problems(self) -> list[str]:
        """The batch sizes and the parallelism against the job's GPUs, each naming the field to change: the
        one check every trainer runs before anything is launched (its own model checks come on top)."""
        t, c = self.train, self.cluster
        par, field = t.parallelism()
        world, problems = c.world_size, []
        if world % par.model_parallel:
            problems.append(f"{field}: tp*pp*cp = {par.tp}*{par.pp}*{par.cp} = {par.model_parallel} does not divide "
                            f"the {world} GPUs of cluster.nodes={c.nodes} x cluster.gpus_per_node={c.gpus_per_node}")
        elif self.global_batch % (t.micro_batch_size * self.data_parallel):
            problems.append(f"train.global_batch_size={self.global_batch} must be a multiple of train.micro_batch_size "
                            f"x data-parallel size = {t.micro_batch_size} x {self.data_parallel} (data-parallel = "
                            f"{world} GPUs / (tp*pp*cp = {par.model_parallel}))")
        if world % (par.etp * par.ep * par.pp):
            problems.append(f"{field}: etp*ep*pp = {par.etp}*{par.ep}*{par.pp} does not divide the {world} GPUs")
        name, length = t.sequence()
        if par.cp > 1 and length % (2 * par.cp):
            problems.append(f"{name}={length} must be a multiple of 2 x {field}.cp = {2 * par.cp}")
        return problems


def _model_artifact(repo: str) -> tuple[dict, str]:
    """A Hugging Face checkpoint as an artifact, and where it is staged. It is resolved to a commit when
    staged (recorded in its manifest); pin it with @<commit>."""
    name = repo.split("/")[1]
    target = f"ckpts/huggingface/{name}"
    return {"name": name.lower(), "source": f"hf://{repo}", "target": target}, target


def _pai_recipe(repo: str, *, train: dict, **sections: dict) -> dict:
    """A Pai recipe's defaults: the checkpoint `repo`, Pai's datasets and pinned checkout, Pai's converter,
    Pai's run script trained from the checkpoint with `train`."""
    artifact, target = _model_artifact(repo)
    megatron = {"parallel": train["pai"]["parallel"]}  # train.trainer=megatron: the seed's parallelism too
    return {"artifacts": [artifact, *_PAI_ARTIFACTS], "convert": {"backend": "pai"},
            "train": {"model": target, "megatron": megatron, **train}, **sections}


@job_kind
class Qwen3NextJob(RecipeJob):
    """Qwen3-Next-80B-A3B-Instruct with Pai-Megatron-Patch `examples/qwen3_next/run_mcore_qwen3.sh` (seed 000)."""

    kind: Literal["qwen3_next"] = "qwen3_next"
    train: TrainSpec = TrainSpec()
    recipe_defaults: ClassVar[dict] = _pai_recipe(
        "Qwen/Qwen3-Next-80B-A3B-Instruct", staging={"max_workers": 16},  # 160 GB in ~40 shards
        train={"seq_len": 1024, "iterations": 100, "warmup_iterations": 10, "save_interval": 50,
               # The seeds' B200 run: EP8, flash attention (TE's fused attention has no SM100 kernel for
               # Qwen3-Next's kv_channels=256), no recompute, one micro-batch per data-parallel rank.
               "pai": {"script": "examples/qwen3_next/run_mcore_qwen3.sh", "model_size": "A3B",
                       "parallel": {"tp": 1, "pp": 1, "cp": 1, "etp": 1, "ep": 8}, "flash_attention": True,
                       "recompute": "none"}})


@job_kind
class Qwen3Job(RecipeJob):
    """Qwen3-30B-A3B pretraining with Pai-Megatron-Patch `examples/qwen3/run_mcore_qwen3.sh` (seed 002)."""

    kind: Literal["qwen3"] = "qwen3"
    train: TrainSpec = TrainSpec()
    recipe_defaults: ClassVar[dict] = _pai_recipe(
        "Qwen/Qwen3-30B-A3B",
        # seed 002: `dlc A3B 1 8 1e-5 1e-6 128 128 bf16 4 2 1 1 4 true true true false sel false ...`
        train={"micro_batch_size": 1, "global_batch_size": 8, "lr": 1e-5, "min_lr": 1e-6, "seq_len": 128,
               "iterations": 9, "warmup_iterations": 0, "save_interval": 100,
               "pai": {"script": "examples/qwen3/run_mcore_qwen3.sh", "model_size": "A3B",
                       "parallel": {"tp": 4, "pp": 2, "cp": 1, "etp": 1, "ep": 4, "sp": True},
                       "distributed_optimizer": True, "flash_attention": True, "recompute": "sel"}})


@job_kind
class SwiftDPOJob(RecipeJob):
    """DPO of Qwen3-30B-A3B-Instruct-2507 with ms-swift `megatron rlhf --rlhf_type dpo` (seed 004)."""

    kind: Literal["swift_dpo"] = "swift_dpo"
    train: SwiftTrainSpec = SwiftTrainSpec()
    recipe_defaults: ClassVar[dict] = {
        "artifacts": [_model_artifact("Qwen/Qwen3-30B-A3B-Instruct-2507")[0]],
        # ms-swift < 3.12 trains from an mcore checkpoint: `swift export --to_mcore` (seed 004's conversion),
        # by the same ms-swift as the trainer: the pipeline converts with train.version.
        "convert": {"backend": "swift", "precision": "bf16"},
    }


# Every recipe kind (all defined above): the kinds the pipeline runs.
RECIPE_KINDS = tuple(kind for kind, cls in JOB_KINDS.items() if issubclass(cls, RecipeJob))
