# a4ray + Pai-Megatron-Patch (Qwen3, Qwen3-Next on Megatron-Core) for GKE A4, built on the a4ray base image.
# Pai-Megatron-Patch is pinned to one commit and never patched in place: a4ray passes the run's
# settings (layers, batch sizes, ...) as arguments, so the checkout stays what upstream tested.
ARG BASE_IMAGE=a4ray:25.12-ray2.60.0
FROM ${BASE_IMAGE}

ARG PAI_MEGATRON_PATCH_COMMIT=a098ca5acbdeaf7172ce0393fa309b39a77506db
# The Megatron-LM submodules the Qwen3 (250624) and Qwen3-Next (250908) examples put on PYTHONPATH;
# the other seven backends (older Megatron-LM copies, verl, ChatLearn) are not fetched.
ARG PAI_SUBMODULES="backends/megatron/Megatron-LM-250624 backends/megatron/Megatron-LM-250908"

RUN git clone https://github.com/alibaba/Pai-Megatron-Patch.git /opt/Pai-Megatron-Patch \
 && cd /opt/Pai-Megatron-Patch \
 && git checkout --detach "${PAI_MEGATRON_PATCH_COMMIT}" \
 && git submodule update --init --recursive ${PAI_SUBMODULES} \
 && git status --porcelain | (! grep -q .)

# Pai-Megatron-Patch still calls numpy.product (removed in NumPy 2), and its HF tooling predates
# huggingface_hub 1.0. Kernels for Qwen3-Next's gated DeltaNet / Mamba layers are built against the
# image's torch; a failed build fails the image (no `|| true`).
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/keep-ngc-torch.txt \
 && pip install --no-cache-dir -c /tmp/keep-ngc-torch.txt \
      "numpy==1.26.4" "huggingface-hub==0.36.0" "transformers==4.57.3" "datasets==3.6.0" \
 && pip install --no-cache-dir --no-build-isolation -c /tmp/keep-ngc-torch.txt \
      "causal-conv1d==1.5.2" "mamba-ssm==2.2.6.post3" "flash-linear-attention==0.4.0" \
 && python -c "import numpy, mamba_ssm, causal_conv1d, fla; assert numpy.__version__ == '1.26.4'"

ENV PAI_MEGATRON_PATCH=/opt/Pai-Megatron-Patch \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    NVTE_ALLOW_NONDETERMINISTIC_ALGO=1
