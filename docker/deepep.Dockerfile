# a4ray + NVSHMEM (IBGDA) + DeepEP for GKE A4, built on the a4ray base image (as the seed's G3 image
# built them on NeMo 25.11): GPU-initiated RDMA over the 8 CX-7 NICs, no GDRCopy.
ARG BASE_IMAGE=a4ray:25.12-ray2.60.0
FROM ${BASE_IMAGE}

ARG NVSHMEM_VERSION=v3.5.19-1
# deepseek-ai/DeepEP PR #466 ("Allow NVSHMEM PE to NIC mapping to be initialized by DeepEP rank") at its head
# commit 8a07e7e ("If CUDA_VISIBLE_DEVICES is set, map cuda.current_device()"): maps each GPU to its NIC
# through DEEP_EP_DEVICE_TO_HCA_MAPPING.
ARG DEEPEP_COMMIT=8a07e7e7ed57cfc63005f670d64d410cb30b061b

RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake ninja-build libibverbs-dev rdma-core \
 && rm -rf /var/lib/apt/lists/* \
 && ln -sf /usr/lib/x86_64-linux-gnu/libmlx5.so.1 /usr/lib/x86_64-linux-gnu/libmlx5.so

# NVSHMEM with IBGDA for sm_100, without MPI/SHMEM bootstrap (DeepEP bootstraps through torch).
ENV CUDA_HOME=/usr/local/cuda NVSHMEM_HOME=/opt/deepep/nvshmem
RUN git clone --branch "${NVSHMEM_VERSION}" --depth 1 https://github.com/NVIDIA/nvshmem.git /tmp/nvshmem \
 && cmake -S /tmp/nvshmem -B /tmp/nvshmem/build -G Ninja \
      -DCMAKE_INSTALL_PREFIX="${NVSHMEM_HOME}" -DCMAKE_CUDA_ARCHITECTURES=100 \
      -DNVSHMEM_IBGDA_SUPPORT=ON -DNVSHMEM_MPI_SUPPORT=OFF -DNVSHMEM_SHMEM_SUPPORT=OFF \
      -DNVSHMEM_BUILD_TESTS=OFF -DNVSHMEM_BUILD_EXAMPLES=OFF \
 && cmake --build /tmp/nvshmem/build -j "$(nproc)" \
 && cmake --install /tmp/nvshmem/build \
 && rm -rf /tmp/nvshmem

# g++ compiles DeepEP's .cpp files, which include NVSHMEM headers that need CCCL's cuda/std headers.
ENV CPLUS_INCLUDE_PATH=/usr/local/cuda/targets/x86_64-linux/include/cccl
RUN git clone https://github.com/deepseek-ai/DeepEP.git /opt/deepep/DeepEP \
 && cd /opt/deepep/DeepEP \
 && git fetch origin pull/466/head \
 && git checkout --detach "${DEEPEP_COMMIT}" \
 && TORCH_CUDA_ARCH_LIST=10.0 NVSHMEM_DIR="${NVSHMEM_HOME}" python setup.py build_ext --inplace

# The DeepEP/NVSHMEM runtime settings for A4 (the seed testbed's /opt/deepep/unified-env.sh, tests/fixtures/seeds/003), for a4ray.deepep_test to source.
COPY docker/deepep-env.sh /opt/deepep/unified-env.sh
ENV PYTHONPATH=/opt/deepep/DeepEP
