"""The built-in trainer's data and checkpoints, without a cluster: windows of a real Megatron .bin/.idx
(written with megatron-core's builder), SFT labels, batches that do not depend on the data-parallel size,
and the checkpoint tracker that a resume reads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from a4ray.trainer import checkpoint
from a4ray.trainer.batches import IGNORE, Batches, SFTRecords, TokenWindows


@pytest.fixture
def corpus(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 500, size=n, dtype=np.int32) for n in (7, 1, 30, 12, 5, 19)]
    prefix = tmp_path / "corpus_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for doc in docs:
        builder.add_document(torch.from_numpy(doc), [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix), np.concatenate(docs)


def test_token_windows_are_consecutive_windows_across_documents(corpus):
    prefix, stream = corpus
    windows = TokenWindows(prefix, seq_len=8)
    assert len(windows) == (len(stream) - 1) // 8 == 9
    for i in range(len(windows)):
        inputs, labels = windows[i]
        expected = torch.from_numpy(stream[i * 8: i * 8 + 9].astype(np.int64))
        assert torch.equal(inputs, expected[:-1]) and torch.equal(labels, expected[1:])
    with pytest.raises(ValueError, match="fewer than one sample"):
        TokenWindows(prefix, seq_len=len(stream))


def test_global_batches_do_not_depend_on_the_data_parallel_size(corpus):
    windows = TokenWindows(corpus[0], seq_len=4)

    def global_batch(iteration: int, dp: int, micro: int) -> list[tuple]:
        seen = []
        for rank in range(dp):
            batches = Batches(windows, seed=7, global_batch=8, micro_batch=micro, dp_rank=rank, dp_size=dp)
            for inputs, _ in batches.micro_batches(iteration):
                seen += [tuple(row.tolist()) for row in inputs]
        return sorted(seen)

    for iteration in (0, 3, 7):  # 7: past the first epoch (18 samples), reshuffled
        reference = global_batch(iteration, dp=1, micro=2)
        assert len(reference) == 8
        assert global_batch(iteration, dp=2, micro=2) == reference
        assert global_batch(iteration, dp=4, micro=1) == reference
    assert global_batch(0, 2, 2) != global_batch(1, 2, 2)
    assert Batches(windows, seed=7, global_batch=8, micro_batch=2, dp_rank=0, dp_size=2).accumulation == 2


def test_sft_records_carry_loss_only_on_the_answer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "[UNK]", "say", "hello", "to", "the", "ring", "hi", "there"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    data = tmp_path / "sft.json"
    data.write_text(json.dumps([{"instruction": "say hello ", "input": "to the ring", "output": "hi there"},
                                {"instruction": "say " * 20, "input": "", "output": "hi"}]))
    records = SFTRecords(str(data), tokenizer, seq_len=8)
    assert len(records) == 1  # the second prompt fills the window: dropped, as Pai does
    inputs, labels = records[0]
    # prompt "say hello to the ring" (5 tokens) + answer "hi there" + eos, padded to 9 then shifted
    assert inputs.tolist() == [3, 4, 5, 6, 7, 8, 9, 1]
    assert labels.tolist() == [IGNORE] * 4 + [8, 9, 1, IGNORE]


def test_checkpoint_tracker_and_run_config(tmp_path):
    assert checkpoint.latest(tmp_path) is None
    (tmp_path / checkpoint.TRACKER).write_text("20\n")
    (tmp_path / checkpoint.RUN_CONFIG).write_text(json.dumps({"lr": 0.003, "seq_len": 64}))
    assert checkpoint.latest(tmp_path) == 20
    assert checkpoint.check_config(tmp_path, {"lr": 0.003, "seq_len": 64}) == []
    assert checkpoint.check_config(tmp_path, {"lr": 0.001, "seq_len": 64}) == ["lr: 0.003 there, 0.001 now"]
    assert checkpoint.iteration_dir(tmp_path, 20).name == "iter_0000020"
