"""What the built-in trainer reads: a Megatron indexed dataset (`.bin/.idx`, read with megatron-core's
`IndexedDataset`) as fixed-length windows of its token stream, or Alpaca-style SFT JSON.

Batches are a pure function of (seed, global sample index): iteration `i` of a run with global batch `G`
takes samples `i*G ... (i+1)*G - 1` of a seeded shuffle (reshuffled each epoch), and data-parallel rank
`r` takes its slice of each micro-batch. A resumed run therefore sees exactly the batches it would have
seen, with no loader state to save; and a change of data-parallel size keeps the same global batches.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import torch

IGNORE = -100  # label of tokens that carry no loss (prompt, padding)


class TokenWindows:
    """Pretraining samples: consecutive `seq_len + 1`-token windows of the dataset's concatenated documents
    (documents carry their own end-of-document token), as Megatron's GPT dataset builds them."""

    def __init__(self, prefix: str, seq_len: int):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron-core warns that TE and apex are absent: not needed here
            from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.dataset = IndexedDataset(prefix)
        self.seq_len = seq_len
        lengths = np.asarray(self.dataset.sequence_lengths, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)])  # token offset of each document
        self.tokens = int(self.starts[-1])
        if self.tokens < seq_len + 1:
            raise ValueError(f"{prefix}: {self.tokens} tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}")

    def __len__(self) -> int:
        return (self.tokens - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        begin, end = index * self.seq_len, index * self.seq_len + self.seq_len + 1
        doc = int(np.searchsorted(self.starts, begin, side="right")) - 1
        parts = []
        while begin < end:
            offset = begin - int(self.starts[doc])
            take = min(end - begin, int(self.starts[doc + 1]) - begin)
            parts.append(self.dataset.get(doc, offset=offset, length=take))
            begin += take
            doc += 1
        window = torch.from_numpy(np.concatenate(parts).astype(np.int64))
        return window[:-1], window[1:]


class SFTRecords:
    """Alpaca-style records ({instruction, input, output}, as Pai's JSON-SFT reads them): the prompt's tokens
    and the padding carry no loss; samples are truncated or padded to `seq_len`."""

    def __init__(self, path: str, tokenizer, seq_len: int):
        records = json.loads(Path(path).read_text())
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.samples = []
        for r in records:
            prompt_text = r.get("instruction", r.get("query", "")) + r.get("input", "")
            answer = r.get("output", r.get("response", r.get("content", "")))
            if tokenizer.chat_template:
                prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt_text}],
                                                       add_generation_prompt=True)
                full = tokenizer.apply_chat_template([{"role": "user", "content": prompt_text},
                                                      {"role": "assistant", "content": answer}])
            else:
                prompt = tokenizer(prompt_text + "\n")["input_ids"]
                full = prompt + tokenizer(answer)["input_ids"] + [tokenizer.eos_token_id]
            if len(prompt) >= seq_len:
                continue  # as Pai: a prompt that fills the window teaches nothing
            full = full[: seq_len + 1]
            labels = [IGNORE] * len(prompt) + full[len(prompt):]
            full += [pad] * (seq_len + 1 - len(full))
            labels += [IGNORE] * (seq_len + 1 - len(labels))
            self.samples.append((torch.tensor(full[:-1]), torch.tensor(labels[1:])))
        if not self.samples:
            raise ValueError(f"{path}: no record fits seq_len={seq_len}")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.samples[index]


class Batches:
    """Micro-batches of one data-parallel rank, addressed by iteration (see the module docstring)."""

    def __init__(self, samples, *, seed: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int):
        assert global_batch % (micro_batch * dp_size) == 0
        self.samples, self.seed = samples, seed
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._epoch, self._order = -1, None

    @property
    def accumulation(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    def _sample(self, g: int):
        epoch, position = divmod(g, len(self.samples))
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.samples))
        return self.samples[int(self._order[position])]

    def micro_batches(self, iteration: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The `accumulation` micro-batches this rank trains on in `iteration` (0-based)."""
        out = []
        for step in range(self.accumulation):
            first = iteration * self.global_batch + (step * self.dp_size + self.dp_rank) * self.micro_batch
            pairs = [self._sample(first + k) for k in range(self.micro_batch)]
            out.append((torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])))
        return out
