"""How a job builds the tools it runs (nccl-tests, DeepEP) from pinned sources where a node's image lacks them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator

from a4ray.spec.artifacts import parse_source
from a4ray.spec.fields import PathStr, PositiveInt, Spec

# The pinned sources the seeds run: nccl-tests v2.17.6, DeepEP 8a07e7e (refs/pull/466/head).
NCCL_TESTS_SOURCE = "git+https://github.com/NVIDIA/nccl-tests.git@da0b547b1b9c6e3b1d4c15578087874522ae3761"
DEEPEP_SOURCE = "git+https://github.com/deepseek-ai/DeepEP.git@8a07e7e7ed57cfc63005f670d64d410cb30b061b"
PINNED = {"nccl-tests": NCCL_TESTS_SOURCE, "deepep": DEEPEP_SOURCE}


def _arch_text(value: Any) -> Any:
    # YAML and --set read `9.0` as a number: a compute capability is text ("9.0", "10.0").
    return f"{value:.1f}" if isinstance(value, float) else value


class BuildSpec(Spec):
    """Where the image has the tool, it is used; else it is built once per toolchain from `source` (staged as
    a code artifact), as a Ray task on each node, into `<workspace>/builds/<tool>/<key>/`."""

    mode: Literal["auto", "always", "never"] = Field(
        "auto", description="auto: the image's where every node has it, else build; always: build even where the "
        "image has it; never: only the image's")
    source: str = Field("", description="a pinned git source (git+https://...@<40-hex commit>, or git+file:// "
                        "for a local mirror); empty: the tool's pinned upstream")
    cuda_home: PathStr = Field("/usr/local/cuda", description="CUDA toolkit on the nodes (nvcc in bin/)")
    nccl_home: PathStr = Field("", description="NCCL with include/nccl.h and lib/libnccl.so*; empty: the node "
                               "python's nvidia-nccl package, else /usr")
    nvshmem_dir: PathStr = Field("", description="DeepEP: NVSHMEM; empty: the node python's nvidia-nvshmem package")
    mpi_home: PathStr = Field("", description="nccl-tests: MPI with include/mpi.h; empty: found from mpicc, "
                              "else the usual OpenMPI places")
    gpu_arch: Annotated[str, BeforeValidator(_arch_text)] = Field(
        "", pattern=r"^(\d+\.\d+)?$", description="compute capability to build for, e.g. 9.0 "
                          "(H200) or 10.0 (B200); empty: the node's GPUs' (nvidia-smi)")
    jobs: PositiveInt = Field(16, le=1024, description="parallel compile jobs")
    timeout_s: PositiveInt = Field(3600, le=86400, description="limit of one build")

    @field_validator("source")
    @classmethod
    def _pinned_git(cls, source: str) -> str:
        if source and parse_source(source).scheme != "git":
            raise ValueError("must be a pinned git source: git+https://host/repo.git@<40-hex commit>")
        return source

    @field_validator("cuda_home", "nccl_home", "nvshmem_dir", "mpi_home")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if path and not path.startswith("/"):
            raise ValueError("must be an absolute path on the nodes")
        return path


def nccl_tests_build() -> BuildSpec:
    return BuildSpec(source=NCCL_TESTS_SOURCE)


def deepep_build() -> BuildSpec:
    return BuildSpec(source=DEEPEP_SOURCE)
