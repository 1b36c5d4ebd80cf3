"""a4ray.mcore.dataset's tokenizer, kept: what megatron-core's datasets read of megatron-core's own tokenizer, kept in
the data cache by the first rank, builds the same GPTDataset (the same index-cache hash, pad id and samples) in a
later process that imports neither transformers nor megatron-core's tokenizer. No cluster: real megatron-core, and
tokenizer files made by the stand-ins' own code (a byte-level BPE saved as Qwen's is)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from a4ray.mcore import dataset

# One process's view: the tokenizer it got, the dataset megatron-core built with it, and whether transformers came in.
_PROBE = """
import json, sys
from a4ray.mcore import dataset
tok = dataset.tokenizer(sys.argv[1], sys.argv[3])
ds = dataset.gpt_dataset(sys.argv[2], seq_len=16, num_samples=8, seed=1234, tok=tok, cache_dir=sys.argv[3],
                         explicit_mask=True)
print(json.dumps({"tokenizer": type(tok).__name__, "hash": ds.unique_description_hash, "pad": ds._pad_token_id,
                  "samples": [[ds[i]["tokens"].tolist(), ds[i]["loss_mask"].tolist()] for i in range(4)],
                  "transformers": "transformers" in sys.modules}))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Tokenizer files whose pad (<|endoftext|>) and end of sequence (<|im_end|>, as Qwen3's chat models name it)
    differ, and a Megatron indexed dataset tokenized with them."""
    from a4ray.staging.standins import corpus, make_mmap_dataset, make_tokenizer

    root = tmp_path_factory.mktemp("tok")
    texts = corpus(64)
    made = make_tokenizer(root / "model", texts)
    config = root / "model" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "eos_token": "<|im_end|>"}))
    make_mmap_dataset(root / "data" / "text_document", made, texts)
    return root


def _probe(model: Path, cache: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, str(model / "model"), str(model / "data" / "text_document"),
                           str(cache)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_kept_tokenizer_builds_the_same_dataset_without_transformers(model, tmp_path):
    first = _probe(model, tmp_path / "cache")
    assert first["tokenizer"] != "TokenizerReads" and first["transformers"]
    assert first["pad"] == 0  # <|endoftext|>: no collision with <|im_end|>, so megatron-core keeps it and masks it
    (kept,) = (tmp_path / "cache").glob("tokenizer-*.json")
    assert set(json.loads(kept.read_text())) == {"vocab_size", "eod", "eos", "pad", "unique_identifiers"}

    again = _probe(model, tmp_path / "cache")
    assert again["tokenizer"] == "TokenizerReads" and not again["transformers"]
    assert {k: again[k] for k in ("hash", "pad", "samples")} == {k: first[k] for k in ("hash", "pad", "samples")}
    assert any(0.0 in mask for _, mask in again["samples"])  # the pad's loss mask is in what was compared


def test_changed_tokenizer_files_are_read_again(model, tmp_path):
    """Another pad token (the files' content is the key): megatron-core's tokenizer answers again, not the record."""
    cache = tmp_path / "cache"
    before = dataset.tokenizer(model / "model", cache)
    config = model / "model" / "tokenizer_config.json"
    original = config.read_text()
    try:
        config.write_text(json.dumps({**json.loads(original), "pad_token": "<|im_start|>"}))
        after = dataset.tokenizer(model / "model", cache)
        assert type(after).__name__ != "TokenizerReads" and (before.pad, after.pad) == (0, 1)
        assert dataset.tokenizer(model / "model", cache).pad == 1 and len(list(cache.glob("tokenizer-*.json"))) == 2
    finally:
        config.write_text(original)


def test_reads_lack_what_the_tokenizer_lacked():
    reads = dataset.TokenizerReads({"eod": 5})
    assert reads.eod == 5
    with pytest.raises(AttributeError):
        reads.special_tokens_dict  # megatron-core's datasets fall back to eos / eod, as with its tokenizer
