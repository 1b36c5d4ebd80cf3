"""How megatron-core names each tensor of a Qwen3 / Qwen3-MoE / Qwen3-Next GPTModel, in both of its layer
specs ("te", "local"): the sharded key in a torch_dist checkpoint and the key in `model.state_dict()`. The
converter writes by these names (`a4ray.hf2mcore.mapping`), and the trainer loads a checkpoint of the other
naming by them (`sharded_renames`).
"""

from __future__ import annotations

from a4ray.core.errors import UnsupportedModel
from a4ray.mcore.architecture import Architecture, Naming

# A Megatron checkpoint directory: the tracker file names its newest iteration ("release": a converted model).
TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version (QKV layout of mcore)

LAYERS = _L = "decoder.layers."  # the stacked layers' prefix
# role -> naming -> (sharded key, state key format). {l}: layer, {e}: expert.
NAMES: dict[str, dict[str, tuple[str, str]]] = {
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


def _te(module_param: str) -> dict[str, tuple[str, str]]:
    """A Qwen3-Next layer tensor, named as TE's hybrid spec names it (and a4ray's local one: see `names`)."""
    return {"te": (_L + module_param, _L + "{l}." + module_param)}


# mcore's torch_dist parts of GatedDeltaNet's fused in_proj and conv1d weights, in their row order.
IN_PROJ_PARTS = ("query", "key", "value", "z", "beta", "alpha")
CONV_PARTS = ("query", "key", "value")
NAMES.update({
    # Gated DeltaNet layers. The state dict holds in_proj / conv1d whole, rows in part order.
    "gdn_norm": _te("self_attention.in_proj.layer_norm_weight"),  # the input norm, fused into in_proj
    **{f"in_proj.{part}": {"te": (_L + f"self_attention.in_proj.weight.{part}",
                                  _L + "{l}.self_attention.in_proj.weight")} for part in IN_PROJ_PARTS},
    **{f"conv1d.{part}": {"te": (_L + f"self_attention.conv1d.weight.{part}",
                                 _L + "{l}.self_attention.conv1d.weight")} for part in CONV_PARTS},
    "a_log": _te("self_attention.A_log"),
    "dt_bias": _te("self_attention.dt_bias"),
    "out_norm": _te("self_attention.out_norm.weight"),
    "out_proj": _te("self_attention.out_proj.weight"),
    # The shared expert of Qwen3-Next's MoE layers, and its sigmoid gate.
    "shared_fc1": _te("mlp.shared_experts.linear_fc1.weight"),
    "shared_fc2": _te("mlp.shared_experts.linear_fc2.weight"),
    "shared_gate": _te("mlp.shared_experts.gate_weight"),
})

# The experts' modules differ between the specs (SequentialMLP, TEGroupedMLP): their state-dict keys do.
EXPERT_ROLES = ("expert_fc1", "expert_fc2")


def names(role: str, naming: Naming, *, hybrid: bool = False) -> tuple[str, str]:
    """(sharded key, state key format) of `role` in the `naming` spec. `hybrid` (Qwen3-Next): a4ray's local
    spec of it (`a4ray.mcore.hybrid`) names every tensor as TE's spec does, the experts' state keys aside."""
    if hybrid and role not in EXPERT_ROLES:
        naming = "te"
    table = NAMES[role]
    names = table.get(naming) or table.get("local")
    if names is None:
        raise UnsupportedModel(f"mcore has no {naming}-spec name for {role} (a {', '.join(table)}-spec tensor)")
    return names


def layer_roles(arch: Architecture) -> list[str]:
    """The roles of the tensors of a model of stacked layers (Qwen3, Qwen3-MoE): those with a local-spec
    name (the others are Qwen3-Next's), with the pre-MLP norm of the model's kind of MLP."""
    norm = "moe_norm" if arch.moe else "mlp_norm"
    return [role for role, table in NAMES.items() if "local" in table and role not in ("mlp_norm", "moe_norm")] + [norm]


def sharded_renames(arch: Architecture, ours: Naming, theirs: Naming) -> dict[str, str]:
    """{our sharded key: theirs} where a checkpoint of naming `theirs` names a tensor of our model
    (naming `ours`) differently. Layer-keyed models (Qwen3-Next) have TE's sharded keys in both specs."""
    if ours == theirs or arch.hybrid:
        return {}
    renames = {}
    for role in layer_roles(arch):
        mine, other = names(role, ours)[0], names(role, theirs)[0]
        if mine != other:
            renames[mine] = other
    return renames
