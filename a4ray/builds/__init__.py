"""Builds of the tools a fabric test runs (nccl-tests, DeepEP) from pinned sources, on the nodes, cached.

    outcomes = ensure(gang, "nccl-tests", spec.nccl.build, workspace=..., log_dir=..., conn=...)  # Ray tasks per node

`toolchain` finds what a build needs on a node (nvcc, the CCCL headers, NCCL, NVSHMEM, libibverbs, MPI,
torch, ninja, the GPU arch) and names what is missing; `tools` says how each tool is built and what it
needs; `builder` stages the source once, then builds it on each node as a Ray task under a lock, once
per cache key (source commit, CUDA, NCCL/NVSHMEM, torch, MPI, GPU arch), into `<workspace>/builds/`.
"""
