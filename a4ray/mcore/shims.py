"""megatron-core on a CPU-only torch, without Transformer Engine or apex: for verification only.

Verification builds a real megatron-core `GPTModel` (local layer spec) and loads the written checkpoint
into it. megatron-core's forward reaches for CUDA in a few places even when every tensor is on the CPU;
each shim below answers one of them (../shared/research/workloads.md section 3.2):

* RoPE, the attention scratch buffer and the 0.19 router move tensors to `torch.cuda.current_device()`:
  pointed at the CPU.
* attention dropout forks the CUDA RNG tracker: the inference tracker makes `fork()` a no-op.
* mcore 0.16.x names `te_general_gemm` in the MoE router without importing it when TE is absent.
* the alltoall token dispatcher creates a CUDA stream: the model uses the allgather dispatcher.
* the default causal mask is built on "cuda": callers pass `causal_mask(seq_len)`.

Qwen3-Next is megatron-core's hybrid GPTModel, whose block spec exists for Transformer Engine only and whose
GatedDeltaNet refuses to build without FLA (flash-linear-attention, Triton GPU kernels): `gpt_model` builds
it as megatron-core does, and where that fails `why_not_here` says why in one line.

`init()` patches process-wide, so it runs in a process of its own (a Ray task with `max_calls=1`).
Conversion itself never imports megatron-core.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from a4ray.hf2mcore.mapping import Architecture, Naming
from a4ray.core.errors import ConvertError


def init(store_dir: str | None = None) -> None:
    """A one-rank gloo process group and megatron-core's parallel state, with the CPU shims applied."""
    import torch.distributed as dist

    try:
        import megatron.core  # noqa: F401 - present?
    except ImportError as error:
        raise ConvertError(f"verification needs megatron-core and transformers on the nodes ({error})",
                           hint="install a4ray[convert] in the image, or set convert.verify.enabled=false") from None

    torch.cuda.current_device = lambda: "cpu"
    if not dist.is_initialized():
        store_dir = store_dir or tempfile.mkdtemp(prefix="a4ray-mcore-")
        store = dist.FileStore(str(Path(store_dir) / "store"), 1)
        dist.init_process_group("gloo", store=store, world_size=1, rank=0)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def model_naming(arch: Architecture) -> Naming:
    """The naming of the model `gpt_model` builds: the local spec, or TE where mcore has no other."""
    return "te" if arch.hybrid else "local"


def gpt_model(arch: Architecture):
    """The mcore GPTModel (fp32) equivalent to the HF model `arch` describes: local spec; Qwen3-Next with
    megatron-core's experimental-attention-variant block spec (Transformer Engine)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    moe = dict(num_moe_experts=arch.experts, moe_router_topk=arch.topk, moe_ffn_hidden_size=arch.moe_ffn,
               moe_router_score_function="softmax",
               # HF norm_topk_prob=True renormalises the top-k softmax = mcore's softmax over the top-k logits.
               moe_router_pre_softmax=not arch.norm_topk_prob, moe_grouped_gemm=arch.hybrid,
               moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0) if arch.moe else {}
    # Qwen3-Next as Megatron-Bridge's provider configures it: zero-centred norms, gated attention, a gated
    # shared expert, DeltaNet layers with a full-attention layer every linear_attention_freq.
    hybrid = dict(
        transformer_impl="transformer_engine", layernorm_zero_centered_gamma=True, attention_output_gate=True,
        moe_shared_expert_intermediate_size=arch.shared_ffn, moe_shared_expert_gate=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=arch.linear_attention_freq,
        linear_conv_kernel_dim=arch.conv_kernel, linear_key_head_dim=arch.linear_key_dim,
        linear_value_head_dim=arch.linear_value_dim, linear_num_key_heads=arch.linear_key_heads,
        linear_num_value_heads=arch.linear_value_heads) if arch.hybrid else {}
    config = TransformerConfig(
        num_layers=arch.layers, hidden_size=arch.hidden, num_attention_heads=arch.heads,
        num_query_groups=arch.groups, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn or arch.moe_ffn,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, bias_dropout_fusion=False, **moe, **hybrid,
    )
    if arch.hybrid:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        spec = get_transformer_block_with_experimental_attention_variant_spec(config)
    else:
        spec = get_gpt_layer_local_spec(num_experts=arch.experts or None, moe_grouped_gemm=False, qk_layernorm=True,
                                        normalization="RMSNorm")
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=arch.vocab,
                    max_sequence_length=arch.max_positions, position_embedding_type="rope",
                    rotary_percent=arch.rotary_fraction, rotary_base=int(arch.rope_theta),
                    share_embeddings_and_output_weights=arch.tied).eval()


# What megatron-core's Qwen3-Next needs besides itself: (what, importable module).
_HYBRID_NEEDS = (("Transformer Engine (its hybrid block spec is TE-only)", "transformer_engine"),
                 ("FLA (GatedDeltaNet's Triton kernels)", "fla"))


def why_not_here(arch: Architecture, error: BaseException) -> str:
    """One line: why megatron-core's model of `arch` could not be built or run here (`error` says how it failed)."""
    import importlib.util

    import megatron.core

    missing = [what for what, module in _HYBRID_NEEDS if importlib.util.find_spec(module) is None]
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (f"megatron-core {megatron.core.__version__} cannot run {arch.family} on this CPU-only verifier"
            + (f" (not installed: {', '.join(missing)})" if missing else "")
            + f": {type(error).__name__}: {(lines[-1] if lines else '')[:200]}")


def causal_mask(seq_len: int) -> torch.Tensor:
    """mcore's attention mask convention: True where attention is not allowed."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), diagonal=1)
