"""Builds megatron-core's Qwen3-Next model in each layer spec that imports here and loads one converted
checkpoint into it; prints, per spec, its parameters and its experts' torch_dist keys.

    python spec_layers.py CONVERTED HF      (one JSON line: {naming: {"params": {name: shape},
                                                                      "expert_keys": {key: global shape | null}}})

The local spec always; the TE spec where Transformer Engine imports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from a4ray.hf2mcore.hf import HFCheckpoint
from a4ray.mcore import checkpoint_dirs, checkpointing
from a4ray.mcore.model import gpt_model, have_te, init_standalone


def main(converted: str, hf_dir: str) -> None:
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    init_standalone()
    arch = HFCheckpoint.open(hf_dir).architecture()
    out = {}
    for naming in ["local"] + (["te"] if have_te() else []):
        model = gpt_model(arch, naming=naming)
        checkpointing.load_weights(model, checkpoint_dirs.converted_dir(Path(converted)), arch, naming)
        # SwiGLU's fc1 is a factory (its gate and up halves); its global shape is not one tensor's.
        experts = {item.key: list(item.global_shape) if isinstance(item, ShardedTensor) else None
                   for item in nested_values(model.sharded_state_dict())
                   if isinstance(item, (ShardedTensor, ShardedTensorFactory)) and ".experts.experts." in item.key}
        out[naming] = {"params": {name: list(p.shape) for name, p in model.named_parameters()},
                       "expert_keys": experts}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
