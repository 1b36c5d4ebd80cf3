"""How a job's MPI launches run (nccl-tests, DeepEP through mpirun): shared by the specs that use MPI."""

from __future__ import annotations

from pydantic import Field

from a4ray.spec.fields import Spec


class MpiSpec(Spec):
    """mpirun on node 0; the other nodes' daemons start through a4ray's Ray rsh agent (no SSH)."""

    mpirun: str = Field("mpirun", description="mpirun on node 0 (a name on PATH or an absolute path)")
    extra_args: list[str] = Field(
        default_factory=list,
        description="appended to mpirun's own options, e.g. ['--mca', 'oob_tcp_if_include', 'eth0']",
    )
