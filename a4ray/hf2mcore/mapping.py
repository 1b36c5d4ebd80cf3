"""How a Hugging Face Qwen3 / Qwen3-MoE / Qwen3-Next checkpoint maps onto Megatron-core parameters, and back.

A `Slot` is one mcore tensor of one layer (or of one expert of one layer), built from one or more HF
tensors. Its names come from one table, `a4ray.mcore.names.NAMES`, in both namings mcore uses:

* `sharded_key`: the key in a torch_dist checkpoint. Layers are stacked: a layer's tensor is the chunk at
  offset `(layer[, expert], 0, ...)` of a global `[L(, E), ...]` tensor (mcore's `sharded_state_dict`).
* `state_key`: the key in `model.state_dict()` (and in the legacy per-rank format), one per layer.

Qwen3-Next is megatron-core's own hybrid GPTModel (`experimental_attention_variant="gated_delta_net"`,
`linear_attention_freq`): gated DeltaNet layers, with a gated full-attention layer every
`full_attention_interval`, each followed by MoE with a gated shared expert. Its layers differ, so mcore keys
each layer's tensors by its index (`decoder.layers.<l>.…`, `non_homogeneous_layers`) instead of stacking
them, and splits two of them into parts in torch_dist (`in_proj.weight.{query,key,value,z,beta,alpha}`,
`conv1d.weight.{query,key,value}`: `GatedDeltaNet.sharded_state_dict`), each part a slot of its own.
It has TE's names in both layer specs (megatron-core's TE one; a4ray's local one, `a4ray.mcore.hybrid`,
names every tensor alike) and converts to torch_dist only.
Its norms are zero-centred (HF and mcore store w for a scale of 1 + w) except the DeltaNet's gated output
norm, which HF stores as the scale itself: that slot is the HF tensor shifted by -1 (`Slot.shift`). Its
multi-token-prediction layer (`mtp.*`) is not converted, and the convert result says so (`dropped`).
Names and layouts: mcore 0.16.1's `ssm/gated_delta_net.py`, `transformer/attention.py` (gated QKV) and
`models/gpt/experimental_attention_variant_module_specs.py` (the same in 0.19), read against transformers'
`modeling_qwen3_next.py`; Megatron-Bridge's Qwen3-Next bridge maps the same tensors the same way.

Which HF rows make up each mcore tensor, in which order (QKV interleaved per query group, SwiGLU's
[gate; up]), is `segments`, the one definition of every layout. The writer writes consecutive experts of
a layer's expert tensor as one chunk, a `Unit`.

The two namings differ where Transformer Engine fuses a norm into the next linear layer: the TE specs
(Pai-Megatron-Patch, ms-swift, Megatron-Bridge) keep the MoE pre-MLP norm as its own module and have
`_extra_state` on their norms; the local specs map both norms into the linears' `layer_norm_weight`.
Facts and their sources: Megatron-LM's `checkpointing.py` (the tracker, `iter_{:07d}`, torch_dist's layout), and
mcore 0.16's `get_gpt_layer_local_spec` / `get_gpt_layer_with_transformer_engine_spec`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from a4ray.mcore.architecture import Architecture, Naming
from a4ray.mcore.names import CONV_PARTS, IN_PROJ_PARTS, LAYERS, names

if TYPE_CHECKING:  # torch is imported where tensors are made: planning (a dry run's) needs none
    import torch

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
           "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, _DTYPES[name])


# ----------------------------------------------------------------------------------------- names

# Slots whose mcore tensor is not the HF rows themselves but the rows plus a constant: Qwen3-Next's gated
# output norm scales by w in HF (initialised to 1) and by 1 + w in mcore (layernorm_zero_centered_gamma).
# Computed in fp32 and rounded once to the target dtype (exact wherever w - 1 is representable).
_SHIFTS = {"out_norm": -1.0}


@dataclass(frozen=True)
class Slot:
    """One mcore tensor (of one layer, or one expert of one layer) and the HF tensors it is built from."""

    role: str
    shape: tuple[int, ...]
    sources: tuple[tuple[str, tuple[int, ...]], ...]  # (HF name, HF shape), in the order the op takes them
    layer: int | None = None
    expert: int | None = None
    layer_keys: bool = False  # keyed by layer index (hybrid models), not a slice of a stacked tensor

    @property
    def op(self) -> str:
        if self.role.startswith(("in_proj.", "conv1d.")):
            return "deltanet"
        return {"qkv": "qkv", "fc1": "gate_up", "expert_fc1": "gate_up", "shared_fc1": "gate_up"}.get(self.role, "copy")

    @property
    def shift(self) -> float:
        """The constant the mcore tensor adds to its HF rows (0: none; see `_SHIFTS`)."""
        return _SHIFTS.get(self.role, 0.0)

    @property
    def group(self) -> str:
        """The unit conversion parts are made of: the embedding, one layer, or the output head."""
        return f"layer {self.layer}" if self.layer is not None else ("embedding" if self.role == "embed" else "head")

    def sharded_key(self, naming: Naming) -> str:
        key = names(self.role, naming, hybrid=self.layer_keys)[0]
        # mcore's non_homogeneous_layers: the layer's own prefix in place of the stacked one.
        return key.replace(LAYERS, f"{LAYERS}{self.layer}.", 1) if self.layer_keys else key

    def state_key(self, naming: Naming) -> str:
        return names(self.role, naming, hybrid=self.layer_keys)[1].format(l=self.layer, e=self.expert)

    def stack(self, arch: Architecture) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) of the stacking dims this slot sits at: (layer[, expert]) in (L[, E]); only
        (expert) in (E) where layers have keys of their own."""
        if self.layer is None:
            return (), ()
        offsets, sizes = ((), ()) if self.layer_keys else ((self.layer,), (arch.layers,))
        if self.expert is None:
            return offsets, sizes
        return offsets + (self.expert,), sizes + (arch.experts,)

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
    H = arch.hidden
    out = [Slot("embed", (arch.vocab, H), (("model.embed_tokens.weight", (arch.vocab, H)),))]
    for layer in range(arch.layers):
        p = f"model.layers.{layer}."

        def make(role: str, shape: tuple[int, ...], *sources: tuple[str, tuple[int, ...]],
                 expert: int | None = None, layer: int = layer) -> Slot:
            return Slot(role, shape, sources, layer, expert, arch.hybrid)

        out += _attention(arch, p, make) if arch.full_attention(layer) else _deltanet(arch, p, make)
        out += _mlp(arch, p, make)
    out.append(Slot("final_norm", (H,), (("model.norm.weight", (H,)),)))
    if not arch.tied:  # tied: mcore reuses the embedding and has no output_layer.weight
        out.append(Slot("output", (arch.vocab, H), (("lm_head.weight", (arch.vocab, H)),)))
    return out


def _attention(arch: Architecture, p: str, make) -> list[Slot]:
    H, d = arch.hidden, arch.head_dim
    q_rows = arch.heads * d * (2 if arch.gated_attention else 1)  # gated: each head's query, then its gate
    return [
        make("input_norm", (H,), (p + "input_layernorm.weight", (H,))),
        make("qkv", (q_rows + 2 * arch.groups * d, H), (p + "self_attn.q_proj.weight", (q_rows, H)),
             (p + "self_attn.k_proj.weight", (arch.groups * d, H)),
             (p + "self_attn.v_proj.weight", (arch.groups * d, H))),
        make("q_norm", (d,), (p + "self_attn.q_norm.weight", (d,))),
        make("k_norm", (d,), (p + "self_attn.k_norm.weight", (d,))),
        make("proj", (H, arch.heads * d), (p + "self_attn.o_proj.weight", (H, arch.heads * d))),
    ]


def _deltanet(arch: Architecture, p: str, make) -> list[Slot]:
    """A gated DeltaNet layer: each part of mcore's in_proj / conv1d is a slot of its own (see `segments`)."""
    H, a = arch.hidden, p + "linear_attn."
    qk, v, heads = arch.linear_key_heads * arch.linear_key_dim, arch.linear_value_heads * arch.linear_value_dim, \
        arch.linear_value_heads
    qkvz = (a + "in_proj_qkvz.weight", (2 * qk + 2 * v, H))
    ba = (a + "in_proj_ba.weight", (2 * heads, H))
    conv = (a + "conv1d.weight", (2 * qk + v, 1, arch.conv_kernel))
    in_proj_rows = dict(zip(IN_PROJ_PARTS, (qk, qk, v, v, heads, heads)))
    return [
        make("gdn_norm", (H,), (p + "input_layernorm.weight", (H,))),
        *(make(f"in_proj.{part}", (rows, H), ba if part in ("beta", "alpha") else qkvz)
          for part, rows in in_proj_rows.items()),
        *(make(f"conv1d.{part}", (rows, 1, arch.conv_kernel), conv) for part, rows in zip(CONV_PARTS, (qk, qk, v))),
        make("a_log", (heads,), (a + "A_log", (heads,))),
        make("dt_bias", (heads,), (a + "dt_bias", (heads,))),
        make("out_norm", (arch.linear_value_dim,), (a + "norm.weight", (arch.linear_value_dim,))),
        make("out_proj", (H, v), (a + "out_proj.weight", (H, v))),
    ]


def _mlp(arch: Architecture, p: str, make) -> list[Slot]:
    H = arch.hidden
    if not arch.moe:
        F = arch.ffn
        return [
            make("mlp_norm", (H,), (p + "post_attention_layernorm.weight", (H,))),
            make("fc1", (2 * F, H), (p + "mlp.gate_proj.weight", (F, H)), (p + "mlp.up_proj.weight", (F, H))),
            make("fc2", (H, F), (p + "mlp.down_proj.weight", (H, F))),
        ]
    F, x = arch.moe_ffn, f"{p}mlp.experts."
    out = [
        make("moe_norm", (H,), (p + "post_attention_layernorm.weight", (H,))),
        make("router", (arch.experts, H), (p + "mlp.gate.weight", (arch.experts, H))),
        # All experts' fc1, then all fc2: consecutive experts of one tensor are written as one chunk.
        *(make("expert_fc1", (2 * F, H), (f"{x}{e}.gate_proj.weight", (F, H)), (f"{x}{e}.up_proj.weight", (F, H)),
               expert=e) for e in range(arch.experts)),
        *(make("expert_fc2", (H, F), (f"{x}{e}.down_proj.weight", (H, F)), expert=e) for e in range(arch.experts)),
    ]
    if arch.shared_ffn:
        S, s = arch.shared_ffn, p + "mlp.shared_expert."
        out += [
            make("shared_fc1", (2 * S, H), (s + "gate_proj.weight", (S, H)), (s + "up_proj.weight", (S, H))),
            make("shared_fc2", (H, S), (s + "down_proj.weight", (H, S))),
            make("shared_gate", (1, H), (p + "mlp.shared_expert_gate.weight", (1, H))),
        ]
    return out


def dropped(arch: Architecture, names: list[str]) -> str | None:
    """One line on the HF tensors of `names` the conversion leaves out, and why (None: it converts all).
    Qwen3-Next checkpoints carry a multi-token-prediction layer (`mtp.*`, used for speculative decoding
    and as an extra training loss), which transformers' model does not load either: a4ray builds the model
    without MTP (megatron-core's `mtp_num_layers` unset), so the logits check has nothing to hold it to."""
    mtp = [n for n in names if n.startswith("mtp.")]
    if not mtp:
        return None
    return (f"not converted: {len(mtp)} tensor(s) of {arch.family}'s multi-token-prediction layer (mtp.*): the "
            "megatron-core model is built without MTP (mtp_num_layers unset), as transformers' model is; pretraining "
            "from this checkpoint starts without the MTP loss")


def hf_tensors(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the conversion reads, with its shape (a tensor may feed several slots)."""
    return {name: shape for slot in slots(arch) for name, shape in slot.sources}


def parameters(arch: Architecture) -> int:
    """The model's parameter count: the elements of every HF tensor the conversion reads (an MTP layer, which it
    does not convert, left out)."""
    return sum(math.prod(shape) for shape in hf_tensors(arch).values())


@dataclass(frozen=True)
class Unit:
    """What the writer writes as one chunk: one slot, or consecutive experts of one layer's expert tensor
    (fewer, larger records write faster; `max_bytes` bounds what a task holds)."""

    slots: tuple[Slot, ...]

    def sharded_key(self, naming: Naming) -> str:
        return self.slots[0].sharded_key(naming)

    def chunk(self, arch: Architecture) -> tuple[tuple[int, ...], tuple[int, ...]]:
        first = self.slots[0]
        offsets, sizes = first.chunk(arch)
        if first.expert is not None:  # the expert axis is the last stacking dim
            axis = len(first.stack(arch)[0]) - 1
            sizes = (*sizes[:axis], len(self.slots), *sizes[axis + 1:])
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
    checkpoints, as Pai's pinned Megatron-LM expects); a newer mcore simply does not ask for the latter,
    so Qwen3-Next (mcore >= 0.16) has none.
    """
    L, E = arch.layers, arch.experts
    out = []
    for layer in range(L):
        group = f"layer {layer}"
        if arch.hybrid:  # keyed by layer: one object per module, or one per expert
            prefix, offsets, shape = f"{LAYERS}{layer}.", (), ()
        else:
            prefix, offsets, shape = LAYERS, (layer,), (L,)
        per_layer, per_expert = _extra_modules(arch, naming, layer)
        out += [ExtraState(prefix + m, offsets or (0,), shape or (1,), group) for m in per_layer]
        out += [ExtraState(prefix + m, (*offsets, e), (*shape, E), group) for e in range(E) for m in per_expert]
    if naming == "te":
        out.append(ExtraState("decoder.final_layernorm", (0,), (1,), "head"))
    return out


def _extra_modules(arch: Architecture, naming: Naming, layer: int) -> tuple[list[str], list[str]]:
    """The modules of a layer that have an `_extra_state`: (once per layer, once per expert)."""
    per_expert = ["mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2"] if arch.moe else []
    if arch.hybrid:  # TE only; TENorms included
        mixer = (["self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.q_layernorm",
                  "self_attention.k_layernorm"] if arch.full_attention(layer) else
                 ["self_attention.in_proj", "self_attention.out_norm", "self_attention.out_proj"])
        return mixer + ["pre_mlp_layernorm", "mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"], \
            per_expert
    per_layer = ["self_attention.linear_qkv", "self_attention.linear_proj"]
    if not arch.moe:
        per_layer += ["mlp.linear_fc1", "mlp.linear_fc2"]
    if naming == "te":
        per_layer += ["self_attention.q_layernorm", "self_attention.k_layernorm", "self_attention.core_attention"]
        if arch.moe:
            per_layer.append("pre_mlp_layernorm")
    return per_layer, per_expert


def legacy_extra_keys(arch: Architecture, naming: Naming) -> list[str]:
    """The `_extra_state` keys of `model.state_dict()` (legacy format), so a strict load finds them all."""
    keys = []
    for layer in range(arch.layers):
        p = f"{LAYERS}{layer}."
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
        d, per_group = arch.head_dim, arch.heads // arch.groups
        if not arch.gated_attention:
            return [run for g in range(arch.groups)
                    for run in ((0, g * per_group * d, per_group * d), (1, g * d, d), (2, g * d, d))]
        # Gated (mcore's attention_output_gate): HF's q_proj holds [query; gate] per head (2d rows each),
        # mcore's group g is [queries of its heads; gates of its heads; k head g; v head g].
        heads = [range(g * per_group, (g + 1) * per_group) for g in range(arch.groups)]
        return [run for g in range(arch.groups) for run in (*((0, 2 * h * d, d) for h in heads[g]),
                                                            *((0, 2 * h * d + d, d) for h in heads[g]),
                                                            (1, g * d, d), (2, g * d, d))]
    if slot.op == "deltanet":
        return _deltanet_segments(slot, arch)
    # SwiGLU's fc1 is [gate; up]: mcore applies silu to the first half. A copy is one run.
    return [(i, 0, shape[0]) for i, (_, shape) in enumerate(slot.sources)]


def _deltanet_segments(slot: Slot, arch: Architecture) -> list[tuple[int, int, int]]:
    """The rows of one part of mcore's in_proj ([q; k; v; z; beta; alpha], each in head order) or conv1d
    ([q; k; v] channels). HF groups in_proj by key head k (r value heads each): in_proj_qkvz is
    [q_k; k_k; v of its r heads; z of them] and in_proj_ba [beta of its r heads; alpha of them]; HF's
    conv1d channels are already [q; k; v]."""
    module, part = slot.role.split(".")
    keys, dk, dv = arch.linear_key_heads, arch.linear_key_dim, arch.linear_value_dim
    r = arch.linear_value_heads // keys
    if module == "conv1d":
        qk = keys * dk
        first, rows = {"query": (0, qk), "key": (qk, qk), "value": (2 * qk, keys * r * dv)}[part]
        return [(0, first, rows)]
    if part in ("beta", "alpha"):
        return [(0, k * 2 * r + (r if part == "alpha" else 0), r) for k in range(keys)]
    block = 2 * dk + 2 * r * dv
    first, rows = {"query": (0, dk), "key": (dk, dk), "value": (2 * dk, r * dv), "z": (2 * dk + r * dv, r * dv)}[part]
    return [(0, k * block + first, rows) for k in range(keys)]


def to_mcore(slot: Slot, tensors: list[torch.Tensor], arch: Architecture,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """Build the slot's mcore tensor from its HF tensors (in `slot.sources` order), in `dtype` (default: theirs)
    as the writer builds it."""
    import torch

    runs = [tensors[i][first:first + rows] for i, first, rows in segments(slot, arch)]
    out = runs[0] if len(runs) == 1 else torch.cat(runs)
    dtype = dtype or out.dtype
    return (out.float() + slot.shift).to(dtype) if slot.shift else out.to(dtype)


def to_hf(slot: Slot, tensor: torch.Tensor, arch: Architecture,
          into: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The inverse of `to_mcore`: the slot's HF tensors from its mcore tensor. `into` (HF name -> tensor)
    collects the HF tensors that several slots fill part of (Qwen3-Next's in_proj and conv1d); missing ones
    are created there."""
    import torch

    into = {} if into is None else into
    if slot.shift:
        tensor = (tensor.float() - slot.shift).to(tensor.dtype)
    for name, shape in slot.sources:
        if name not in into:
            into[name] = torch.empty(shape, dtype=tensor.dtype)
    out = [into[name] for name, _ in slot.sources]
    tensor = tensor.reshape(-1, *out[0].shape[1:])  # rows of the sources (all of a slot's share a row shape)
    row = 0
    for i, first, rows in segments(slot, arch):
        out[i][first:first + rows] = tensor[row:row + rows]
        row += rows
    return out
