#!/usr/bin/env bash
# DeepEP over NVSHMEM IBGDA on A4 (8 GPUs, 8 CX-7 NICs mlx5_0..7, RoCEv2): source before DeepEP runs.
export NVSHMEM_HOME=/opt/deepep/nvshmem
export CUDA_HOME=/usr/local/cuda
export LD_LIBRARY_PATH="${NVSHMEM_HOME}/lib:${CUDA_HOME}/lib64${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
# This NVSHMEM, not the copy bundled with PyTorch.
export LD_PRELOAD="${NVSHMEM_HOME}/lib/libnvshmem_host.so.3"
export NVSHMEM_REMOTE_TRANSPORT=ibgda
export NVSHMEM_IB_ENABLE_IBGDA=1
export NVSHMEM_IBGDA_NIC_HANDLER=gpu      # the GPU rings the NIC doorbell: no GDRCopy needed
export NVSHMEM_HCA_PREFIX=mlx5
export NVSHMEM_IB_GID_INDEX=3             # RoCEv2 IPv4-mapped GID
export NVSHMEM_DISABLE_CUDA_VMM=1
export NVSHMEM_ENABLE_NIC_PE_MAPPING=1
export DEEP_EP_DEVICE_TO_HCA_MAPPING=0:mlx5_0:1,1:mlx5_1:1,2:mlx5_2:1,3:mlx5_3:1,4:mlx5_4:1,5:mlx5_5:1,6:mlx5_6:1,7:mlx5_7:1
export PYTHONPATH="/opt/deepep/DeepEP${PYTHONPATH:+:${PYTHONPATH}}"
