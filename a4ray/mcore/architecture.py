"""The shape of a Qwen3 / Qwen3-MoE / Qwen3-Next model, read from its Hugging Face config.json: what
megatron-core's GPTModel is built from (`model.py`) and what the HF -> mcore conversion maps
(`a4ray.hf2mcore.mapping`). `Naming` is which of megatron-core's layer specs names the parameters: its
Transformer Engine spec ("te") or its local one ("local").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from a4ray.core.errors import UnsupportedModel

Naming = Literal["te", "local"]

# HF `architectures[0]` -> the family the native backend converts.
NATIVE_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                        "Qwen3NextForCausalLM": "qwen3_next"}
# Qwen3-Next's layer kinds (HF `layer_types`).
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"

# The config.json of models the recipes stage, as published, for plans made before the model is staged
# (a dry run of the A4 defaults): the fields `Architecture.from_config` reads. Qwen/Qwen3-Next-80B-A3B-Instruct:
# its config.json on the Hub, and the A3B block of Pai-Megatron-Patch a098ca5's examples/qwen3_next/run_mcore_qwen3.sh.
PUBLISHED_CONFIGS = {
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {
        "architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 48, "hidden_size": 2048,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 5120,
        "vocab_size": 151936, "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000000,
        "partial_rotary_factor": 0.25, "max_position_embeddings": 262144, "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 512,
        "num_experts_per_tok": 10, "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "dtype": "bfloat16",
    },
}


@dataclass(frozen=True)
class Architecture:
    """The shape of a Qwen3 / Qwen3-MoE / Qwen3-Next model, read from its HF config.json."""

    family: Literal["qwen3", "qwen3_moe", "qwen3_next"]
    layers: int
    hidden: int
    heads: int
    groups: int  # query groups = key/value heads
    head_dim: int
    ffn: int  # dense MLP width (unused by MoE layers)
    vocab: int
    tied: bool
    norm_eps: float
    rope_theta: float
    rope_type: str
    max_positions: int
    dtype: str  # the config's dtype (the tensors' own dtype wins when they disagree)
    experts: int = 0
    moe_ffn: int = 0
    topk: int = 0
    norm_topk_prob: bool = True
    # Qwen3-Next
    shared_ffn: int = 0  # the shared expert's width
    layer_types: tuple[str, ...] = ()  # FULL_ATTENTION or LINEAR_ATTENTION, per layer
    rotary_fraction: float = 1.0  # partial rotary: the share of head_dim RoPE rotates
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_kernel: int = 0

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def hybrid(self) -> bool:
        """Layers of two kinds (Qwen3-Next): mcore keys each layer by its index instead of stacking them."""
        return self.family == "qwen3_next"

    @property
    def gated_attention(self) -> bool:
        """q_proj also yields a sigmoid output gate per head (Qwen3-Next; mcore's attention_output_gate)."""
        return self.family == "qwen3_next"

    def describe(self) -> str:
        """One line: the model's shape (its layer kinds, experts, shared expert)."""
        full = sum(self.full_attention(layer) for layer in range(self.layers))
        return (f"{self.family}: {self.layers} layers"
                + (f" ({self.layers - full} gated DeltaNet, {full} gated attention)" if self.hybrid else "")
                + f", hidden {self.hidden}, {self.heads} heads / {self.groups} KV groups"
                + (f", {self.experts} experts (top-{self.topk})" if self.moe else "")
                + (", a gated shared expert" if self.shared_ffn else "") + f", vocab {self.vocab}"
                + (", tied embeddings" if self.tied else ""))

    def full_attention(self, layer: int) -> bool:
        return not self.hybrid or self.layer_types[layer] == FULL_ATTENTION

    @property
    def linear_attention_freq(self) -> int | list[int]:
        """mcore's `linear_attention_freq`: N where every N-th layer is full attention, else the pattern
        (1: DeltaNet, 0: attention)."""
        pattern = [0 if t == FULL_ATTENTION else 1 for t in self.layer_types]
        for n in range(1, self.layers + 1):
            if pattern == [0 if (i + 1) % n == 0 else 1 for i in range(self.layers)]:
                return n
        return pattern

    def hybrid_settings(self) -> dict:
        """Qwen3-Next's settings as Megatron-Bridge's provider configures them (zero-centred norms, gated
        attention, a gated shared expert, DeltaNet layers with a full-attention layer every
        linear_attention_freq), under the names TransformerConfig and Megatron-LM's arguments share; empty for
        a model that is not hybrid."""
        if not self.hybrid:
            return {}
        return dict(
            layernorm_zero_centered_gamma=True, attention_output_gate=True,
            moe_shared_expert_intermediate_size=self.shared_ffn, moe_shared_expert_gate=True,
            experimental_attention_variant="gated_delta_net", linear_attention_freq=self.linear_attention_freq,
            linear_conv_kernel_dim=self.conv_kernel, linear_key_head_dim=self.linear_key_dim,
            linear_value_head_dim=self.linear_value_dim, linear_num_key_heads=self.linear_key_heads,
            linear_num_value_heads=self.linear_value_heads)

    def target_problems(self, naming: str, fmt: str) -> list[str]:
        """What of a conversion target (`convert.naming` / `convert.format`) mcore has no model for."""
        if not self.hybrid:
            return []
        return ([f"convert.naming={naming}: Qwen3-Next has one naming, Transformer Engine's: megatron-core's TE "
                 "spec and a4ray's local one (a4ray.mcore.hybrid) name its tensors alike; use naming te"]
                if naming != "te" else []) + (
                [f"convert.format={fmt}: Qwen3-Next converts to torch_dist only (the legacy state dict holds "
                 "the DeltaNet projections fused, torch_dist in parts)"] if fmt != "torch_dist" else [])

    @classmethod
    def from_config(cls, config: dict, source: str) -> Architecture:
        archs = config.get("architectures") or []
        arch = archs[0] if archs else f"(none; model_type {config.get('model_type')!r})"
        family = NATIVE_ARCHITECTURES.get(arch)
        if family is None:
            raise UnsupportedModel(
                f"{source}: architecture {arch} is not supported by the native backend "
                f"(it converts {', '.join(NATIVE_ARCHITECTURES)})", hint="use backend: pai or swift if they support it")
        problems = []
        if config.get("attention_bias"):
            problems.append("attention_bias=true (Qwen3 checkpoints have none)")
        heads = config["num_attention_heads"]
        groups = config.get("num_key_value_heads") or heads
        if heads % groups:
            problems.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
        experts = 0
        if family in ("qwen3_moe", "qwen3_next"):
            experts = config.get("num_experts") or config.get("num_local_experts") or 0
            if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
                problems.append("dense layers between MoE layers (mlp_only_layers / decoder_sparse_step): "
                                + ("the native mapping has every layer MoE" if family == "qwen3_next" else
                                   "mcore's stacked torch_dist layout needs every layer to be MoE"))
        if family == "qwen3_moe" and config.get("shared_expert_intermediate_size"):
            problems.append("shared experts (not part of Qwen3-MoE)")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        next_fields: dict = {}
        if family == "qwen3_next":
            next_fields, found = cls._next_fields(config, rope)
            problems += found
            if not experts:
                problems.append("no experts (every Qwen3-Next layer is MoE)")
        if problems:
            raise UnsupportedModel(f"{source}: {arch} with " + "; ".join(problems)
                                   + " is not supported by the native backend")
        return cls(
            family=family, layers=config["num_hidden_layers"], hidden=config["hidden_size"], heads=heads,
            groups=groups, head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            ffn=config.get("intermediate_size", 0), vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)), norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rope_type=rope.get("rope_type", rope.get("type", "default")),
            max_positions=config.get("max_position_embeddings", 4096),
            dtype=str(config.get("dtype") or config.get("torch_dtype") or "bfloat16"),
            experts=experts, moe_ffn=config.get("moe_intermediate_size", 0) if experts else 0,
            topk=config.get("num_experts_per_tok", 0) if experts else 0,
            norm_topk_prob=bool(config.get("norm_topk_prob", True)), **next_fields,
        )

    @staticmethod
    def _next_fields(config: dict, rope: dict) -> tuple[dict, list[str]]:
        """Qwen3-Next's fields, and what the native backend cannot convert."""
        layers = config["num_hidden_layers"]
        interval = config.get("full_attention_interval") or 4
        # Older configs give the interval only: layer i is full attention where (i + 1) % interval == 0.
        types = tuple(config.get("layer_types") or (FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                                                    for i in range(layers)))
        key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
        problems = []
        if len(types) != layers or set(types) - {FULL_ATTENTION, LINEAR_ATTENTION}:
            problems.append(f"layer_types {list(types)} (expected {layers} of {FULL_ATTENTION} / {LINEAR_ATTENTION})")
        if value_heads % key_heads:
            problems.append(f"linear_num_value_heads={value_heads} is not a multiple of "
                            f"linear_num_key_heads={key_heads}")
        if not config.get("shared_expert_intermediate_size"):
            problems.append("no shared expert (mcore's Qwen3-Next has one, gated)")
        return dict(
            shared_ffn=config.get("shared_expert_intermediate_size") or 0, layer_types=types,
            rotary_fraction=float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))),
            linear_key_heads=key_heads, linear_value_heads=value_heads, linear_key_dim=config["linear_key_head_dim"],
            linear_value_dim=config["linear_value_head_dim"], conv_kernel=config.get("linear_conv_kernel_dim", 4),
        ), problems
