"""The train step with the built-in trainer: torchrun of `a4ray.trainer` on every node, one process per GPU.

Its checkpoints live in `<train.output>/checkpoint` (Megatron's tracker layout); a relaunch, a rerun or a
restart after a lost node resumes from the newest one.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from a4ray.runtime.launch import GangResult, Launch, NodeContext
from a4ray.trainer.checkpoint import latest
from a4ray.trainers.interface import LoopResult, Trainer
from a4ray.workloads.torchrun import torchrun
from a4ray.workloads.workload import WorkloadResult


class TorchTrainResult(LoopResult):
    kind: str = "torch"


class TorchTrain(Trainer):
    name = kind = "torch"

    @property
    def model(self) -> str:
        return self.spec.on_nodes(self.workspace, self.spec.train.model)

    @property
    def data(self) -> str:
        return self.spec.on_nodes(self.workspace, self.spec.train.data)

    def runs(self) -> str:
        return "a4ray's built-in trainer: torchrun of a4ray.trainer on every node (DDP)"

    @property
    def checkpoints(self) -> str:
        return str(PurePosixPath(self.output) / "checkpoint")

    def problems(self) -> list[str]:
        t = self.spec.train
        if t.mode == "sft" and t.sft_data == "mmap":
            return ["train.sft_data=mmap: the built-in trainer reads SFT from JSON (train.sft_data=json)"]
        return []

    def conversion_skipped(self) -> str | None:
        backend = self.spec.convert.backend
        if backend != "native":
            return ("the built-in trainer trains from the Hugging Face checkpoint (train.model); with "
                    f"train.trainer=pai this step runs the {backend} converter")
        return None

    def outputs(self, result: WorkloadResult) -> dict[str, str]:
        checkpoint = getattr(result, "checkpoint", "")
        return {**super().outputs(result), **({"checkpoint": checkpoint} if checkpoint else {})}

    def inputs(self) -> dict[str, str]:
        t = self.spec.train
        needed = {"the model's config.json (train.model)": f"{self.model}/config.json"}
        if t.mode == "pretrain":
            needed.update({f"the dataset (train.pretrain_data) .{ext}": f"{self.data}.{ext}" for ext in ("bin", "idx")})
        else:
            needed["the SFT JSON (train.sft_json)"] = self.data
        return needed

    def checkpoints_kept(self) -> int | None:
        return self.spec.train.torch.keep_checkpoints

    def trainer_args(self) -> list[str]:
        t = self.spec.train
        o = t.torch
        args = ["--model", self.model, "--mode", t.mode, "--data", self.data, "--save", self.checkpoints,
                "--seq-len", str(t.seq_len), "--micro-batch", str(t.micro_batch_size),
                "--iterations", str(t.iterations), "--warmup", str(t.warmup_iterations), "--lr", f"{t.lr:g}",
                "--min-lr", f"{t.min_lr:g}", "--weight-decay", f"{o.weight_decay:g}", "--grad-clip", f"{o.grad_clip:g}",
                "--save-interval", str(t.save_interval), "--log-interval", str(t.log_interval),
                "--keep", str(o.keep_checkpoints), "--seed", str(o.seed), "--backend", o.backend,
                "--precision", o.precision, "--global-batch", str(self.spec.global_batch)]
        if o.num_layers:
            args += ["--num-layers", str(o.num_layers)]
        if o.threads:
            args += ["--threads", str(o.threads)]
        return args

    def launch(self, node: NodeContext) -> Launch:
        return Launch(argv=torchrun(node, ["-m", "a4ray.trainer", *self.trainer_args()]), nproc=node.gpus)

    def resume_note(self) -> str:
        done = latest(Path(self.checkpoints))  # where the driver sees the workspace; else the trainer finds it
        return (f"the trainer resumes from checkpoint iteration {done}" if done else
                f"the trainer resumes from its newest checkpoint in {self.checkpoints}, if any")

    def result(self, gang: GangResult) -> TorchTrainResult:
        return TorchTrainResult.of(gang)
