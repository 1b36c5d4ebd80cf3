"""Specs of the train step: what every trainer shares (mode, data, batch sizes, schedule, output) and each
trainer's own section: Pai-Megatron-Patch (`pai:`), a4ray's built-in torch trainer (`torch:`), ms-swift.

Paths are relative to the workspace (shared storage on A4, the local workspace on an embedded cluster)
unless absolute.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from a4ray.spec.fields import Arg, EnvVars, NonNegativeInt, Number, PathStr, PositiveFloat, PositiveInt, Spec


class ParallelSpec(Spec):
    """Megatron parallelism. Data parallelism is what is left: GPUs / (tp * pp * cp)."""

    tp: PositiveInt = Field(1, description="tensor parallel")
    pp: PositiveInt = Field(1, description="pipeline parallel")
    cp: PositiveInt = Field(1, description="context parallel")
    ep: PositiveInt = Field(1, description="expert parallel")
    etp: PositiveInt = Field(1, description="expert tensor parallel")
    sp: bool = Field(True, description="sequence parallel (takes effect only with tp > 1)")

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp


class PaiSpec(Spec):
    """Pai-Megatron-Patch's `examples/<model>/run_mcore_qwen3.sh`: the fields its 27 positional arguments and
    its `MP_*` environment knobs are built from (a4ray/trainers/pai.py)."""

    repo: PathStr = Field("Pai-Megatron-Patch", description="the staged, pinned checkout (with its Megatron-LM submodules)")
    script: PathStr = Field("examples/qwen3_next/run_mcore_qwen3.sh", description="the run script, relative to the repo")
    model_size: str = Field("A3B", description="MODEL_SIZE: a size the script defines (qwen3_next: A3B)")
    load: PathStr = Field("", description="PRETRAIN_CHECKPOINT_PATH: the Megatron checkpoint (with the HF tokenizer "
                      "files) to start from; default: the convert step's output")
    precision: Literal["bf16", "fp16", "fp8"] = "bf16"
    parallel: ParallelSpec = ParallelSpec(ep=8)
    distributed_optimizer: bool = Field(True, description="DO: --use-distributed-optimizer (ZeRO-1)")
    flash_attention: bool = Field(True, description="FL: flash attention (true) or TE fused attention (false)")
    recompute: Literal["sel", "full", "offload", "none"] = Field("none", description="AC: activation checkpointing")
    recompute_layers: PositiveInt | None = Field(None, description="MP_AC_LAYERS: layers per recompute/offload "
                                                 "chunk for recompute=full|offload (Pai's default: 1)")
    optimizer_offload: Number | None = Field(None, gt=0, le=1, description="OPTIMIZER_OFFLOAD: the fraction of the "
                                            "optimizer kept on the CPU (None: off); needs distributed_optimizer")
    pad_len: PositiveInt | None = Field(None, description="PAD_LEN (--max-padding-length): what JSON SFT samples "
                                        "are padded to; default: train.seq_len")
    sft_packing: bool = Field(False, description="MP_SFT_PACKING: packed SFT samples (reset position ids)")
    virtual_pipeline_layers: PositiveInt | None = Field(None, description="MP_VP: layers per virtual pipeline stage")
    first_stage_layers: PositiveInt | None = Field(None, description="MP_PP0_LAYERS: layers of the first pipeline "
                                                   "stage (uneven split; needs pp > 1)")
    omp_num_threads: PositiveInt = 12
    env: EnvVars = Field(default_factory=dict, description="extra environment of the run script")


class TorchTrainerSpec(Spec):
    """a4ray's built-in trainer (a4ray/trainer): a Hugging Face causal LM under DDP; the local rehearsal's
    trainer, and on A4 a cheap canary of data, checkpoint and fabric before the expensive job."""

    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl on GPUs, gloo on CPU")
    precision: Literal["auto", "bf16", "fp32"] = Field("auto", description="auto: bf16 autocast on GPUs, fp32 on CPU")
    num_layers: PositiveInt | None = Field(None, description="keep only the first N layers of the model (a canary "
                                           "of a model too large to train whole under DDP)")
    weight_decay: Number = Field(0.01, ge=0)
    grad_clip: PositiveFloat = 1.0
    seed: NonNegativeInt = 1234
    keep_checkpoints: PositiveInt = Field(2, description="checkpoints kept (the newest)")
    threads: PositiveInt | None = Field(None, description="CPU threads per rank (default: CPUs / local ranks)")


class MegatronTrainerSpec(Spec):
    """a4ray's Megatron trainer (a4ray/mcore): megatron-core's GPTModel built from the staged HF config, trained
    from the convert step's checkpoint with megatron-core's DDP, optimizer and datasets, saving and resuming
    in Megatron-LM's own checkpoint layout."""

    parallel: ParallelSpec = Field(ParallelSpec(), description="tp/pp/cp/ep/etp (sp: with tp > 1)")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl on GPUs, gloo on CPU")
    precision: Literal["auto", "bf16", "fp32"] = Field("auto", description="auto: bf16 on GPUs, fp32 on CPU")
    layers: Literal["auto", "te", "local"] = Field(
        "auto", description="megatron-core's layer spec: Transformer Engine's (te) where it imports (A4 images), "
        "else its local layers; the converted checkpoint of either naming loads")
    distributed_optimizer: Literal["auto", "on", "off"] = Field(
        "auto", description="auto: megatron-core's distributed optimizer where the backend has reduce-scatter")
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: Number = Field(0.1, ge=0)
    grad_clip: PositiveFloat = 1.0
    aux_loss_coeff: Number | None = Field(None, ge=0, description="the routers' load-balancing loss coefficient "
                                         "(default: the HF config's router_aux_loss_coef)")
    seed: NonNegativeInt = 1234
    keep_checkpoints: NonNegativeInt = Field(0, description="checkpoints kept, the newest (0: all)")
    async_save: bool = Field(True, description="interval saves block training only for the copy of the state and are "
                             "written in the background (Megatron-LM's --async-save); the last save and a save on "
                             "notice are synchronous (check_save checks those)")
    check_save: bool = Field(False, description="load every checkpoint back through megatron-core after saving it "
                             "and compare every model and optimizer tensor with what was saved")
    threads: PositiveInt | None = Field(None, description="CPU threads per rank (default: CPUs / local ranks)")


class TrainSpec(Spec):
    """The train step of the Pai recipes (`a4ray.qwen3_next`, `a4ray.qwen3`)."""

    trainer: Literal["pai", "torch", "megatron"] = Field(
        "pai", description="pai: Pai-Megatron-Patch; megatron: a4ray's Megatron-core trainer; torch: the built-in "
        "Hugging Face/DDP trainer")
    mode: Literal["pretrain", "sft"] = Field("pretrain", description="pretrain on pretrain_data, or SFT (sft_data)")
    sft_data: Literal["json", "mmap"] = Field(
        "json", description="sft: the Alpaca JSON (Pai's MP_DATASET_TYPE=raw) or an SFT idxmap (train.sft_mmap)")
    model: PathStr = Field("", description="the Hugging Face checkpoint: the converter's input, the torch trainer's model")
    pretrain_data: PathStr = Field("datasets/qwen-mmap/mmap_qwen3_datasets_text_document",
                               description="Megatron indexed dataset prefix (.bin/.idx) for pretraining")
    sft_json: PathStr = Field("datasets/alpaca/alpaca_zh-train-general.json", description="sft: the training JSON")
    sft_json_valid: PathStr = Field("datasets/alpaca/alpaca_zh-valid-general.json",
                                    description="sft: the validation JSON")
    sft_mmap: PathStr = Field("", description="SFT idxmap prefix (Pai's toolkits/sft_data_preprocessing output)")
    micro_batch_size: PositiveInt = Field(1, description="samples per rank in one forward and backward pass")
    global_batch_size: PositiveInt | None = Field(None, description="default: micro_batch_size x data-parallel size")
    lr: PositiveFloat = Field(1e-5, description="the learning rate after warmup, decayed to min_lr")
    min_lr: Number = Field(1e-6, ge=0, description="the learning rate at the end of the decay")
    seq_len: PositiveInt = Field(1024, description="tokens per sample")
    iterations: PositiveInt = Field(100, description="training iterations (Pai pretraining takes tokens: a4ray "
                                    "passes iterations x global batch x seq_len)")
    warmup_iterations: NonNegativeInt = Field(10, description="iterations the learning rate warms up over, to lr")
    save_interval: PositiveInt | Literal["auto"] = Field(
        1000, description="iterations between checkpoints; auto (megatron trainer): the interval Meta's ETTR model "
        "finds best, dt* = sqrt(2 w / (N r_f)), from each save's measured blocking time w, the N nodes and their failure "
        "rate r_f, at the run's pace")
    local_save_interval: NonNegativeInt | Literal["auto"] = Field(
        0, description="megatron trainer: iterations between local checkpoints (0: none; auto as save_interval): each "
        "rank's part in its node's RAM disk (storage.local_checkpoints), replicated on local_replicas nodes; a restart "
        "resumes from the newest of these and the persistent ones")
    local_replicas: PositiveInt = Field(
        2, description="nodes holding each rank's local checkpoint, its own included (1: not replicated); the node "
        "count must be a multiple of it, else the plan says the local checkpoints are not replicated")
    log_interval: PositiveInt = Field(1, description="torch trainer: iterations between log lines")
    output: PathStr = Field("", description="where logs, TensorBoard and checkpoints go (Pai's OUTPUT_BASEPATH); "
                        "default: logs/output_<trainer>_<job kind>_<mode>")
    pai: PaiSpec = PaiSpec()
    torch: TorchTrainerSpec = TorchTrainerSpec()
    megatron: MegatronTrainerSpec = MegatronTrainerSpec()

    @model_validator(mode="after")
    def _schedule(self) -> Self:
        if self.trainer != "megatron":
            for name in ("save_interval", "local_save_interval"):
                if getattr(self, name) == "auto":
                    raise ValueError(f"train.{name}=auto: only a4ray's Megatron trainer (train.trainer=megatron) sets "
                                     f"its interval from the model; give the {self.trainer} trainer a number")

        if self.warmup_iterations >= self.iterations:
            raise ValueError(f"train.warmup_iterations={self.warmup_iterations} must be below train.iterations="
                             f"{self.iterations} (the learning rate decays over the iterations after warmup)")
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr={self.min_lr:g} is above train.lr={self.lr:g}")
        return self

    def parallelism(self) -> tuple[ParallelSpec, str]:
        """The trainer's parallelism and its field (the built-in trainer is data-parallel only)."""
        return {"pai": (self.pai.parallel, "train.pai.parallel"), "torch": (ParallelSpec(), "train"),
                "megatron": (self.megatron.parallel, "train.megatron.parallel")}[self.trainer]

    def sequence(self) -> tuple[str, int]:
        """The field and value of the sequence length (context parallelism splits it)."""
        return "train.seq_len", self.seq_len

    @property
    def data(self) -> str:
        """The training data path the mode reads."""
        if self.mode == "pretrain":
            return self.pretrain_data
        return self.sft_json if self.sft_data == "json" else self.sft_mmap


class SwiftTrainSpec(Spec):
    """ms-swift's `megatron rlhf --rlhf_type dpo` (a4ray/trainers/swift.py builds the flags for `version`). A field
    without a description is the ms-swift flag of its name (`moe_grouped_gemm: true`: `--moe_grouped_gemm true`)."""

    trainer: Literal["swift"] = "swift"
    version: str = Field("3.8.0", pattern=r"^\d+\.\d+(\.\d+)?$", description="the ms-swift version in the image: "
                         "< 3.12 trains from an mcore checkpoint (--load), 3.12+ and 4.x from the HF weights (--model)")
    model: PathStr = Field("ckpts/huggingface/Qwen3-30B-A3B-Instruct-2507", description="the Hugging Face checkpoint")
    load: PathStr = Field("", description="ms-swift < 3.12: the mcore checkpoint for --load; default: the convert output")
    dataset: list[str] = Field(default_factory=lambda: ["AI-ModelScope/orpo-dpo-mix-40k"],
                               description="ModelScope/HF dataset ids or staged paths (relative to the workspace)")
    split_dataset_ratio: Number = Field(0.01, ge=0, lt=1)
    packing: bool = Field(True, description="pack samples (DPO packing needs ms-swift >= 3.8)")
    parallel: ParallelSpec = ParallelSpec(tp=4, ep=8, etp=1)
    moe_permute_fusion: bool = True
    moe_grouped_gemm: bool = True
    moe_shared_expert_overlap: bool = True
    moe_aux_loss_coeff: Number = Field(1e-3, ge=0)
    micro_batch_size: PositiveInt = 1
    global_batch_size: PositiveInt = 4
    recompute: Literal["full", "selective", "none"] = Field("full", description="--recompute_granularity (none: not "
                                                            "passed)")
    recompute_method: Literal["uniform", "block"] = "uniform"
    recompute_num_layers: PositiveInt = 1
    epochs: PositiveInt = Field(1, description="--max_epochs (4.x: --num_train_epochs)")
    iterations: PositiveInt | None = Field(None, description="--train_iters (instead of whole epochs)")
    finetune: bool = True
    cross_entropy_loss_fusion: bool = True
    lr: PositiveFloat = 1e-5
    lr_warmup_fraction: Number = Field(0.05, ge=0, lt=1)
    min_lr: Number = Field(1e-6, ge=0)
    output: PathStr = Field("megatron_output/Qwen3-30B-A3B-Instruct-2507", description="--save (3.x) / --output_dir (4.x)")
    save_interval: PositiveInt = Field(200, description="--save_interval (4.x: --save_steps)")
    eval_interval: PositiveInt = Field(200, description="--eval_interval (4.x: --eval_steps)")
    max_length: PositiveInt = 8192
    num_workers: PositiveInt = Field(8, description="--num_workers (4.x: --dataloader_num_workers)")
    dataset_num_proc: PositiveInt = 8
    load_from_cache_file: bool = Field(
        True, description="--load_from_cache_file, passed on every version: reuse the preprocessed dataset in "
        "the shared MODELSCOPE_CACHE; ms-swift's default turned false in 3.10 (then every run, and every restart, "
        "preprocesses the dataset again), and its DPO examples from 3.12 on pass true")
    save_optim: bool = Field(False, description="false: --no_save_optim true")
    save_rng: bool = Field(False, description="false: --no_save_rng true")
    async_save: bool = Field(True, description="saves block training only for the copy of the state (>= 4.0: "
                             "--async_save true; before: Megatron-LM's --async-save through --extra_megatron_kwargs)")
    attention_backend: Literal["flash", "fused", "unfused", "auto"] = "flash"
    optimizer_cpu_offload: bool = True
    use_precision_aware_optimizer: bool = True
    optimizer_offload_fraction: Number = Field(1.0, gt=0, le=1)
    beta: PositiveFloat = 0.1
    rpo_alpha: Number | None = Field(
        None, ge=0, description="None: not passed, plain DPO (ms-swift's default, seed 004 and the 3.8 example); "
        "the >= 3.12 examples pass 0.1, which adds an NLL loss on the chosen answers: a different objective, "
        "so chosen here, not inherited from an example")
    loss_type: str = "sigmoid"
    modelscope_cache: PathStr = Field("modelscope-cache", description="MODELSCOPE_CACHE: must be shared storage on "
                                  "multi-node runs (ms-swift: else dataset caches diverge and the run may hang)")
    megatron_lm_path: PathStr = Field("", description="MEGATRON_LM_PATH (ms-swift 3.x clones Megatron-LM without it)")
    cuda_alloc_conf: str = Field("expandable_segments:True", description="PYTORCH_CUDA_ALLOC_CONF")
    extra_args: list[Arg] = Field(default_factory=list, description="more `megatron rlhf` flags, appended as given")
    env: EnvVars = Field(default_factory=dict)

    def parallelism(self) -> tuple[ParallelSpec, str]:
        return self.parallel, "train.parallel"

    def sequence(self) -> tuple[str, int]:
        return "train.max_length", self.max_length
