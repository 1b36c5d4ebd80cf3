"""The train step with the Megatron trainer: torchrun of `a4ray.mcore` on every node, one process per GPU.

Each rank builds megatron-core's GPTModel from the staged HF config.json (`a4ray.mcore.model`), loads the
checkpoint the convert step wrote (the native converter's: megatron-core's own layout, so the convert step
always converts natively for this trainer), trains on the staged Megatron `.bin/.idx` through
megatron-core's GPTDataset with the spec's tp/pp/cp/ep/etp, and saves in Megatron-LM's layout in
`<train.output>/checkpoint` (`iter_0000010/`, `latest_checkpointed_iteration.txt`). A relaunch, a rerun
or a restart after a lost node resumes from the newest complete checkpoint there.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from a4ray.core.errors import UnsupportedModel
from a4ray.core.node_history import NodeHistory
from a4ray.mcore.architecture import Architecture
from a4ray.mcore.checkpoint_dirs import newest_complete
from a4ray.mcore.names import TRACKER
from a4ray.runtime.launch import GangResult, Launch, NodeContext
from a4ray.runtime.notice import NOTICE_SIGNAL
from a4ray.spec.conversion import ConvertSpec
from a4ray.trainers.interface import LoopResult, Trainer, fit_problems
from a4ray.workloads.torchrun import torchrun


class MegatronTrain(Trainer):
    """The train step with trainer `megatron`: a4ray's Megatron trainer on every node (see the module)."""

    name = kind = "megatron"
    checks_model = True

    @property
    def data(self) -> str:
        return self.spec.on_nodes(self.workspace, self.spec.train.pretrain_data)

    @property
    def model(self) -> str:
        """The HF checkpoint it trains (its config.json), as the nodes see it."""
        return self.spec.on_nodes(self.workspace, self.spec.train.model)

    def runs(self) -> str:
        return ("a4ray's Megatron trainer: torchrun of a4ray.mcore on every node (megatron-core GPTModel from the "
                "converted checkpoint)")

    @property
    def checkpoints(self) -> str:
        return str(PurePosixPath(self.output) / "checkpoint")

    def problems(self) -> list[str]:
        t = self.spec.train
        if t.mode != "pretrain":
            return [f"train.mode={t.mode}: the Megatron trainer pretrains on the Megatron .bin/.idx "
                    "(train.pretrain_data); SFT runs with train.trainer=pai or torch"]
        return []

    def convert_section(self, section: ConvertSpec) -> ConvertSpec:
        # It loads megatron-core's GPTModel layout, which the native converter writes (Pai's converter writes
        # Pai's own model); either naming loads, whichever layer spec the nodes build.
        return section.model_copy(update={"backend": "native"})

    def check_model(self, config: dict, where: str) -> list[str]:
        """The staged model against the parallelism: what megatron-core would refuse minutes in."""
        try:
            arch = Architecture.from_config(config, where)
        except (UnsupportedModel, KeyError) as error:
            return [f"train.model: {error}"]
        par, field = self.spec.train.parallelism()
        return fit_problems(field, par, where, experts=arch.experts, heads=arch.heads, groups=arch.groups,
                            layers=arch.layers)

    def inputs(self) -> dict[str, str]:
        return {"the model's config.json (train.model)": f"{self.model}/config.json",
                "the converted checkpoint's tracker (convert)": str(PurePosixPath(self.checkpoint) / TRACKER),
                **{f"the dataset (train.pretrain_data) .{ext}": f"{self.data}.{ext}" for ext in ("bin", "idx")}}

    def trainer_args(self) -> list[str]:
        t = self.spec.train
        m, par = t.megatron, t.megatron.parallel
        args = ["--model", self.model, "--load", self.checkpoint, "--data-path", self.data, "--save", self.checkpoints,
                "--seq-length", str(t.seq_len), "--micro-batch-size", str(t.micro_batch_size),
                "--global-batch-size", str(self.spec.global_batch), "--train-iters", str(t.iterations),
                "--lr", f"{t.lr:g}", "--min-lr", f"{t.min_lr:g}", "--lr-warmup-iters", str(t.warmup_iterations),
                "--lr-decay-style", m.lr_decay_style, "--weight-decay", f"{m.weight_decay:g}",
                "--clip-grad", f"{m.grad_clip:g}", "--tp", str(par.tp), "--pp", str(par.pp), "--cp", str(par.cp),
                "--ep", str(par.ep), "--etp", str(par.etp), "--distributed-optimizer", m.distributed_optimizer,
                "--naming", m.layers, "--save-interval", str(t.save_interval), "--keep", str(m.keep_checkpoints),
                "--log-interval", str(t.log_interval), "--seed", str(m.seed), "--backend", m.backend,
                "--precision", m.precision, "--exit-signal-handler", "--exit-signal", NOTICE_SIGNAL.name,
                "--notice-grace-s", f"{self.spec.cluster.notice_grace_s:g}"]
        if m.check_save:
            args.append("--check-save")
        if m.async_save:
            args.append("--async-save")
        if par.sp and par.tp > 1:
            args.append("--sequence-parallel")
        if m.aux_loss_coeff is not None:
            args += ["--aux-loss-coeff", f"{m.aux_loss_coeff:g}"]
        if m.threads:
            args += ["--threads", str(m.threads)]
        if "auto" in (t.save_interval, t.local_save_interval):  # dt* needs each node's failure rate
            rate = NodeHistory(self.workspace).failure_rate()
            args += ["--failures-per-1000-node-days", f"{rate.per_1000_node_days:.4g}",
                     "--failure-rate-source", rate.source]
        return args

    def local_checkpoint_args(self, nnodes: int, gpus: int) -> list[str]:
        """Megatron-LM's local checkpoint flags for a launch of `nnodes` x `gpus` (none when they are off)."""
        t = self.spec.train
        if not t.local_save_interval:
            return []
        args = ["--non-persistent-save-interval", str(t.local_save_interval), "--non-persistent-ckpt-type", "local"]
        if self.spec.storage.local_checkpoints:
            args += ["--non-persistent-local-ckpt-dir", self.spec.storage.local_checkpoints]
        if self.local_replication(nnodes) is None:
            args += ["--replication", "--replication-jump", str(gpus), "--replication-factor", str(t.local_replicas)]
        return args

    def local_replication(self, nnodes: int) -> str | None:
        """Why the local checkpoints are not replicated on `nnodes` nodes, or None where they are."""
        replicas = self.spec.train.local_replicas
        if replicas == 1:
            return "train.local_replicas is 1"
        if nnodes < replicas or nnodes % replicas:
            return f"{nnodes} node(s) is not a multiple of train.local_replicas={replicas}"
        return None

    def launch(self, node: NodeContext) -> Launch:
        argv = ["-m", "a4ray.mcore", *self.trainer_args(), *self.local_checkpoint_args(node.nnodes, node.gpus)]
        return Launch(argv=torchrun(node, argv), nproc=node.gpus, saves_on_notice=True)

    def straggler_check(self) -> str:
        return ("on: every rank's own compute per step (forward and backward before the gradient reduction, less "
                "their collectives), judged per logging window (observe.straggler)")

    def plan_lines(self) -> list[str]:
        m = self.spec.train.megatron
        layers = {"auto": "Transformer Engine's where it imports on the nodes (A4 images), else megatron-core's "
                          "local layers", "te": "Transformer Engine's", "local": "megatron-core's local layers"}
        t, nodes = self.spec.train, self.spec.cluster.nodes
        where = self.spec.storage.local_checkpoints or "each node's RAM disk (/dev/shm)"
        unreplicated = self.local_replication(nodes)
        local = (f"local checkpoints: {_every(t.local_save_interval)} in {where}, "
                 + (f"not replicated ({unreplicated})" if unreplicated else
                    f"each rank's part held on {t.local_replicas} nodes")) if t.local_save_interval else \
            "local checkpoints: off (train.local_save_interval)"
        return [f"model: {self.shape()}",
                f"layers: {layers[m.layers]}; loads {self.checkpoint}; checkpoints: {self.checkpoints}",
                f"checkpoints {_every(t.save_interval)}, "
                + ("written in the background (async)" if m.async_save else "synchronous") + f"; {local}"]

    def shape(self) -> str:
        """The model every rank builds, and where that is read from (`model_config`)."""
        found = self.model_config()
        if found is None:
            return f"read on the nodes from {self.model}/config.json (not staged yet)"
        config, where = found
        try:
            return f"{Architecture.from_config(config, where).describe()} (from {where})"
        except (UnsupportedModel, KeyError) as error:
            return f"{where}: {error}"

    def checkpoints_kept(self) -> int | None:
        return self.spec.train.megatron.keep_checkpoints or None

    def resume_note(self) -> str:
        done = newest_complete(Path(self.checkpoints))  # where the driver sees the workspace; else the ranks find it
        local = self.spec.train.local_save_interval
        if local:  # on the nodes only: the ranks find them and say which they load
            return (f"the trainer resumes from checkpoint iteration {done} or a newer local one ({_every(local)})" if done
                    else f"the trainer resumes from its newest local or persistent checkpoint ({self.checkpoints}), "
                    "if any")
        return (f"the trainer resumes from checkpoint iteration {done}" if done else
                f"the trainer resumes from its newest checkpoint in {self.checkpoints}, if any")

    def outputs(self, result) -> dict[str, str]:
        checkpoint = getattr(result, "checkpoint", "")
        return {**super().outputs(result), "checkpoints": self.checkpoints,
                **({"checkpoint": checkpoint} if checkpoint else {})}

    def result(self, gang: GangResult) -> MegatronTrainResult:
        return MegatronTrainResult.of(gang)


class MegatronTrainResult(LoopResult):
    """The Megatron trainer's record (from the last rank, where the loss is)."""

    kind: str = "megatron"


def _every(interval: int | str) -> str:
    return ("auto: every dt* = sqrt(2 w / (N r_f)) at the run's pace, w each save's measured blocking time"
            if interval == "auto" else f"every {interval} iteration(s)")
