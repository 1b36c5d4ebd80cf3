"""How each tool is built from its staged source, what it needs, and what a finished build holds.

nccl-tests (`make MPI=1 ...`): NCCL's pip package ships only `libnccl.so.2`, so the build gets an NCCL_HOME
of its own, `include/` linked to the package's and `lib/libnccl.so` to its library. DeepEP (`setup.py
build_ext --inplace`): CUDA 13 keeps the CCCL headers in `include/cccl`, which torch's extension builder does
not add, so CPATH and NVCC_APPEND_FLAGS carry it; NVSHMEM comes from its pip package (setup.py finds it when
NVSHMEM_DIR is unset) or build.nvshmem_dir; the arch list is the node's GPUs'.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from a4ray.builds.toolchain import Toolchain
from a4ray.spec.toolbuilds import BuildSpec

RECIPE_VERSION = 1  # bump when a recipe's commands change what they build


@dataclass(frozen=True)
class Recipe:
    tool: str
    needs: tuple[str, ...]  # toolchain pieces (toolchain.PIECES) the build cannot do without
    outputs: tuple[str, ...]  # paths (globs) under the build directory a finished build has

    def key_facts(self, tc: Toolchain, commit: str) -> dict:
        """What the build's cache key is made of: the source commit and every version the output depends on."""
        facts = {"tool": self.tool, "recipe": RECIPE_VERSION, "commit": commit, "cuda": tc.cuda_version,
                 "gpu_arch": tc.gpu_arch}
        if self.tool == "nccl-tests":
            facts |= {"nccl": tc.nccl_version, "mpi": tc.mpi_version}
        else:
            facts |= {"nvshmem": tc.nvshmem_version, "torch": tc.torch_version, "python": tc.python}
        return facts

    def commands(self, tc: Toolchain, spec: BuildSpec, work: Path) -> tuple[list[list[str]], dict[str, str]]:
        """The commands (run in `work/src`, the copied source) and the env they run with."""
        env = {"PATH": f"{tc.cuda_home}/bin:{os.environ.get('PATH', '/usr/bin:/bin')}", "CUDA_HOME": tc.cuda_home}
        if self.tool == "nccl-tests":
            home = work / "nccl-home"
            make = ["make", f"-j{spec.jobs}", "MPI=1", f"MPI_HOME={tc.mpi_home}",
                    f"CUDA_HOME={tc.cuda_home}", f"NCCL_HOME={home}", f"NVCC_GENCODE={tc.gencode}"]
            return [["mkdir", "-p", f"{home}/lib"], ["ln", "-sfn", f"{tc.nccl_home}/include", f"{home}/include"],
                    ["ln", "-sf", nccl_library(tc), f"{home}/lib/libnccl.so"], make], env
        if tc.cccl_include:
            env["CPATH"] = ":".join(p for p in (tc.cccl_include, os.environ.get("CPATH")) if p)
            env["NVCC_APPEND_FLAGS"] = f"-I{tc.cccl_include}"
        if spec.nvshmem_dir:
            env["NVSHMEM_DIR"] = spec.nvshmem_dir
        if tc.ninja:  # torch's builder runs `ninja` by name
            env["PATH"] = f"{Path(tc.ninja).parent}:{env['PATH']}"
        env |= {"TORCH_CUDA_ARCH_LIST": tc.gpu_arch or "", "MAX_JOBS": str(spec.jobs)}
        return [[tc.python, "setup.py", "build_ext", "--inplace"]], env


def nccl_library(tc: Toolchain) -> str:
    libs = sorted(Path(tc.nccl_lib or "").glob("libnccl.so*"), key=lambda p: len(p.name))
    return str(libs[0]) if libs else f"{tc.nccl_lib}/libnccl.so.2"


NCCL_TESTS = Recipe("nccl-tests", needs=("nvcc", "nccl", "mpi", "gpu_arch"),
                    outputs=("src/build/all_reduce_perf", "src/build/all_gather_perf",
                             "src/build/reduce_scatter_perf", "src/build/alltoall_perf"))
# libibverbs: NVSHMEM's RDMA transports load it at run time; without it only NVLink works (one node).
DEEPEP = Recipe("deepep", needs=("nvcc", "cccl", "nvshmem", "torch", "ninja", "gpu_arch"),
                outputs=("src/deep_ep_cpp*.so",))
RECIPES = {r.tool: r for r in (NCCL_TESTS, DEEPEP)}
