"""Training data: a staged Megatron indexed dataset (`<prefix>.bin/.idx`) through megatron-core's own
classes, as Megatron-LM's pretrain_gpt builds it:

* `tokenizer(model_dir, keep_in)`: megatron-core's `MegatronTokenizer` over the model directory's Hugging Face
  tokenizer files (the dataset needs its EOD id, pad id and vocab size), or what the datasets read of it, as
  that tokenizer answered it in an earlier rank (`TokenizerReads`, kept in the data cache).
* `gpt_dataset(...)`: `GPTDataset` from `BlendedMegatronDatasetBuilder` with a `GPTDatasetConfig`; the
  document / sample / shuffle index caches go under `<save>/data_cache` (`path_to_cache`), built by
  global rank 0 first, then read by the others.
* `Batches`: Megatron-LM's pretraining sampler order. The global batch of iteration `i` (0-based) is
  samples `i*G ... (i+1)*G - 1` of the dataset (already shuffled by GPTDataset); micro-batch `k` of
  data-parallel rank `r` is samples `i*G + (k*DP + r)*mbs ...+mbs`. Ranks of one data-parallel replica
  (its TP / PP / CP ranks) read the same samples. A resumed run reads exactly the batches it would have
  read, with no loader state to save.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

# What megatron-core's datasets read of their tokenizer (MegatronDataset and GPTDataset, 0.16): the vocabulary size
# (the token dtype), the end-of-document, end-of-sequence and pad ids (the pad-collision check and the loss mask),
# special_tokens_dict where it has one, and its identifiers (part of the index caches' hash).
DATASET_READS = ("vocab_size", "eod", "eos", "pad", "special_tokens_dict", "unique_identifiers")
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")


def tokenizer(model_dir: str | Path, keep_in: str | Path | None = None):
    """megatron-core's tokenizer over the HF tokenizer files in `model_dir`, for megatron-core's datasets.

    Loading it imports transformers: ~1 CPU-s in every rank, a seventh of a tiny model's rank. With `keep_in` (the
    data cache), what the datasets read of it (DATASET_READS) is kept there once, under a key of the tokenizer's
    files, its path and megatron-core's and transformers' versions; a rank that finds it gets `TokenizerReads` and
    imports neither (every rank of a restart, and each rank after the first of a launch)."""
    kept = Path(keep_in) / f"tokenizer-{_key(model_dir)}.json" if keep_in is not None else None
    if kept is not None and kept.is_file():
        try:
            return TokenizerReads(json.loads(kept.read_text()))
        except (OSError, ValueError):
            pass  # half-written by a rank that died: made again
    from megatron.core.tokenizers import MegatronTokenizer

    # metadata as a dict: nothing is written next to the (read-only, staged) model.
    made = MegatronTokenizer.from_pretrained(tokenizer_path=str(model_dir),
                                             metadata_path={"library": "huggingface", "model_type": "gpt"})
    if kept is not None:
        reads = {}
        for name in DATASET_READS:  # what it lacks or cannot answer, TokenizerReads lacks too
            try:
                reads[name] = getattr(made, name)
            except (AttributeError, NotImplementedError):
                pass
        try:
            text = json.dumps(reads)
        except (TypeError, ValueError):  # an answer JSON cannot hold: every rank loads the tokenizer itself
            return made
        kept.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=kept.parent, prefix=f".{kept.name}.", delete=False) as f:
            f.write(text)
        os.replace(f.name, kept)
    return made


def _key(model_dir: str | Path) -> str:
    """The tokenizer's files (every file of the model directory but its weights), by content; its path as given (its
    identifiers hold it so); the versions of the code that reads them."""
    h = hashlib.sha256("\0".join([str(model_dir), *map(_version, ("megatron-core", "transformers"))]).encode())
    for f in sorted(p for p in Path(model_dir).iterdir() if p.is_file() and not p.name.endswith(_WEIGHTS)):
        h.update(f"\0{f.name}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


class TokenizerReads:
    """A tokenizer as megatron-core's datasets read it (DATASET_READS), answered as megatron-core's own tokenizer
    answered in the rank that kept it; what that one lacked, this lacks."""

    def __init__(self, reads: dict):
        self._reads = reads

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in self._reads:
            raise AttributeError(name)
        return self._reads[name]


def check_prefix(prefix: str) -> None:
    missing = [p for p in (f"{prefix}.bin", f"{prefix}.idx") if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"data prefix {prefix}: {', '.join(missing)} not found "
                                "(a Megatron indexed dataset is <prefix>.bin + <prefix>.idx)")


def gpt_dataset(prefix: str, *, seq_len: int, num_samples: int, seed: int, tok, cache_dir: str | Path,
                explicit_mask: bool):
    """The training split (all of the data) as megatron-core's GPTDataset of at least `num_samples`
    samples of `seq_len` tokens (epochs are repeated and reshuffled as needed).

    `explicit_mask`: samples carry a causal attention mask (the CPU / local attention needs one; TE's
    fused attention builds its own, as Megatron-LM's --no-create-attention-mask-in-dataloader)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    check_prefix(prefix)
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_len, blend=([prefix], None), split="100,0,0",
        path_to_cache=str(cache_dir), tokenizer=tok, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=explicit_mask, mid_level_dataset_surplus=0.005,
    )
    # Every rank builds (and reads) it: global rank 0 first, writing the index caches; mcore's builder
    # synchronises the others with a barrier.
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, None, None], lambda: True, config).build()
    return train


@dataclass
class Batches:
    """This data-parallel rank's micro-batches of each iteration (see the module docstring)."""

    dataset: object
    global_batch: int
    micro_batch: int
    dp_rank: int
    dp_size: int

    def __post_init__(self):
        if self.global_batch % (self.micro_batch * self.dp_size):
            raise ValueError(f"global batch {self.global_batch} is not a multiple of micro batch "
                             f"{self.micro_batch} x data-parallel size {self.dp_size}")

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    def indices(self, iteration: int, k: int) -> list[int]:
        """Dataset indices of micro-batch `k` of 0-based `iteration` on this rank."""
        first = iteration * self.global_batch + (k * self.dp_size + self.dp_rank) * self.micro_batch
        return list(range(first, first + self.micro_batch))

    def micro_batches(self, iteration: int) -> list[dict[str, torch.Tensor]]:
        out = []
        for k in range(self.num_microbatches):
            samples = [self.dataset[i % len(self.dataset)] for i in self.indices(iteration, k)]
            out.append({key: torch.stack([s[key] for s in samples]) for key in samples[0]})
        return out
