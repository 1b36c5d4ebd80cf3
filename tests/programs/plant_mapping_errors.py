"""Plants a mapping error in a converted Qwen3-Next checkpoint and verifies the result by its logits alone.

    python plant_mapping_errors.py CONVERTED HF OUT ERROR...      (prints one JSON VerifyReport per ERROR)

A mapping error is wrong both ways, so the round trip cannot see it (it reads back what was written, through
the same wrong mapping); what it leaves in the checkpoint is what this writes: the converted checkpoint
loaded into megatron-core's model, the error applied to the tensor a wrong mapping would have built, saved
again by megatron-core. ERRORs:

* in_proj_groups: layer 0's DeltaNet in_proj with key-head groups 0 and 1 swapped in every part (q/k/v/z/b/a);
* norm_shift: every DeltaNet's gated output norm without the -1 shift (HF's w where mcore wants w - 1);
* gate_query: layer 3's gated attention with each query group's queries and output gates swapped.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from a4ray.hf2mcore import verify
from a4ray.hf2mcore.hf import HFCheckpoint
from a4ray.mcore import checkpoint_dirs, checkpointing
from a4ray.mcore.model import gpt_model, init_standalone
from a4ray.spec.conversion import VerifySpec


def swap_key_groups(weight: torch.Tensor, arch) -> None:
    keys, dk, dv = arch.linear_key_heads, arch.linear_key_dim, arch.linear_value_dim
    r = arch.linear_value_heads // keys
    start = 0
    for rows in (dk, dk, r * dv, r * dv, r, r):  # per key-head group, in each part q, k, v, z, beta, alpha
        part = weight[start:start + keys * rows]
        first, second = part[:rows].clone(), part[rows:2 * rows].clone()
        part[:rows], part[rows:2 * rows] = second, first
        start += keys * rows


def swap_gate_and_query(weight: torch.Tensor, arch) -> None:
    d, per_group = arch.head_dim, arch.heads // arch.groups
    block = (2 * per_group + 2) * d  # a query group: its queries, their gates, one key, one value
    for g in range(arch.groups):
        q = slice(g * block, g * block + per_group * d)
        gate = slice(q.stop, q.stop + per_group * d)
        weight[q], weight[gate] = weight[gate].clone(), weight[q].clone()


def main(converted: str, hf_dir: str, out: str, errors: list[str]) -> None:
    from megatron.core import dist_checkpointing

    init_standalone()
    arch = HFCheckpoint.open(hf_dir).architecture()
    for error in errors:
        model = gpt_model(arch, naming="local")
        checkpointing.load_weights(model, checkpoint_dirs.converted_dir(Path(converted)), arch, "local")
        layers = model.decoder.layers
        with torch.no_grad():
            if error == "in_proj_groups":
                swap_key_groups(layers[0].self_attention.in_proj.weight, arch)
            elif error == "norm_shift":
                for layer in range(arch.layers):
                    if not arch.full_attention(layer):
                        layers[layer].self_attention.out_norm.weight += 1.0
            elif error == "gate_query":
                swap_gate_and_query(layers[3].self_attention.linear_qkv.weight, arch)
            elif error != "none":
                raise SystemExit(f"unknown error {error}")
        root = Path(out) / error
        shutil.rmtree(root, ignore_errors=True)
        (root / "release").mkdir(parents=True)
        dist_checkpointing.save(model.sharded_state_dict(), str(root / "release"))
        (root / checkpointing.TRACKER).write_text("release")
        report = verify.run(str(root), hf_dir, "te", "torch_dist", VerifySpec(round_trip=error == "none"))
        print(report.model_dump_json(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
