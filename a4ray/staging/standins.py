"""Tiny local stand-ins for what the Qwen3 recipes stage on A4, made here in seconds, deterministically:

    qwen3-moe-tiny/      Hugging Face checkpoint of a Qwen3-MoE (Qwen3MoeForCausalLM): 2 layers, 8 experts,
                         top-2, GQA 4/2, hidden 64; bf16 safetensors in shards + index; tokenizer files
    qwen3-next-tiny/     the same for Qwen3-Next (Qwen3NextForCausalLM): 4 layers, 3 linear-attention + 1 full
    qwen-datasets/       mmap_qwen3_datasets_text_document.{bin,idx}: a Megatron indexed dataset (megatron-core's
                         IndexedDatasetBuilder) of a small synthetic corpus, tokenized with the tiny tokenizer
    datasets/            alpaca_zh-{train,valid}-general.json: Alpaca-style SFT records

The tokenizer is a byte-level BPE trained on the same corpus and saved the way Qwen's is (tokenizer.json,
vocab.json, merges.txt, tokenizer_config.json as Qwen2Tokenizer), so consumers that copy `*.json` and
`merges.txt` (Pai's converter) or call AutoTokenizer find what they expect. Nothing is downloaded.

    python -m a4ray.staging.standins [OUT]     (or `a4ray standins --out OUT`; default .a4ray/standins)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import warnings
from pathlib import Path

from a4ray.runtime.simulated import local_root

VERSION = "2"  # bump when the stand-ins change; an existing set of another version is remade
_STAMP = ".a4ray-standin"
SEED = 1234
VOCAB = 512
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_WORDS = ("the a model expert token layer gradient node rank ray stage train data batch shard attention router "
          "loss step cluster fabric link ring tree reduce gather scatter weight bias norm rope head query key value "
          "数据 模型 专家 训练 节点 你好 世界").split()


def corpus(documents: int = 256) -> list[str]:
    rng = random.Random(SEED)
    docs = []
    for _ in range(documents):
        sentences = []
        for _ in range(rng.randint(2, 12)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
            sentences.append(" ".join(words).capitalize() + rng.choice(".!?"))
        docs.append(" ".join(sentences))
    return docs


def make_tokenizer(out: Path, texts: list[str]):
    """A byte-level BPE tokenizer saved like Qwen's; returns the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(out))  # vocab.json + merges.txt, for slow-tokenizer consumers
    hf = Qwen2Tokenizer(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                        bos_token=None, unk_token=None)
    hf.save_pretrained(out)
    return hf


def _save_checkpoint(model, out: Path, tokenizer_dir: Path) -> None:
    import torch

    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="256KB")  # sharded + index, like the real ones
    for f in tokenizer_dir.iterdir():
        shutil.copy2(f, out / f.name)


def make_qwen3_moe(out: Path, tokenizer_dir: Path) -> None:
    import torch

    from a4ray.staging.tiny import write_tiny

    write_tiny(out, moe=True, layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, experts=8, topk=2,
               moe_ffn=32, vocab=VOCAB, dtype=torch.bfloat16, shard_size="256KB", seed=SEED,
               max_position_embeddings=512, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    for f in tokenizer_dir.iterdir():
        shutil.copy2(f, out / f.name)


def make_qwen3_next(out: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from a4ray.staging.tiny import QWEN3_NEXT_TINY

    torch.manual_seed(SEED)
    config = Qwen3NextConfig(**{**QWEN3_NEXT_TINY, "vocab_size": VOCAB}, eos_token_id=0, pad_token_id=0,
                             bos_token_id=None)
    _save_checkpoint(Qwen3NextForCausalLM(config), out, tokenizer_dir)


def make_mmap_dataset(prefix: Path, tokenizer, texts: list[str]) -> None:
    """A Megatron indexed dataset (`<prefix>.bin` / `<prefix>.idx`), one document per text, EOD-terminated."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for text in texts:
        ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        builder.add_document(torch.tensor(ids, dtype=torch.int32), [len(ids)])
    builder.finalize(f"{prefix}.idx")


def make_alpaca(out: Path, texts: list[str]) -> None:
    rng = random.Random(SEED + 1)
    records = [{"instruction": f"Summarize: {t[:80]}", "input": "" if i % 3 else t[80:160],
                "output": " ".join(rng.sample(t.split(), min(8, len(t.split()))))}
               for i, t in enumerate(texts)]
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", records[:224]), ("valid", records[224:])):
        (out / f"alpaca_zh-{name}-general.json").write_text(json.dumps(part, ensure_ascii=False, indent=1))


def make_all(out: str | Path = ".a4ray/standins") -> dict[str, Path]:
    """Make every stand-in under `out` (kept if already made by this version). Returns name -> path. A relative
    `out` is under the local root (the directory a simulated cluster started in, else this one), where the
    spec's relative sources resolve too: however the job was started, the same files are staged."""
    out = (local_root() / out).resolve()
    made = {"qwen3-moe-tiny": out / "qwen3-moe-tiny", "qwen3-next-tiny": out / "qwen3-next-tiny",
            "qwen-datasets": out / "qwen-datasets", "datasets": out / "datasets"}
    stamp = out / _STAMP
    if stamp.is_file() and stamp.read_text() == VERSION and all(p.is_dir() for p in made.values()):
        return made
    # Built aside and renamed in, so a set that exists is always complete.
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        texts = corpus()
        tokenizer = make_tokenizer(tmp / "tokenizer", texts)
        make_qwen3_moe(tmp / "qwen3-moe-tiny", tmp / "tokenizer")
        make_qwen3_next(tmp / "qwen3-next-tiny", tmp / "tokenizer")
        make_mmap_dataset(tmp / "qwen-datasets" / "mmap_qwen3_datasets_text_document", tokenizer, texts)
        make_alpaca(tmp / "datasets", texts)
    shutil.rmtree(tmp / "tokenizer")
    (tmp / _STAMP).write_text(VERSION)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.rename(tmp, out)
    return made


if __name__ == "__main__":
    for name, path in make_all(sys.argv[1] if len(sys.argv) > 1 else ".a4ray/standins").items():
        print(f"{name}: {path}")
