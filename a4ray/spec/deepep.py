"""Spec of the DeepEP internode test: DeepEP's `tests/test_internode.py`, one process per node."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from a4ray.spec.fields import MAX_GPUS_PER_NODE, EnvVars, Integer, PathStr, PositiveInt, Spec
from a4ray.spec.job import job_kind
from a4ray.spec.mpi import FabricTestJob


class DeepEPSpec(Spec):
    launcher: Literal["mpi", "direct"] = Field(
        "mpi", description="mpi: mpirun on node 0, one rank per node (the seeds' way); direct: each node "
        "actor starts the test itself",
    )
    deepep_dir: PathStr = Field("/opt/deepep/DeepEP", description="the DeepEP checkout (the test imports its siblings)")
    test_script: PathStr = Field("tests/test_internode.py", description="relative to deepep_dir (on DeepEP main "
                             "after EPv2: tests/legacy/test_internode.py)")
    env_script: PathStr = Field("/opt/deepep/unified-env.sh", description="sourced on every node after gIB "
                            "(NVSHMEM, LD_PRELOAD, ...); empty: none")
    env: EnvVars = Field(default_factory=dict, description="DeepEP/NVSHMEM variables; win over env_script, "
                         "e.g. DEEP_EP_DEVICE_TO_HCA_MAPPING, NVSHMEM_IB_GID_INDEX, LD_PRELOAD")
    python: PathStr = Field("", description="python on the nodes; empty: the node actor's")
    num_processes: Integer | None = Field(None, gt=0, le=MAX_GPUS_PER_NODE, description="GPU processes the test spawns per node "
                                              "(default: cluster.gpus_per_node; upstream asserts 8)")
    num_tokens: PositiveInt = 4096
    hidden: PositiveInt = 7168
    num_topk: PositiveInt = 8
    num_experts: PositiveInt = Field(256, description="must divide evenly by nodes x processes per node")
    num_topk_groups: PositiveInt | None = Field(None, description="default (the test's): min(nodes, 4)")
    extra_args: list[str] = Field(default_factory=list, description="more test_internode.py flags")

    @field_validator("deepep_dir", "env_script")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if path and not path.startswith("/"):
            raise ValueError("must be an absolute path on the nodes")
        return path


@job_kind
class DeepEPJob(FabricTestJob):
    kind: Literal["deepep_test"] = "deepep_test"
    deepep: DeepEPSpec = DeepEPSpec()
