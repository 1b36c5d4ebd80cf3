"""How a Hugging Face Qwen3 / Qwen3-MoE checkpoint maps onto Megatron-core parameters, and back.

A `Slot` is one mcore tensor of one layer (or of one expert of one layer), built from one or more HF
tensors. Its names come from one table, `_NAMES`, in both namings mcore uses:

* `sharded_key`: the key in a torch_dist checkpoint. Layers are stacked: a layer's tensor is the chunk at
  offset `(layer[, expert], 0, ...)` of a global `[L(, E), ...]` tensor (mcore's `sharded_state_dict`).
* `state_key`: the key in `model.state_dict()` (and in the legacy per-rank format), one per layer.

Which HF rows make up each mcore tensor, in which order (QKV interleaved per query group, SwiGLU's
[gate; up]), is `segments`, the one definition of every layout. The writer writes consecutive experts of
a layer's expert tensor as one chunk, a `Unit`.

The two namings differ where Transformer Engine fuses a norm into the next linear layer: the TE specs
(Pai-Megatron-Patch, ms-swift, Megatron-Bridge) keep the MoE pre-MLP norm as its own module and have
`_extra_state` on their norms; the local specs map both norms into the linears' `layer_norm_weight`.
Facts and their sources: ../shared/research/workloads.md section 3.3 and 3.5, and mcore 0.16's
`get_gpt_layer_local_spec` / `get_gpt_layer_with_transformer_engine_spec`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from a4ray.core.errors import UnsupportedModel

Naming = Literal["te", "local"]

# HF `architectures[0]` -> the family the native backend converts.
NATIVE_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass(frozen=True)
class Architecture:
    """The shape of a Qwen3 / Qwen3-MoE model, read from its HF config.json."""

    family: Literal["qwen3", "qwen3_moe"]
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

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @classmethod
    def from_config(cls, config: dict, source: str) -> Architecture:
        archs = config.get("architectures") or []
        arch = archs[0] if archs else f"(none; model_type {config.get('model_type')!r})"
        family = NATIVE_ARCHITECTURES.get(arch)
        if family is None:
            hint = ("Qwen3-Next converts with backend: pai (Pai-Megatron-Patch's converter)"
                    if "Next" in arch or config.get("model_type") == "qwen3_next"
                    else "use backend: pai or swift if they support it")
            raise UnsupportedModel(
                f"{source}: architecture {arch} is not supported by the native backend "
                f"(it converts {', '.join(NATIVE_ARCHITECTURES)})", hint=hint)
        problems = []
        if config.get("attention_bias"):
            problems.append("attention_bias=true (Qwen3 checkpoints have none)")
        heads = config["num_attention_heads"]
        groups = config.get("num_key_value_heads") or heads
        if heads % groups:
            problems.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
        experts = 0
        if family == "qwen3_moe":
            experts = config.get("num_experts") or config.get("num_local_experts") or 0
            if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
                problems.append("dense layers between MoE layers (mlp_only_layers / decoder_sparse_step): "
                                "mcore's stacked torch_dist layout needs every layer to be MoE")
            if config.get("shared_expert_intermediate_size"):
                problems.append("shared experts (not part of Qwen3-MoE)")
        if problems:
            raise UnsupportedModel(f"{source}: {arch} with " + "; ".join(problems)
                                   + " is not supported by the native backend")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
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
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        )


# ----------------------------------------------------------------------------------------- names

_L = "decoder.layers."
# role -> naming -> (sharded key, state key format). {l}: layer, {e}: expert.
_NAMES: dict[str, dict[str, tuple[str, str]]] = {
    "embed": {"local": ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight")},
    "input_norm": {"local": (_L + "self_attention.linear_qkv.layer_norm_weight", _L + "{l}.input_layernorm.weight"),
                   "te": (_L + "self_attention.linear_qkv.layer_norm_weight",
                          _L + "{l}.self_attention.linear_qkv.layer_norm_weight")},
    "qkv": {"local": (_L + "self_attention.linear_qkv.weight", _L + "{l}.self_attention.linear_qkv.weight")},
    "q_norm": {"local": (_L + "self_attention.q_layernorm.weight", _L + "{l}.self_attention.q_layernorm.weight")},
    "k_norm": {"local": (_L + "self_attention.k_layernorm.weight", _L + "{l}.self_attention.k_layernorm.weight")},
    "proj": {"local": (_L + "self_attention.linear_proj.weight", _L + "{l}.self_attention.linear_proj.weight")},
    # Dense layers: TE fuses the pre-MLP norm into linear_fc1; the local spec maps it there for sharding.
    "mlp_norm": {"local": (_L + "mlp.linear_fc1.layer_norm_weight", _L + "{l}.pre_mlp_layernorm.weight"),
                 "te": (_L + "mlp.linear_fc1.layer_norm_weight", _L + "{l}.mlp.linear_fc1.layer_norm_weight")},
    # MoE layers: TE keeps a separate TENorm; the local spec still maps it onto linear_fc1's key.
    "moe_norm": {"local": (_L + "mlp.linear_fc1.layer_norm_weight", _L + "{l}.pre_mlp_layernorm.weight"),
                 "te": (_L + "pre_mlp_layernorm.weight", _L + "{l}.pre_mlp_layernorm.weight")},
    "fc1": {"local": (_L + "mlp.linear_fc1.weight", _L + "{l}.mlp.linear_fc1.weight")},
    "fc2": {"local": (_L + "mlp.linear_fc2.weight", _L + "{l}.mlp.linear_fc2.weight")},
    "router": {"local": (_L + "mlp.router.weight", _L + "{l}.mlp.router.weight")},
    # SequentialMLP (local) and TEGroupedMLP share the sharded layout [L, E, ...]; their state dicts differ.
    "expert_fc1": {"local": (_L + "mlp.experts.experts.linear_fc1.weight",
                             _L + "{l}.mlp.experts.local_experts.{e}.linear_fc1.weight"),
                   "te": (_L + "mlp.experts.experts.linear_fc1.weight", _L + "{l}.mlp.experts.linear_fc1.weight{e}")},
    "expert_fc2": {"local": (_L + "mlp.experts.experts.linear_fc2.weight",
                             _L + "{l}.mlp.experts.local_experts.{e}.linear_fc2.weight"),
                   "te": (_L + "mlp.experts.experts.linear_fc2.weight", _L + "{l}.mlp.experts.linear_fc2.weight{e}")},
    "final_norm": {"local": ("decoder.final_layernorm.weight", "decoder.final_layernorm.weight")},
    "output": {"local": ("output_layer.weight", "output_layer.weight")},
}


def _names(role: str, naming: Naming) -> tuple[str, str]:
    table = _NAMES[role]
    return table.get(naming, table["local"])


@dataclass(frozen=True)
class Slot:
    """One mcore tensor (of one layer, or one expert of one layer) and the HF tensors it is built from."""

    role: str
    shape: tuple[int, ...]
    sources: tuple[tuple[str, tuple[int, ...]], ...]  # (HF name, HF shape), in the order the op takes them
    layer: int | None = None
    expert: int | None = None

    @property
    def op(self) -> str:
        return {"qkv": "qkv", "fc1": "gate_up", "expert_fc1": "gate_up"}.get(self.role, "copy")

    @property
    def group(self) -> str:
        """The unit conversion parts are made of: the embedding, one layer, or the output head."""
        return f"layer {self.layer}" if self.layer is not None else ("embedding" if self.role == "embed" else "head")

    def sharded_key(self, naming: Naming) -> str:
        return _names(self.role, naming)[0]

    def state_key(self, naming: Naming) -> str:
        return _names(self.role, naming)[1].format(l=self.layer, e=self.expert)

    def stack(self, arch: Architecture) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) of the stacking dims this slot sits at: (layer[, expert]) in (L[, E])."""
        if self.layer is None:
            return (), ()
        if self.expert is None:
            return (self.layer,), (arch.layers,)
        return (self.layer, self.expert), (arch.layers, arch.experts)

    def global_shape(self, arch: Architecture) -> tuple[int, ...]:
        return self.stack(arch)[1] + self.shape

    def chunk(self, arch: Architecture) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) of this slot's chunk in the global tensor."""
        offsets, stack = self.stack(arch)
        return offsets + (0,) * len(self.shape), (1,) * len(stack) + self.shape

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ExtraState:
    """A module's `_extra_state` (TE's FP8 metadata; None for us), a ShardedObject in torch_dist."""

    module: str  # sharded module path, e.g. decoder.layers.self_attention.linear_qkv
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    group: str

    @property
    def fqn(self) -> str:
        # mcore's ShardedObject.unique_key: <key>/shard_<offsets>_<shape>
        return (f"{self.module}._extra_state/shard_{'.'.join(map(str, self.offsets))}_"
                f"{'.'.join(map(str, self.shape))}")


def slots(arch: Architecture) -> list[Slot]:
    """Every mcore tensor of the model, in checkpoint order (embedding, layer 0 ... L-1, head)."""
    H, d = arch.hidden, arch.head_dim
    out = [Slot("embed", (arch.vocab, H), (("model.embed_tokens.weight", (arch.vocab, H)),))]
    for layer in range(arch.layers):
        p = f"model.layers.{layer}."
        out += [
            Slot("input_norm", (H,), ((p + "input_layernorm.weight", (H,)),), layer),
            Slot("qkv", ((arch.heads + 2 * arch.groups) * d, H),
                 ((p + "self_attn.q_proj.weight", (arch.heads * d, H)),
                  (p + "self_attn.k_proj.weight", (arch.groups * d, H)),
                  (p + "self_attn.v_proj.weight", (arch.groups * d, H))), layer),
            Slot("q_norm", (d,), ((p + "self_attn.q_norm.weight", (d,)),), layer),
            Slot("k_norm", (d,), ((p + "self_attn.k_norm.weight", (d,)),), layer),
            Slot("proj", (H, arch.heads * d), ((p + "self_attn.o_proj.weight", (H, arch.heads * d)),), layer),
        ]
        if not arch.moe:
            F = arch.ffn
            out += [
                Slot("mlp_norm", (H,), ((p + "post_attention_layernorm.weight", (H,)),), layer),
                Slot("fc1", (2 * F, H), ((p + "mlp.gate_proj.weight", (F, H)), (p + "mlp.up_proj.weight", (F, H))),
                     layer),
                Slot("fc2", (H, F), ((p + "mlp.down_proj.weight", (H, F)),), layer),
            ]
            continue
        F = arch.moe_ffn
        out += [
            Slot("moe_norm", (H,), ((p + "post_attention_layernorm.weight", (H,)),), layer),
            Slot("router", (arch.experts, H), ((p + "mlp.gate.weight", (arch.experts, H)),), layer),
        ]
        # All experts' fc1, then all fc2: consecutive experts of one tensor are written as one chunk.
        x = f"{p}mlp.experts."
        out += [Slot("expert_fc1", (2 * F, H),
                     ((f"{x}{e}.gate_proj.weight", (F, H)), (f"{x}{e}.up_proj.weight", (F, H))), layer, e)
                for e in range(arch.experts)]
        out += [Slot("expert_fc2", (H, F), ((f"{x}{e}.down_proj.weight", (H, F)),), layer, e)
                for e in range(arch.experts)]
    out.append(Slot("final_norm", (H,), (("model.norm.weight", (H,)),)))
    if not arch.tied:  # tied: mcore reuses the embedding and has no output_layer.weight
        out.append(Slot("output", (arch.vocab, H), (("lm_head.weight", (arch.vocab, H)),)))
    return out


@dataclass(frozen=True)
class Unit:
    """What the writer writes as one chunk: one slot, or consecutive experts of one layer's expert tensor
    (fewer, larger records write faster; `max_bytes` bounds what a task holds)."""

    slots: tuple[Slot, ...]

    def sharded_key(self, naming: Naming) -> str:
        return self.slots[0].sharded_key(naming)

    def chunk(self, arch: Architecture) -> tuple[tuple[int, ...], tuple[int, ...]]:
        offsets, sizes = self.slots[0].chunk(arch)
        if self.slots[0].expert is not None:
            sizes = (sizes[0], len(self.slots), *sizes[2:])
        return offsets, sizes

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)


def units(run: list[Slot], element_bytes: int, max_bytes: int) -> list[Unit]:
    """The slots of one group as units: each expert slot joins its predecessor (same tensor, next expert)
    while the unit stays within `max_bytes`; every other slot is a unit of its own."""
    out: list[list[Slot]] = []
    for slot in run:
        last = out[-1] if out else None
        if (last and slot.expert is not None and last[-1].expert == slot.expert - 1 and last[-1].role == slot.role
                and (len(last) + 1) * slot.numel * element_bytes <= max_bytes):
            last.append(slot)
        else:
            out.append([slot])
    return [Unit(tuple(u)) for u in out]


def extra_states(arch: Architecture, naming: Naming) -> list[ExtraState]:
    """The `_extra_state` objects a model of this naming asks for when it loads a torch_dist checkpoint.

    TE naming also carries the states of TE's norms and of TEDotProductAttention (which mcore <= 0.15
    checkpoints, as Pai's pinned Megatron-LM expects); a newer mcore simply does not ask for the latter.
    """
    L, E = arch.layers, arch.experts
    per_layer = ["self_attention.linear_qkv", "self_attention.linear_proj"]
    per_expert: list[str] = []
    if arch.moe:
        per_expert = ["mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2"]
    else:
        per_layer += ["mlp.linear_fc1", "mlp.linear_fc2"]
    if naming == "te":
        per_layer += ["self_attention.q_layernorm", "self_attention.k_layernorm", "self_attention.core_attention"]
        if arch.moe:
            per_layer.append("pre_mlp_layernorm")
    out = []
    for layer in range(L):
        group = f"layer {layer}"
        out += [ExtraState(_L + m, (layer,), (L,), group) for m in per_layer]
        out += [ExtraState(_L + m, (layer, e), (L, E), group) for e in range(E) for m in per_expert]
    if naming == "te":
        out.append(ExtraState("decoder.final_layernorm", (0,), (1,), "head"))
    return out


def legacy_extra_keys(arch: Architecture, naming: Naming) -> list[str]:
    """The `_extra_state` keys of `model.state_dict()` (legacy format), so a strict load finds them all."""
    keys = []
    for layer in range(arch.layers):
        p = f"{_L}{layer}."
        mods = ["self_attention.linear_qkv", "self_attention.linear_proj"]
        if not arch.moe:
            mods += ["mlp.linear_fc1", "mlp.linear_fc2"]
        elif naming == "local":
            mods += [f"mlp.experts.local_experts.{e}.linear_fc{i}" for e in range(arch.experts) for i in (1, 2)]
        else:
            mods += ["mlp.experts.linear_fc1", "mlp.experts.linear_fc2"]
        if naming == "te":
            mods += ["self_attention.q_layernorm", "self_attention.k_layernorm", "self_attention.core_attention"]
            mods += ["pre_mlp_layernorm"] if arch.moe else []
        keys += [f"{p}{m}._extra_state" for m in mods]
    keys.append("output_layer._extra_state")
    if naming == "te":
        keys.append("decoder.final_layernorm._extra_state")
    return keys


def groups(items: list) -> Iterator[tuple[str, list]]:
    """Consecutive runs of slots / extra states by `group`, in order."""
    current, run = None, []
    for item in items:
        if item.group != current and run:
            yield current, run
            run = []
        current = item.group
        run.append(item)
    if run:
        yield current, run


# ------------------------------------------------------------------------------------------- ops
#
# Every mcore tensor is its HF tensors' rows, in some order: `segments` is that order, the one
# definition of each layout. `to_mcore` / `to_hf` apply it to tensors; the writer applies it to bytes
# (reading each segment straight from the shard into place).


def segments(slot: Slot, arch: Architecture) -> list[tuple[int, int, int]]:
    """(source index, first row, rows) of each run of rows, in the order they make up the mcore tensor."""
    if slot.op == "qkv":
        # mcore stores QKV per query group: [q heads of group g, k head g, v head g] for g = 0 .. ng-1,
        # so that a TP split of the rows gives every rank whole groups.
        q_rows, d = arch.heads // arch.groups * arch.head_dim, arch.head_dim
        return [run for g in range(arch.groups) for run in ((0, g * q_rows, q_rows), (1, g * d, d), (2, g * d, d))]
    # SwiGLU's fc1 is [gate; up]: mcore applies silu to the first half. A copy is one run.
    return [(i, 0, shape[0]) for i, (_, shape) in enumerate(slot.sources)]


def to_mcore(slot: Slot, tensors: list[torch.Tensor], arch: Architecture) -> torch.Tensor:
    """Build the slot's mcore tensor from its HF tensors (in `slot.sources` order)."""
    runs = [tensors[i][first:first + rows] for i, first, rows in segments(slot, arch)]
    return runs[0] if len(runs) == 1 else torch.cat(runs)


def to_hf(slot: Slot, tensor: torch.Tensor, arch: Architecture) -> list[torch.Tensor]:
    """The inverse of `to_mcore`: the slot's HF tensors from its mcore tensor."""
    out = [torch.empty(shape, dtype=tensor.dtype) for _, shape in slot.sources]
    tensor = tensor.reshape(-1, *out[0].shape[1:])  # rows of the sources (all of a slot's share a row shape)
    row = 0
    for i, first, rows in segments(slot, arch):
        out[i][first:first + rows] = tensor[row:row + rows]
        row += rows
    return out
