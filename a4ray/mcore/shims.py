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

`init()` patches process-wide, so it runs in a process of its own (a Ray task with `max_calls=1`).
Conversion itself never imports megatron-core.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from a4ray.convert.mapping import Architecture
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


def gpt_model(arch: Architecture):
    """The mcore GPTModel (local spec, fp32) equivalent to the HF model `arch` describes."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    moe = dict(num_moe_experts=arch.experts, moe_router_topk=arch.topk, moe_ffn_hidden_size=arch.moe_ffn,
               moe_router_score_function="softmax",
               # HF norm_topk_prob=True renormalises the top-k softmax = mcore's softmax over the top-k logits.
               moe_router_pre_softmax=not arch.norm_topk_prob, moe_grouped_gemm=False,
               moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0) if arch.moe else {}
    config = TransformerConfig(
        num_layers=arch.layers, hidden_size=arch.hidden, num_attention_heads=arch.heads,
        num_query_groups=arch.groups, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn or arch.moe_ffn,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, bias_dropout_fusion=False, **moe,
    )
    spec = get_gpt_layer_local_spec(num_experts=arch.experts or None, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=arch.vocab,
                    max_sequence_length=arch.max_positions, position_embedding_type="rope",
                    rotary_base=int(arch.rope_theta), share_embeddings_and_output_weights=arch.tied).eval()


def causal_mask(seq_len: int) -> torch.Tensor:
    """mcore's attention mask convention: True where attention is not allowed."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), diagonal=1)
