"""Spec of the DeepEP tests: DeepEP's own `tests/test_{intranode,low_latency,internode}.py`, one process per node."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from a4ray.spec.toolbuilds import BuildSpec, deepep_build
from a4ray.spec.fields import MAX_GPUS_PER_NODE, EnvVars, Integer, PathStr, PositiveFloat, PositiveInt, Spec

DeepEPTestName = Literal["intranode", "low_latency", "internode"]
from a4ray.spec.job import job_kind
from a4ray.spec.mpi import FabricTestJob


class DeepEPSpec(Spec):
    """Which of DeepEP's tests run, from where, with what, and the bandwidth each must reach."""

    launcher: Literal["mpi", "direct"] = Field(
        "mpi", description="mpi: mpirun on node 0, one rank per node (the seeds' way); direct: each node "
        "actor starts the test itself",
    )
    tests: list[DeepEPTestName] = Field(
        default_factory=lambda: ["internode"], description="which of DeepEP's tests, in this order: intranode and "
        "low_latency run on each node by itself (one node, its GPUs), internode across every node (2+ nodes)")
    deepep_dir: PathStr = Field("/opt/deepep/DeepEP", description="the image's DeepEP checkout, built (the test "
                                "imports its siblings); where a node lacks it, DeepEP is built (see build)")
    test_script: PathStr = Field("tests/test_internode.py", description="relative to deepep_dir (on DeepEP main "
                             "after EPv2: tests/legacy/test_internode.py)")
    intranode_script: PathStr = Field("tests/test_intranode.py", description="relative to deepep_dir")
    low_latency_script: PathStr = Field("tests/test_low_latency.py", description="relative to deepep_dir")
    build: BuildSpec = Field(default_factory=deepep_build, description="where a node lacks deepep_dir: build DeepEP "
                             "(8a07e7e, setup.py build_ext) on the nodes, once per toolchain")
    thresholds: dict[DeepEPTestName, dict[str, PositiveFloat]] = Field(
        default_factory=dict, description="minimum GB/s by test, then figure: intranode/internode 'dispatch BF16 "
        "NVL', 'dispatch FP8 NVL', 'combine NVL' (internode also '... RDMA'), low_latency 'dispatch', "
        "'combine', 'dispatch+combine' (at the slowest rank); {} for none")
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

    @field_validator("tests")
    @classmethod
    def _some_tests(cls, tests: list[str]) -> list[str]:
        if not tests or len(set(tests)) != len(tests):
            raise ValueError("name each of intranode, low_latency, internode at most once, and at least one")
        return tests

    @field_validator("deepep_dir", "env_script")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if path and not path.startswith("/"):
            raise ValueError("must be an absolute path on the nodes")
        return path


@job_kind
class DeepEPJob(FabricTestJob):
    """DeepEP's own tests across the gang: intranode, low-latency and internode expert-parallel dispatch and combine."""

    kind: Literal["deepep_test"] = "deepep_test"
    deepep: DeepEPSpec = DeepEPSpec()
