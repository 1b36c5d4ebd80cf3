"""What a build finds on a node: nvcc, the CCCL headers, NCCL, NVSHMEM, libibverbs, MPI, torch, the GPU arch.

`probe(spec)` runs on the node (in its Ray task) and records each piece with its version, or the one line
that says it is missing and where it was looked for. The versions go into the build's cache key.
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from a4ray.spec.toolbuilds import BuildSpec

PIECES = ("nvcc", "cccl", "nccl", "nvshmem", "ibverbs", "mpi", "torch", "ninja", "gpu_arch")
_RELEASE = re.compile(r"release (\d+)\.(\d+)")
_DEFINE = re.compile(r"^#define\s+(\w+)\s+(\d+)\s*$", re.MULTILINE)
# Where OpenMPI's headers and libraries are when no mpicc says: Debian/Ubuntu's package, HPC-X, NVIDIA images.
MPI_HOMES = ("/usr/lib/x86_64-linux-gnu/openmpi", "/usr/lib64/openmpi", "/opt/hpcx/ompi", "/usr/local/mpi",
             "/opt/amazon/openmpi", "/usr")


class Toolchain(BaseModel):
    host: str
    python: str
    cuda_home: str
    nvcc: str | None = None
    cuda_version: str | None = None
    cccl_include: str | None = None  # <cuda>/include/cccl where CUDA keeps CCCL apart (CUDA 13)
    nccl_home: str | None = None  # has include/nccl.h
    nccl_lib: str | None = None  # has libnccl.so*
    nccl_version: str | None = None
    nvshmem_dir: str | None = None  # has include/ and lib/ (setup.py's NVSHMEM_DIR)
    nvshmem_version: str | None = None
    ibverbs: str | None = None
    mpi_home: str | None = None
    mpi_version: str | None = None
    torch_version: str | None = None
    ninja: str | None = None
    gpu_arch: str | None = None  # compute capability, "9.0"
    problems: dict[str, str] = {}  # piece -> what is missing, in one line
    exists: dict[str, bool] = {}  # paths asked about (the image's prebuilt tools)

    def missing(self, needs: tuple[str, ...]) -> list[str]:
        return [self.problems[p] for p in needs if p in self.problems]

    @property
    def gencode(self) -> str:
        arch = (self.gpu_arch or "").replace(".", "")
        return f"-gencode=arch=compute_{arch},code=sm_{arch}"


def _run(argv: list[str], timeout: float = 60) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _package_dir(name: str) -> Path | None:
    """`nvidia/<name>` of an NVIDIA pip package, on this python's path (nvidia is a namespace package)."""
    for entry in sys.path:
        candidate = Path(entry or ".") / "nvidia" / name
        if (candidate / "include").is_dir() or (candidate / "lib").is_dir():
            return candidate
    return None


def _dist_version(prefix: str) -> str | None:
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(prefix):
            return f"{name} {dist.version}"
    return None


def _defines(header: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in _DEFINE.findall(header.read_text(errors="replace"))}
    except OSError:
        return {}


def _cuda(tc: Toolchain) -> None:
    nvcc = Path(tc.cuda_home) / "bin" / "nvcc"
    if not os.access(nvcc, os.X_OK):
        tc.problems["nvcc"] = (f"nvcc: not found at {nvcc} on {tc.host} (build.cuda_home={tc.cuda_home}): a CUDA "
                               "toolkit with nvcc is needed to build")
        return
    tc.nvcc = str(nvcc)
    m = _RELEASE.search(_run([str(nvcc), "--version"]) or "")
    if not m:
        tc.problems["nvcc"] = f"nvcc: {nvcc} --version does not say its CUDA release on {tc.host}"
        return
    tc.cuda_version = f"{m.group(1)}.{m.group(2)}"
    include = Path(tc.cuda_home) / "include"
    for where in (include / "cccl", include):
        if (where / "cuda" / "std" / "tuple").is_file():
            tc.cccl_include = str(where) if where != include else None
            return
    tc.problems["cccl"] = (f"the CCCL headers: cuda/std/tuple is in neither {include}/cccl nor {include} on "
                           f"{tc.host} (CUDA {tc.cuda_version}; install the toolkit's cuda-cccl component)")


def _nccl(tc: Toolchain, spec: BuildSpec) -> None:
    homes = [Path(spec.nccl_home)] if spec.nccl_home else [p for p in (_package_dir("nccl"), Path("/usr")) if p]
    for home in homes:
        header = home / "include" / "nccl.h"
        if not header.is_file():
            continue
        libs = [d for d in (home / "lib", home / "lib64", home / "lib" / "x86_64-linux-gnu") if d.is_dir()
                and any(d.glob("libnccl.so*"))]
        if not libs:
            continue
        d = _defines(header)
        tc.nccl_home, tc.nccl_lib = str(home), str(libs[0])
        tc.nccl_version = (f"{d['NCCL_MAJOR']}.{d['NCCL_MINOR']}.{d['NCCL_PATCH']}" if {"NCCL_MAJOR", "NCCL_MINOR",
                           "NCCL_PATCH"} <= d.keys() else _dist_version("nvidia-nccl") or "unknown")
        return
    where = spec.nccl_home or f"the nvidia-nccl package of {tc.python}, /usr"
    tc.problems["nccl"] = (f"the NCCL headers: no include/nccl.h with a libnccl.so* beside it in {where} on "
                           f"{tc.host} (set build.nccl_home)")


def _nvshmem(tc: Toolchain, spec: BuildSpec) -> None:
    home = Path(spec.nvshmem_dir) if spec.nvshmem_dir else _package_dir("nvshmem")
    if home is None or not (home / "include").is_dir() or not any((home / "lib").glob("libnvshmem_host.so*")):
        where = spec.nvshmem_dir or f"the nvidia-nvshmem package of {tc.python}"
        tc.problems["nvshmem"] = (f"NVSHMEM: no include/ and lib/libnvshmem_host.so* in {where} on {tc.host} "
                                  "(DeepEP's internode and low-latency kernels need it; pip install "
                                  "nvidia-nvshmem-cu13, or set build.nvshmem_dir)")
        return
    tc.nvshmem_dir = str(home)
    d = _defines(home / "include" / "non_abi" / "nvshmem_version.h") or _defines(home / "include" / "nvshmem_version.h")
    tc.nvshmem_version = (f"{d['NVSHMEM_VENDOR_MAJOR_VERSION']}.{d['NVSHMEM_VENDOR_MINOR_VERSION']}."
                          f"{d['NVSHMEM_VENDOR_PATCH_VERSION']}" if "NVSHMEM_VENDOR_PATCH_VERSION" in d
                          else _dist_version("nvidia-nvshmem") or "unknown")


def _mpi(tc: Toolchain, spec: BuildSpec) -> None:
    homes = [Path(spec.mpi_home)] if spec.mpi_home else []
    if not homes:
        shown = _run(["mpicc", "--showme:incdirs"]) if shutil.which("mpicc") else None
        homes += [Path(d).parent for d in (shown or "").split()]
        homes += [Path(h) for h in MPI_HOMES]
    for home in homes:
        header = home / "include" / "mpi.h"
        if header.is_file():
            d = _defines(header)
            tc.mpi_home = str(home)
            tc.mpi_version = (f"OpenMPI {d['OMPI_MAJOR_VERSION']}.{d['OMPI_MINOR_VERSION']}.{d['OMPI_RELEASE_VERSION']}"
                              if "OMPI_RELEASE_VERSION" in d else f"MPI {d.get('MPI_VERSION', '?')}")
            return
    where = spec.mpi_home or ", ".join(MPI_HOMES)
    tc.problems["mpi"] = (f"MPI: no include/mpi.h in {where} on {tc.host} (install OpenMPI's development files, "
                          "or set build.mpi_home)")


def _gpu_arch(tc: Toolchain, spec: BuildSpec) -> None:
    if spec.gpu_arch:
        tc.gpu_arch = spec.gpu_arch
        return
    shown = _run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]) if shutil.which("nvidia-smi") \
        else None
    caps = sorted({c.strip() for c in (shown or "").splitlines() if c.strip()})
    if len(caps) == 1:
        tc.gpu_arch = caps[0]
    else:
        why = "no nvidia-smi" if not shutil.which("nvidia-smi") else (
            f"GPUs of {len(caps)} kinds ({', '.join(caps)})" if caps else "nvidia-smi lists no GPU")
        tc.problems["gpu_arch"] = f"the GPU arch: {why} on {tc.host} (set build.gpu_arch, e.g. 10.0 for B200)"


def _ninja() -> str | None:
    found = shutil.which("ninja") or shutil.which("ninja", path=str(Path(sys.executable).parent))
    if found:
        return found
    spec = importlib.util.find_spec("ninja")  # the pip package keeps its binary in its own data directory
    if spec and spec.submodule_search_locations:
        for candidate in Path(spec.submodule_search_locations[0]).glob("data/bin/ninja"):
            return str(candidate)
    return None


def probe(spec: BuildSpec, paths: list[str] = ()) -> Toolchain:
    """Every piece, looked for on this node by this python."""
    tc = Toolchain(host=socket.gethostname(), python=sys.executable, cuda_home=spec.cuda_home)
    _cuda(tc)
    _nccl(tc, spec)
    _nvshmem(tc, spec)
    _mpi(tc, spec)
    _gpu_arch(tc, spec)
    library = ctypes.util.find_library("ibverbs")
    if library:
        tc.ibverbs = library
    else:
        tc.problems["ibverbs"] = (f"libibverbs: not found on {tc.host} (NVSHMEM's and NCCL's RDMA transports load "
                                  "it; install rdma-core's libibverbs1)")
    tc.ninja = _ninja()
    if not tc.ninja:
        tc.problems["ninja"] = (f"ninja: not on PATH nor beside {tc.python} on {tc.host} (torch's extension builder "
                                "needs it for DeepEP's device link; pip install ninja)")
    try:
        tc.torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        tc.problems["torch"] = f"torch: not installed for {tc.python} on {tc.host} (DeepEP builds against it)"
    tc.exists = {p: os.path.exists(p) for p in paths}
    return tc
