"""Training progress parsed from the lines trainers print.

Megatron-LM, Pai-Megatron-Patch, Megatron-SWIFT and a4ray's own trainer all print one line per logged
iteration of the form::

     [2026-11-21 12:00:00] iteration       10/     100 | consumed samples:   640 | elapsed time per
     iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 123.4 | learning rate: 1.0E-05 |
     global batch size:    64 | lm loss: 1.234567E+00 | grad norm: 0.123 | ...

so one parser reads them all: the `iteration N/M` segment, then every `name: number` segment.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)")
_SEGMENT = re.compile(r"^\s*([A-Za-z][A-Za-z0-9 _/()\-.]*?)\s*:\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")

# Names as trainers print them -> the fields a4ray keeps.
_FIELDS = {
    "consumed samples": "consumed_samples",
    "elapsed time per iteration (ms)": "step_time_ms",
    "throughput per GPU (TFLOP/s/GPU)": "tflops_per_gpu",
    "TFLOP/s/GPU": "tflops_per_gpu",
    "learning rate": "learning_rate",
    "global batch size": "global_batch_size",
    "lm loss": "loss",
    "loss": "loss",
    "grad norm": "grad_norm",
    "tokens per second": "tokens_per_s",
    "tokens/s": "tokens_per_s",
    "number of skipped iterations": "skipped_iterations",
    "number of nan iterations": "nan_iterations",
}


class Progress(BaseModel):
    iteration: int
    train_iters: int
    consumed_samples: float | None = None
    step_time_ms: float | None = None
    tflops_per_gpu: float | None = None
    learning_rate: float | None = None
    global_batch_size: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    skipped_iterations: float | None = None
    nan_iterations: float | None = None
    extra: dict[str, float] = {}

    def tokens_per_second(self, seq_length: int | None) -> float | None:
        """As printed, else derived from global batch size x sequence length / step time."""
        if self.tokens_per_s is not None:
            return self.tokens_per_s
        if seq_length and self.global_batch_size and self.step_time_ms:
            return self.global_batch_size * seq_length / (self.step_time_ms / 1000)
        return None


def parse_progress(line: str) -> Progress | None:
    """The progress in one line, or None if the line is not an iteration line."""
    match = _ITERATION.search(line)
    if not match or "|" not in line:
        return None
    values: dict[str, float] = {}
    extra: dict[str, float] = {}
    for segment in line[match.end():].split("|"):
        kv = _SEGMENT.match(segment)
        if not kv:
            continue
        name, value = kv.group(1).strip(), float(kv.group(2))
        field = _FIELDS.get(name)
        if field and field not in values:
            values[field] = value
        elif not field:
            extra[name] = value
    return Progress(iteration=int(match.group(1)), train_iters=int(match.group(2)), extra=extra, **values)


def history(log_dir: str | Path) -> list[Progress]:
    """Every iteration logged in a launch's rank logs (`rank-*.log`), by iteration. Ranks that print the
    same iteration agree; an iteration repeated after a restart replaces the earlier one."""
    by_iteration: dict[int, Progress] = {}
    for log in sorted(Path(log_dir).glob("rank-*.log")):
        with open(log, errors="replace") as f:
            for line in f:
                progress = parse_progress(line)
                if progress is not None:
                    by_iteration[progress.iteration] = progress
    return [by_iteration[i] for i in sorted(by_iteration)]


def progress_summary(p: Progress, seq_length: int | None = None) -> str:
    parts = [f"iteration {p.iteration}/{p.train_iters}"]
    if p.step_time_ms is not None:
        parts.append(f"{p.step_time_ms / 1000:.3g} s/it")
    tokens = p.tokens_per_second(seq_length)
    if tokens is not None:
        parts.append(f"{tokens:,.0f} tokens/s")
    if p.loss is not None:
        parts.append(f"loss {p.loss:.4g}")
    if p.tflops_per_gpu is not None:
        parts.append(f"{p.tflops_per_gpu:.1f} TFLOP/s/GPU")
    if p.grad_norm is not None:
        parts.append(f"grad norm {p.grad_norm:.3g}")
    return " | ".join(parts)
