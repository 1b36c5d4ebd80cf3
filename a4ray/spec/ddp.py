"""Spec of the DDP test: a small real DDP training run on every GPU of every node."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from a4ray.spec.fields import NonNegativeFloat, PositiveInt, Spec
from a4ray.spec.job import JobSpec, job_kind


class DDPTestSpec(Spec):
    """A small MLP trained under DDP on every GPU; the ranks' parameters must agree at the end."""

    steps: PositiveInt = Field(20, description="training steps")
    hidden: PositiveInt = Field(1024, description="width of the MLP layers")
    layers: PositiveInt = Field(4, description="MLP layers")
    batch_size: PositiveInt = Field(32, description="samples per rank and step")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl on GPUs, gloo on CPU")
    tolerance: NonNegativeFloat = Field(
        0.0, description="max abs difference allowed between ranks' parameters (DDP keeps them identical)"
    )


@job_kind
class DDPTestJob(JobSpec):
    """A small real DDP training run on every GPU of every node."""

    kind: Literal["ddp_test"] = "ddp_test"
    ddp_test: DDPTestSpec = DDPTestSpec()
