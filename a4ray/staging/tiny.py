"""Tiny random Qwen3 / Qwen3-MoE / Qwen3-Next Hugging Face checkpoints: conversion tests, benchmarks, stand-ins.

Real transformers models (Qwen3ForCausalLM / Qwen3MoeForCausalLM / Qwen3NextForCausalLM) with every parameter
drawn at random, norms included (a norm left at its neutral value, 1 or for zero-centred norms 0, would hide
a swapped mapping), saved with `save_pretrained` as several safetensors shards, exactly as a downloaded
checkpoint is laid out.
"""

from __future__ import annotations

from pathlib import Path

import torch

# The shape of the Qwen3-Next stand-in (a4ray.staging.standins): 4 layers, 3 gated DeltaNet + 1 gated
# attention, 8 experts top-2 plus a shared expert, GQA 4/2, DeltaNet 2 key / 4 value heads.
QWEN3_NEXT_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
    max_position_embeddings=512, tie_word_embeddings=False,
)


def write_tiny(path: str | Path, *, moe: bool = True, layers: int = 2, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, head_dim: int = 16, ffn: int = 128, experts: int = 4, topk: int = 2,
               moe_ffn: int = 32, vocab: int = 128, tied: bool = False, dtype: torch.dtype = torch.float32,
               shard_size: str = "64KB", seed: int = 0, **config) -> Path:
    """Write the checkpoint to `path`; `config` adds or overrides config fields (token ids, max positions)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  tie_word_embeddings=tied, max_position_embeddings=256, rope_theta=1e6)
    common.update(config)
    if moe:
        config = Qwen3MoeConfig(**common, num_experts=experts, num_experts_per_tok=topk,
                                moe_intermediate_size=moe_ffn, norm_topk_prob=True)
        model_cls = Qwen3MoeForCausalLM
    else:
        config = Qwen3Config(**common)
        model_cls = Qwen3ForCausalLM
    return _save(model_cls, config, path, dtype, shard_size, seed, neutral=lambda name: 1.0)


def write_tiny_next(path: str | Path, *, dtype: torch.dtype = torch.bfloat16, shard_size: str = "64KB",
                    seed: int = 0, **config) -> Path:
    """A Qwen3-Next checkpoint of the stand-in's shape (`QWEN3_NEXT_TINY`, overridden by `config`)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # Qwen3-Next's norms are zero-centred (scale 1 + w) except the DeltaNet's gated output norm (scale w).
    return _save(Qwen3NextForCausalLM, Qwen3NextConfig(**{**QWEN3_NEXT_TINY, **config}), path, dtype, shard_size, seed,
                 neutral=lambda name: 1.0 if name.endswith("linear_attn.norm.weight") else 0.0)


def _save(model_cls, config, path: str | Path, dtype: torch.dtype, shard_size: str, seed: int, neutral) -> Path:
    torch.manual_seed(seed)
    model = model_cls._from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(neutral(name) + 0.1 * torch.randn_like(param, dtype=torch.float32))
            else:
                param.normal_(0, 0.5 / config.hidden_size**0.5)
    path = Path(path)
    model.save_pretrained(path, max_shard_size=shard_size)
    return path
