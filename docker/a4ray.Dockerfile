# a4ray base image for GKE A4 (a4-highgpu-8g, 8x B200): NVIDIA's PyTorch NGC image with Ray, a4ray,
# its pod launcher, nccl-tests built with MPI, and py-spy. No sshd and no SSH keys: a4ray launches
# every process through Ray. The gIB NCCL plugin is not baked in: the pod gets it at /usr/local/gib
# (KubeRay manifests from `a4ray render`), so its version follows the cluster, not the image.
#
# Build from the repository root (the a4ray source is the build context): see docker/README.md.
FROM nvcr.io/nvidia/pytorch:25.12-py3

ARG RAY_VERSION=2.60.0
ARG NCCL_TESTS_VERSION=v2.17.6
ARG NCCL_TESTS_COMMIT=da0b547b1b9c6e3b1d4c15578087874522ae3761
ARG PY_SPY_VERSION=0.4.1

# curl: the launcher reads the node's topology from the metadata server; libibverbs/ibverbs-utils:
# the gIB plugin's verbs library and `ibv_devinfo` for checking the RDMA NICs.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl iproute2 pciutils numactl \
      libibverbs1 ibverbs-utils \
 && rm -rf /var/lib/apt/lists/*

# nccl-tests against the image's NCCL and OpenMPI (HPC-X, /usr/local/mpi); sm_100 is B200.
RUN git clone --branch "${NCCL_TESTS_VERSION}" --depth 1 https://github.com/NVIDIA/nccl-tests.git /opt/nccl-tests \
 && test "$(git -C /opt/nccl-tests rev-parse HEAD)" = "${NCCL_TESTS_COMMIT}" \
 && make -C /opt/nccl-tests -j "$(nproc)" MPI=1 MPI_HOME=/usr/local/mpi CUDA_HOME=/usr/local/cuda NCCL_HOME=/usr \
      NVCC_GENCODE="-gencode=arch=compute_100,code=sm_100" \
 && /opt/nccl-tests/build/all_reduce_perf --help >/dev/null
ENV PATH=/opt/nccl-tests/build:${PATH}

# Ray and a4ray. The image's own torch is kept: pip may not replace it while resolving a4ray's deps.
COPY pyproject.toml README.md /opt/a4ray/
COPY a4ray /opt/a4ray/a4ray
COPY launchers /opt/a4ray/launchers
COPY jobs /opt/a4ray/jobs
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /opt/a4ray/keep-ngc-torch.txt \
 && pip install --no-cache-dir -c /opt/a4ray/keep-ngc-torch.txt \
      "ray[default]==${RAY_VERSION}" "py-spy==${PY_SPY_VERSION}" /opt/a4ray \
 && python -c "import ray, a4ray.cli; assert ray.__version__ == '${RAY_VERSION}', ray.__version__" \
 && chmod +x /opt/a4ray/launchers/*.sh

# gIB's libraries come first wherever the pod mounts them (the launcher does the same at start).
ENV LD_LIBRARY_PATH=/usr/local/gib/lib64:${LD_LIBRARY_PATH} \
    PYTHONUNBUFFERED=1
WORKDIR /opt/a4ray
