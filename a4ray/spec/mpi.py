"""How a job's MPI launches run (nccl-tests, DeepEP through mpirun): shared by the specs that use MPI."""

from __future__ import annotations

from pydantic import Field

from a4ray.spec.fields import PathStr, Seconds, Spec
from a4ray.spec.job import JobSpec


class MpiSpec(Spec):
    """mpirun on node 0; the other nodes' daemons start through a4ray's Ray rsh agent (no SSH)."""

    mpirun: PathStr = Field("mpirun", description="mpirun on node 0 (a name on PATH or an absolute path)")
    extra_args: list[str] = Field(
        default_factory=list,
        description="appended to mpirun's own options, e.g. ['--mca', 'oob_tcp_if_include', 'eth0']",
    )


class FabricTestJob(JobSpec):
    """A test of the fabric across the gang (NCCL, DeepEP): launched through MPI, bounded in time."""

    timeout_s: Seconds | None = Field(1800, description="per launch: a broken fabric often hangs NCCL")
    mpi: MpiSpec = MpiSpec()
