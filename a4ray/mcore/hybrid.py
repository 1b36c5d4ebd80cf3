"""Qwen3-Next's hybrid block on megatron-core's local layers, and which gated-delta-rule kernel it runs.

megatron-core builds Qwen3-Next (`experimental_attention_variant="gated_delta_net"`) only through
`get_transformer_block_with_experimental_attention_variant_spec`, which asserts
`transformer_impl == "transformer_engine"`, and whose plain-attention layers always take the TE layer spec.
Its pieces take any backend, though. `local_block_spec` builds the same block from them on
`HybridLocalBackend`, megatron-core's `LocalSpecProvider` with the two things Qwen3-Next needs that it
lacks:

* `NormColumnParallelLinear`: an RMSNorm fused into a `ColumnParallelLinear` (what TE's
  `TELayerNormColumnParallelLinear` is), its scale the parameter `layer_norm_weight` as TE names it: the
  DeltaNet's `in_proj` and the attention's `linear_qkv` carry their layer's input norm.
* `RMSNorm`: the norm with `layernorm_zero_centered_gamma` (scale 1 + w, as Qwen3-Next's), which
  megatron-core's torch norm refuses.

Every parameter then has the TE spec's name and shape (`a4ray.mcore.names`), so one converted checkpoint
loads into either; the one difference is the experts' module (SequentialMLP, as every local spec, instead
of TEGroupedMLP), whose torch_dist keys are the same. Where Transformer Engine imports, megatron-core's own
TE spec is used unchanged (`model.block_spec`).

The gated delta rule: FLA's Triton kernel (what `GatedDeltaNet` imports) or megatron-core's own torch
reference, `torch_chunk_gated_delta_rule` with a plain conv1d, which its `deterministic_mode` selects.
`delta_rule_path` chooses, and says why: the reference on CPUs and wherever FLA is missing (the two things
GatedDeltaNet still takes from FLA then, its import gate and `l2norm`, are answered in `shims.py`), and for
training on Hopper GPUs with a Triton on which FLA computes its backward wrongly (below).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch.nn import Parameter

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

# fla-core 0.6.0's `chunk_bwd_dqkwg` (fla/ops/common/chunk_o.py, the gated DeltaNet backward) raises on
# Hopper with Triton >= 3.4.0 and < 3.7.1: "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect
# results for gated chunk_bwd_dqkwg (see #640)", unless its tilelang backend takes the call
# (fla/ops/common/backends/tilelang, enabled on Hopper with Triton >= 3.4 where tilelang imports). Its
# forward is right there.
BAD_TRITON_ON_HOPPER = ((3, 4, 0), (3, 7, 1))


# ------------------------------------------------------------------------------------- kernels


@dataclass(frozen=True)
class DeltaRulePath:
    """Which gated-delta-rule kernel the model runs, and why."""

    kernel: Literal["fla", "torch"]
    why: str

    @property
    def reference(self) -> bool:
        """megatron-core's torch reference (its `deterministic_mode`)."""
        return self.kernel == "torch"

    def describe(self) -> str:
        what = ("megatron-core's torch reference (torch_chunk_gated_delta_rule)" if self.reference else
                "FLA's Triton kernel (chunk_gated_delta_rule)")
        return f"gated delta rule: {what}: {self.why}"


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def fla_trains_wrongly() -> str | None:
    """Why FLA's gated DeltaNet backward is wrong on this GPU (None: it is right, or not asked about)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return None  # Hopper only (the A4's B200s are capability 10)
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None
    low, high = BAD_TRITON_ON_HOPPER
    if not low <= _version(triton) < high or importlib.util.find_spec("tilelang") is not None:
        return None
    return (f"FLA computes the gated DeltaNet backward wrongly on Hopper ({torch.cuda.get_device_name()}) with "
            f"Triton {triton} (>= {'.'.join(map(str, low))}, < {'.'.join(map(str, high))}, FLA issue #640) and "
            "no tilelang; its forward is right")


def delta_rule_path(training: bool) -> DeltaRulePath:
    """FLA's kernel where it is installed and right for what is asked (forward only, or training); else
    megatron-core's torch reference."""
    if not torch.cuda.is_available():
        return DeltaRulePath("torch", "no GPU (FLA's kernels are Triton GPU kernels)")
    if importlib.util.find_spec("fla") is None:
        return DeltaRulePath("torch", "FLA (flash-linear-attention) is not installed")
    wrong = fla_trains_wrongly() if training else None
    if wrong:
        return DeltaRulePath("torch", wrong)
    return DeltaRulePath("fla", "installed, and right on this GPU" + (" for training" if training else ""))


# -------------------------------------------------------------------------------------- layers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """RMSNorm in fp32 (as Qwen3-Next's), scale w or (zero-centred) 1 + w, back in x's dtype."""
    scale = weight.float() + 1.0 if zero_centred else weight.float()
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * scale).to(x.dtype)


def _norm_weight(config: TransformerConfig, size: int) -> Parameter:
    """A norm's scale at its neutral value: 0 zero-centred (scale 1 + w), else 1."""
    device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
    init = torch.zeros if config.layernorm_zero_centered_gamma else torch.ones
    weight = Parameter(init(size, dtype=config.params_dtype, device=device))
    # mcore all-reduces the grads of sequence-parallel norms across TP ranks by this attribute.
    setattr(weight, "sequence_parallel", config.sequence_parallel)
    return weight


class RMSNorm(torch.nn.Module):
    """megatron-core's norm interface (`config, hidden_size, eps`), with `layernorm_zero_centered_gamma`."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps, self.zero_centred = eps, config.layernorm_zero_centered_gamma
        self.weight = _norm_weight(config, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centred)


@functools.cache  # one class (megatron-core is imported when a model is built, not with this module)
def _column_parallel_linear():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class NormColumnParallelLinear(ColumnParallelLinear):
        """An RMSNorm, then a ColumnParallelLinear: TE's TELayerNormColumnParallelLinear with the norm's
        scale under TE's name, `layer_norm_weight` (replicated across TP ranks, as TE shards it)."""

        def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.eps, self.zero_centred = config.layernorm_epsilon, config.layernorm_zero_centered_gamma
            self.layer_norm_weight = _norm_weight(config, input_size)

        def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                    runtime_gather_output: bool | None = None):
            normed = rms_norm(input_, self.layer_norm_weight, self.eps, self.zero_centred)
            return super().forward(normed, weight, runtime_gather_output)

    return NormColumnParallelLinear


def _backend():
    from megatron.core.models.backends import LocalSpecProvider

    norm_linear = _column_parallel_linear()

    class HybridLocalBackend(LocalSpecProvider):
        """megatron-core's local layers, with a norm fused into the column-parallel input projections (so
        each layer's input norm is its projection's `layer_norm_weight`, as in the TE spec) and norms that
        honour `layernorm_zero_centered_gamma`."""

        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self):
            return norm_linear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
            return RMSNorm

    return HybridLocalBackend()


def local_block_spec(config: TransformerConfig):
    """Qwen3-Next's decoder block (this pipeline stage's layers) on megatron-core's local layers: the layer
    pattern, modules and parameter names of megatron-core's TE hybrid block spec."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec,
        get_linear_attention_pattern,
        get_moe_layer_pattern,
    )
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
        get_transformer_layer_offset,
    )

    backend = _backend()
    deltanet = get_gated_delta_net_module_spec(config=config, backend=backend)  # in_proj carries the norm
    attention = ModuleSpec(  # as the TE layer spec's: the input norm fused into linear_qkv
        module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=backend.column_parallel_layer_norm_linear(), core_attention=DotProductAttention,
            linear_proj=backend.row_parallel_linear(), q_layernorm=RMSNorm, k_layernorm=RMSNorm))
    moe = get_moe_module_spec_for_backend(backend=backend, num_experts=config.num_moe_experts,
                                          moe_grouped_gemm=False)
    linear = get_linear_attention_pattern(config=config)
    moe_layers = get_moe_layer_pattern(config=config)
    if 0 in moe_layers:
        raise ValueError("a4ray's local Qwen3-Next block has MoE layers only (as every Qwen3-Next layer is)")
    layers = [ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=IdentityOp, self_attention=deltanet if linear[i] else attention,
        self_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=RMSNorm, mlp=moe, mlp_bda=get_bias_dropout_add))
        for i in range(config.num_layers)]
    offset = get_transformer_layer_offset(config)
    layers = layers[offset:offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNorm)
