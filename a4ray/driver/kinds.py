"""Every job kind and the job that runs it: the one place a spec's `kind:` is dispatched.

A job is what the driver runs for a spec: `check()` refuses what would fail later, `plan()` says what
running it would do (nothing runs, no cluster), `run(conn, run_dir)` does it on the connected cluster and
returns its typed result. Gang workloads, a recipe's pipeline, staging and conversion are all jobs.
Importing this module also defines every job's result class, so `result.json` of any kind reads back typed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Protocol

from pydantic import BaseModel

from a4ray.core.errors import SpecError
from a4ray.core.results import Result
from a4ray.core.rundir import RunDir
from a4ray.hf2mcore.converter import ConvertWorkload
from a4ray.pipeline.runner import Pipeline
from a4ray.runtime.connect import Connection
from a4ray.spec.job import JobSpec
from a4ray.spec.recipes import RECIPE_KINDS
from a4ray.staging.stager import Staging
from a4ray.workloads.ddp_check import DDPTest
from a4ray.workloads.generic import Command
from a4ray.workloads.internode import DeepEPTest
from a4ray.workloads.network_test import NcclTest


class Job(Protocol):
    spec: JobSpec
    cancel_note: ClassVar[str]  # what a cancelled run of it keeps (said after "cancelled")

    def check(self) -> None: ...

    def plan(self, workspace: str | None = None) -> BaseModel | str: ...

    def run(self, conn: Connection, run_dir: RunDir) -> Result: ...


JOBS: dict[str, Callable[[JobSpec], Job]] = {
    "command": Command, "ddp_test": DDPTest, "nccl_test": NcclTest, "deepep_test": DeepEPTest,
    "convert": ConvertWorkload, "stage": Staging,
    **{kind: Pipeline for kind in RECIPE_KINDS},
}


def job_for(spec: JobSpec) -> Job:
    """The job that runs `spec`, by its kind."""
    make = JOBS.get(spec.kind)
    if make is not None:
        return make(spec)
    if spec.kind == "cluster":
        name = Path(spec.source).name if spec.source.endswith((".yaml", ".yml")) else "<file>"
        raise SpecError(spec.source, ["kind: cluster: this file describes a cluster, not a job"],
                        hint=f"`a4ray up -f {spec.source}` creates it on GKE; run a job spec (e.g. jobs/ddp_test.yaml) "
                        f"on it, not {name}")
    raise SpecError(spec.source, [f"kind: no job runs {spec.kind!r} (jobs: {', '.join(sorted(JOBS))})"])
