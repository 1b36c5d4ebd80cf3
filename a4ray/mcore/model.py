"""The one place a4ray builds megatron-core's `GPTModel` from a Hugging Face config: for the Megatron
trainer (`training.py`) and for the conversion's verifier (`a4ray.hf2mcore.verify`).

`transformer_config` maps an `Architecture` (read from config.json) onto mcore's `TransformerConfig`;
`gpt_model` builds the model with mcore's own layer specs, whose parameter names are the ones the native
converter writes (`naming`, `a4ray.mcore.names`):

* "local": `get_gpt_decoder_block_spec(use_transformer_engine=False)`, experts as SequentialMLP; runs
  anywhere, the CPU included.
* "te": the Transformer Engine spec, experts as TEGroupedMLP (`moe_grouped_gemm`), where TE imports.
  A4 images have it; `default_naming()` picks it wherever it imports.

Qwen3 and Qwen3-MoE: GQA, QK-norm, RoPE, SwiGLU, routed experts with a softmax top-k router (and its
load-balancing loss when training). Qwen3-Next is mcore's hybrid block (`experimental_attention_variant=
"gated_delta_net"`, `linear_attention_freq`): gated DeltaNet and gated attention layers, zero-centred
norms, partial RoPE, a gated shared expert. With Transformer Engine it is megatron-core's own hybrid block
spec; without, the same block on megatron-core's local layers (`a4ray.mcore.hybrid`), with the same
parameter names. Its gated delta rule runs on FLA's kernel or megatron-core's torch reference, whichever is
right here (`hybrid.delta_rule_path`, named in the trainer's log).

Dtype: bf16 on GPUs (params in bf16 inside mcore's Float16Module, fp32 main params in the optimizer, as
Megatron-LM does), fp32 on the CPU. megatron-core is imported inside the functions: importing this module
costs nothing until a model is built (the driver imports the verifier, which imports this).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from a4ray.core.errors import UnsupportedModel
from a4ray.mcore import shims
from a4ray.mcore.architecture import Architecture, Naming
from a4ray.mcore.hybrid import delta_rule_path, local_block_spec

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

@dataclasses.dataclass(frozen=True)
class Parallel:
    """Model-parallel sizes (data parallelism is what is left of the world)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallelism (None: = tp, mcore's default)
    sequence_parallel: bool = False


def have_te() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def default_naming() -> Naming:
    """Transformer Engine's layers where TE imports, else mcore's local ones (Qwen3-Next's too)."""
    return "te" if have_te() else "local"


def _dtype(dtype: torch.dtype | None) -> torch.dtype:
    return torch.float32 if shims.needed() else dtype or torch.bfloat16


def transformer_config(arch: Architecture, *, training: bool = False, parallel: Parallel = Parallel(),
                       naming: Naming | None = None, dtype: torch.dtype | None = None,
                       aux_loss_coeff: float = 1e-3, kernel: Literal["fla", "torch"] | None = None) -> TransformerConfig:
    """mcore's TransformerConfig for `arch`. `training`: the router's load-balancing (aux) loss with
    `aux_loss_coeff` (HF `router_aux_loss_coef`); otherwise none, as for a logits comparison. `kernel`:
    Qwen3-Next's gated delta rule (default: `delta_rule_path`'s choice for `training`)."""
    from megatron.core.transformer import TransformerConfig

    naming = naming or default_naming()
    dtype = _dtype(dtype)
    moe = {}
    if arch.moe:
        moe = dict(
            num_moe_experts=arch.experts, moe_router_topk=arch.topk, moe_ffn_hidden_size=arch.moe_ffn,
            moe_router_score_function="softmax",
            # HF norm_topk_prob=True renormalises the top-k softmax = mcore's softmax over the top-k logits.
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_grouped_gemm=naming == "te",  # TEGroupedMLP (te naming) vs SequentialMLP (local naming)
            moe_token_dispatcher_type=shims.moe_dispatcher(),
            moe_router_load_balancing_type="aux_loss" if training else "none",
            moe_aux_loss_coeff=aux_loss_coeff if training else 0.0,
            moe_router_dtype="fp32",
        )
    hybrid = arch.hybrid_settings()
    if arch.hybrid:  # megatron-core's deterministic_mode runs its torch reference of the gated delta rule
        hybrid["deterministic_mode"] = (kernel or delta_rule_path(training).kernel) == "torch"
    settings = dict(
        num_layers=arch.layers, hidden_size=arch.hidden, num_attention_heads=arch.heads,
        num_query_groups=arch.groups, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn or arch.moe_ffn,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, pipeline_dtype=dtype,
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp, expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp, sequence_parallel=parallel.sequence_parallel,
        transformer_impl="transformer_engine" if naming == "te" else "local",
        **moe, **hybrid,
    )
    settings.update(shims.model_overrides())
    return TransformerConfig(**settings)


def block_spec(config: TransformerConfig, arch: Architecture, naming: Naming):
    """mcore's decoder block spec for `naming` (and Qwen3-Next's hybrid block)."""
    if naming == "te" and not have_te():
        raise UnsupportedModel("the te layer spec needs Transformer Engine, which does not import here",
                               hint="use the local layers (train.megatron.layers=local; either naming loads)")
    if arch.hybrid:
        if naming == "local":
            return local_block_spec(config)
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        return get_transformer_block_with_experimental_attention_variant_spec(config)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=naming == "te", normalization="RMSNorm")


def gpt_model(arch: Architecture, *, training: bool = False, parallel: Parallel = Parallel(),
              naming: Naming | None = None, dtype: torch.dtype | None = None, aux_loss_coeff: float = 1e-3,
              kernel: Literal["fla", "torch"] | None = None):
    """The megatron-core GPTModel equivalent to the HF model `arch` describes: this rank's part of it
    (pipeline stage, expert shard) once parallel_state is initialised. `training=False`: eval mode."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    naming = naming or default_naming()
    if arch.rope_type != "default":
        raise UnsupportedModel(f"rope_type {arch.rope_type!r} is not modelled (only the default RoPE is)")
    config = transformer_config(arch, training=training, parallel=parallel, naming=naming, dtype=dtype,
                                aux_loss_coeff=aux_loss_coeff, kernel=kernel)
    model = GPTModel(config=config, transformer_layer_spec=block_spec(config, arch, naming), vocab_size=arch.vocab,
                     max_sequence_length=arch.max_positions,
                     pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=None),
                     post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=None),
                     position_embedding_type="rope", rotary_percent=arch.rotary_fraction,
                     rotary_base=int(arch.rope_theta), share_embeddings_and_output_weights=arch.tied,
                     vp_stage=None)
    return model if training else model.eval()


def init_standalone() -> None:
    """megatron-core in this one process, outside a training job (the conversion's verifier): the CPU
    shims, a gloo world of one, parallel state (all sizes 1) and RNG seeds."""
    from megatron.core import parallel_state, tensor_parallel

    shims.apply()
    if not dist.is_initialized():  # a world of one needs no rendezvous: an in-memory store (a file's was left in /tmp)
        dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)


def wrap_float16(model, config):
    """bf16 / fp16 training: mcore's Float16Module casts inputs and outputs as Megatron-LM does."""
    if not (config.bf16 or config.fp16):
        return model
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, model)
