"""Spec of the generic command job: run one command on every node of the gang (optionally under torchrun)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from a4ray.spec.fields import MAX_GPUS_PER_NODE, Arg, EnvVars, Integer, Spec
from a4ray.spec.job import JobSpec, job_kind


class CommandSpec(Spec):
    """The command every node runs."""

    argv: list[Arg] = Field(min_length=1, description="the command; with torchrun: the script/-m module and its args")
    torchrun: bool = Field(False, description="launch argv under torchrun (one process per GPU)")
    nproc: Integer | None = Field(None, gt=0, le=MAX_GPUS_PER_NODE, description="torchrun processes per node (default: GPUs per node)")
    env: EnvVars = Field(default_factory=dict, description="extra environment of the command")


@job_kind
class CommandJob(JobSpec):
    """One command on every node of the gang (optionally under torchrun)."""

    kind: Literal["command"] = "command"
    command: CommandSpec
