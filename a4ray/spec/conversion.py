"""Spec of HF -> Megatron-core checkpoint conversion: the `convert` job kind and its `convert:` section.

`ConvertSpec` is the section a pipeline recipe embeds; `ConvertJob` is the job `a4ray convert -f` runs.
Paths are relative to the workspace (shared storage on a cluster, the local workspace when simulated)
unless absolute.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from a4ray.spec.fields import NonNegativeInt, PathStr, PositiveFloat, PositiveInt, Spec
from a4ray.spec.job import JobSpec, job_kind


class VerifySpec(Spec):
    """Checks run on the written checkpoint before it is committed."""

    enabled: bool | None = Field(
        None, description="default: on for the native backend, off for pai and swift (which may be turned on)")
    logits: bool = Field(True, description="load into a megatron-core GPTModel and compare logits with the HF model")
    round_trip: bool = Field(True, description="read every tensor back (mcore -> HF layout) and compare exactly")
    sequences: PositiveInt = Field(2, description="fixed random token sequences for the logits check")
    seq_len: PositiveInt = 16
    tolerance: PositiveFloat = Field(
        1e-4, description="max |logits difference| allowed, relative to the logits' scale (at least 1); "
        "both models compute in fp32")


class PaiConvertSpec(Spec):
    """Pai-Megatron-Patch's `toolkits/distributed_checkpoints_convertor`, run on every node of the gang."""

    repo: PathStr = Field("Pai-Megatron-Patch", description="the staged, pinned checkout (with its Megatron-LM submodules)")
    script: PathStr = Field("", description="default: scripts/qwen3/run_8xH20.sh, run_A22B_16xH20.sh for A22B, "
                        "scripts/qwen3_next/run_8xH20.sh for Qwen3-Next")
    model_size: str = Field("", description="MODEL_SIZE argument (0.6B ... 32B, A3B, A22B); default: from config.json")
    use_cuda: bool = True
    model_parallel_args: str = Field("", description="MODEL_PARALLEL_ARGS, overriding the script's TP/PP/EP")
    omp_num_threads: PositiveInt = 12


class SwiftConvertSpec(Spec):
    """ms-swift's offline conversion (`swift export --to_mcore true`), on one node."""

    version: str = Field("3.8.0", pattern=r"^\d+\.\d+(\.\d+)?", description="the ms-swift version in the image")
    nproc_per_node: PositiveInt = Field(1, description=">1: `megatron export` under torchrun (ms-swift >= 3.10)")
    tensor_model_parallel_size: PositiveInt = 1
    expert_model_parallel_size: PositiveInt = 1
    pipeline_model_parallel_size: PositiveInt = 1
    test_convert_precision: bool = Field(False, description="ms-swift's own logits check after converting")
    force: bool = Field(False, description="convert even where the version trains from HF weights directly (4.x)")


class ConvertSpec(Spec):
    """HF -> Megatron-core conversion: the `convert` job's section, and a recipe's convert step."""

    input: PathStr = Field("", description="the HF checkpoint directory (config.json + safetensors)")
    output: PathStr = Field("", description="where conversions go, one directory per input/options; "
                        "default: <input>-to-mcore next to the input")
    backend: Literal["native", "pai", "swift"] = Field(
        "native", description="native: a4ray's converter, Ray tasks across the nodes; pai: Pai-Megatron-Patch's "
        "(convert.pai); swift: ms-swift's (convert.swift)")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field("auto", description="auto: the input's dtype")
    naming: Literal["te", "local"] = Field(
        "te", description="parameter names of Transformer-Engine layer specs (Pai, ms-swift) or mcore's local specs")
    format: Literal["torch_dist", "legacy"] = Field(
        "torch_dist", description="torch_dist (parallelism-independent) or the legacy per-rank torch format")
    tasks_per_node: PositiveInt = Field(4, description="native: conversion tasks run at once on each node")
    min_part_mb: NonNegativeInt = Field(
        256, description="native: no part below this many MB where fewer parts cover the nodes: each part is a task, "
        "a process that starts Ray and torch (seconds of CPU), which a small part does not repay; 0: one part per "
        "task slot")
    max_mb_s_per_task: PositiveFloat | None = Field(
        None, description="native: cap each task's write rate (MB/s), to share a filer with running jobs")
    verify: VerifySpec = VerifySpec()
    pai: PaiConvertSpec = PaiConvertSpec()
    swift: SwiftConvertSpec = SwiftConvertSpec()

    @property
    def output_or_default(self) -> str:
        """`output`, else `<input>-to-mcore` (as given: relative paths are under the workspace)."""
        return self.output or f"{self.input}-to-mcore"

    @property
    def verify_enabled(self) -> bool:
        return self.verify.enabled if self.verify.enabled is not None else self.backend == "native"


@job_kind
class ConvertJob(JobSpec):
    """`a4ray convert -f`: convert a Hugging Face checkpoint to Megatron-core, cached and verified."""

    kind: Literal["convert"] = "convert"
    convert: ConvertSpec = ConvertSpec()

    def write_paths(self) -> list[tuple[tuple[str | int, ...], str]]:
        return [*super().write_paths(), (("convert", "output"), self.convert.output_or_default)]
