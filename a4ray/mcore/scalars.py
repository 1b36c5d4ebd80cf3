"""The Megatron trainer's TensorBoard scalars, as Megatron-LM writes them (megatron/training/training.py,
`training_log`: one writer on the last rank, tags `lm loss`, `learning-rate`, `grad-norm`, `iteration-time`,
`batch-size`, `loss-scale`, per iteration), plus what a4ray adds: `tokens-per-sec`, and each node's own step
time (`node-step-time/node-<N>`, written by the node's local rank 0). Under `<train.output>/tensorboard` by
default: `tensorboard --logdir <that directory>`.
"""

from __future__ import annotations

import os
from pathlib import Path


class Scalars:
    """This rank's TensorBoard writer: the last rank writes the run's scalars, each node's local rank 0 its step
    time; every other rank writes nothing. Where TensorBoard is not installed, nothing is written (`why_not`)."""

    def __init__(self, directory: Path, *, last_rank: bool, node: int, node_lead: bool):
        self.directory = directory
        self.last_rank = last_rank
        self.node = node
        self.node_lead = node_lead
        self.why_not = ""
        self._writer = None
        if last_rank or node_lead:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # an image without tensorboard: train on, say so
                self.why_not = f"TensorBoard is not installed ({e})"
                return
            directory.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(log_dir=str(directory), max_queue=1000)

    @classmethod
    def for_this_rank(cls, directory: Path, *, last_rank: bool) -> Scalars:
        return cls(directory, last_rank=last_rank, node=int(os.environ.get("GROUP_RANK", "0")),
                   node_lead=os.environ.get("LOCAL_RANK", "0") == "0")

    def node_step(self, iteration: int, step_s: float) -> None:
        if self._writer is not None and self.node_lead:
            self._writer.add_scalar(f"node-step-time/node-{self.node}", step_s, iteration)

    def training(self, iteration: int, *, losses: dict[str, float], lr: float, grad_norm: float | None,
                 step_s: float, batch_size: int, tokens_per_step: int, loss_scale: float) -> None:
        if self._writer is None or not self.last_rank:
            return
        w = self._writer
        for key, value in losses.items():
            w.add_scalar(key, value, iteration)
        w.add_scalar("learning-rate", lr, iteration)
        if grad_norm is not None:
            w.add_scalar("grad-norm", grad_norm, iteration)
        w.add_scalar("iteration-time", step_s, iteration)
        w.add_scalar("batch-size", batch_size, iteration)
        w.add_scalar("loss-scale", loss_scale, iteration)
        w.add_scalar("tokens-per-sec", tokens_per_step / max(step_s, 1e-9), iteration)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
