"""Tiny random Qwen3 / Qwen3-MoE Hugging Face checkpoints: conversion tests, benchmarks, rehearsal stand-ins.

Real transformers models (Qwen3ForCausalLM / Qwen3MoeForCausalLM) with every parameter drawn at random,
norms included (a norm left at 1.0 would hide a swapped mapping), saved with `save_pretrained` as several
safetensors shards, exactly as a downloaded checkpoint is laid out.
"""

from __future__ import annotations

from pathlib import Path

import torch


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
    torch.manual_seed(seed)
    model = model_cls._from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param, dtype=torch.float32))
            else:
                param.normal_(0, 0.5 / hidden**0.5)
    path = Path(path)
    model.save_pretrained(path, max_shard_size=shard_size)
    return path
