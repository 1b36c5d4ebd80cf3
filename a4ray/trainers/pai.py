"""Pai-Megatron-Patch's `examples/<model>/run_mcore_qwen3.sh` as a gang workload.

Every node runs `bash run_mcore_qwen3.sh dlc <26 more positional arguments>` from the script's directory
(it resolves the patch and its pinned Megatron-LM from there, and starts `pretrain_*.py` by a relative path).
The arguments are built from typed fields, in the script's order (Pai-Megatron-Patch a098ca5):

     1 ENV=dlc  2 MODEL_SIZE  3 BATCH_SIZE  4 GLOBAL_BATCH_SIZE  5 LR  6 MIN_LR  7 SEQ_LEN  8 PAD_LEN  9 PR
    10 TP  11 PP  12 CP  13 ETP  14 EP  15 SP  16 DO  17 FL  18 SFT  19 AC  20 OPTIMIZER_OFFLOAD
    21 SAVE_INTERVAL  22 DATASET_PATH  23 VALID_DATASET_PATH  24 PRETRAIN_CHECKPOINT_PATH
    25 TRAIN_TOKENS_OR_ITERS  26 WARMUP_TOKENS_OR_ITERS  27 OUTPUT_BASEPATH

In `dlc` mode the script reads the PAI-DLC contract, set here in the workload's env layer on every node:
WORLD_SIZE = the number of nodes, RANK = this node's rank (not torchrun's meanings: the script starts one
torchrun per node itself), KUBERNETES_CONTAINER_RESOURCE_GPU = GPUs per node, MASTER_ADDR, MASTER_PORT.

`check()` refuses, before a GPU is taken, what the script or Megatron would reject minutes into the job;
`check_inputs()` looks at the staged files on a node (the checkpoint must hold the tokenizer files, the
model's shape must be the one the script hard-codes). Sources: Pai-Megatron-Patch a098ca5's
`examples/qwen3/run_mcore_qwen3.sh` and `examples/qwen3_next/run_mcore_qwen3.sh` (tests/upstream.py names the lines).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import PurePosixPath

from a4ray.hf2mcore.backends import pai_contract_env, pai_script
from a4ray.observe.progress import parse_progress
from a4ray.runtime.launch import GangResult, Launch, NodeContext
from a4ray.spec.conversion import ConvertSpec
from a4ray.spec.recipes import RecipeJob
from a4ray.spec.train import TrainSpec
from a4ray.trainers.interface import Trainer, fit_problems
from a4ray.workloads.workload import WorkloadResult

ARG_NAMES = (
    "ENV", "MODEL_SIZE", "BATCH_SIZE", "GLOBAL_BATCH_SIZE", "LR", "MIN_LR", "SEQ_LEN", "PAD_LEN", "PR",
    "TP", "PP", "CP", "ETP", "EP", "SP", "DO", "FL", "SFT", "AC", "OPTIMIZER_OFFLOAD", "SAVE_INTERVAL",
    "DATASET_PATH", "VALID_DATASET_PATH", "PRETRAIN_CHECKPOINT_PATH", "TRAIN_TOKENS_OR_ITERS",
    "WARMUP_TOKENS_OR_ITERS", "OUTPUT_BASEPATH",
)
# The script copies `*.json` and `merges.txt` out of the checkpoint (and aborts if either matches nothing);
# Pai's tokenizer is AutoTokenizer.from_pretrained(<checkpoint>).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


@dataclass(frozen=True)
class PaiModel:
    """A MODEL_SIZE as the run script hard-codes it (its `if [ $MODEL_SIZE = ... ]` block)."""

    architecture: str
    hf_layers: int
    layers: int  # Megatron layers (NUM_LAYERS); Qwen3-Next splits each HF layer into a mixer and an MLP layer
    hidden: int
    heads: int
    kv_groups: int
    experts: int = 0
    pattern: str = ""  # Qwen3-Next's --hybrid-override-pattern unit, one per 4 HF layers


@dataclass(frozen=True)
class PaiScript:
    prefix: str  # the run name the script gives its checkpoint directory starts `<mode>-<prefix>-`
    sizes: dict[str, PaiModel]


_DENSE = "Qwen3ForCausalLM"
_MOE = "Qwen3MoeForCausalLM"
PAI_SCRIPTS = {
    "examples/qwen3_next/run_mcore_qwen3.sh": PaiScript("mcore-qwen3-next", {
        "A3B": PaiModel("Qwen3NextForCausalLM", 48, 96, 2048, 16, 2, 512, "M-M-M-*-"),
    }),
    "examples/qwen3/run_mcore_qwen3.sh": PaiScript("mcore-qwen3-moe-megatron", {
        "0.6B": PaiModel(_DENSE, 28, 28, 1024, 16, 8), "1.7B": PaiModel(_DENSE, 28, 28, 2048, 16, 8),
        "4B": PaiModel(_DENSE, 36, 36, 2560, 32, 8), "8B": PaiModel(_DENSE, 36, 36, 4096, 32, 8),
        "14B": PaiModel(_DENSE, 40, 40, 5120, 40, 8), "32B": PaiModel(_DENSE, 64, 64, 5120, 64, 8),
        "A3B": PaiModel(_MOE, 48, 48, 2048, 32, 4, 128), "A22B": PaiModel(_MOE, 94, 94, 4096, 64, 4, 128),
    }),
}


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _number(value: float) -> str:
    return f"{value:g}"


def script_of(spec: RecipeJob) -> PaiScript | None:
    return PAI_SCRIPTS.get(spec.train.pai.script)


def model_of(spec: RecipeJob) -> PaiModel | None:
    script = script_of(spec)
    return script.sizes.get(spec.train.pai.model_size) if script else None


def dataset_type(t: TrainSpec) -> str:
    return "raw" if t.mode == "sft" and t.sft_data == "json" else "idxmap"


# --------------------------------------------------------------------------------------------- checks


def check(spec: RecipeJob) -> list[str]:
    """What the script, Megatron or Transformer Engine would reject, beyond the batch and parallelism check
    every trainer runs (`RecipeJob.batch_problems`), each naming the field to change."""
    t = spec.train
    p = t.pai
    par = p.parallel
    problems: list[str] = []
    script = script_of(spec)
    if script is None:
        return [f"train.pai.script={p.script!r}: a4ray knows the arguments of {', '.join(sorted(PAI_SCRIPTS))}"]
    model = script.sizes.get(p.model_size)
    if model is None:
        return [f"train.pai.model_size={p.model_size!r}: {p.script} defines {', '.join(script.sizes)}"]
    problems += fit_problems("train.pai.parallel", par, p.model_size, experts=model.experts, heads=model.heads,
                             groups=model.kv_groups)  # the layers: _layer_checks, with Pai's uneven first stage
    problems += _layer_checks(spec, model)
    if p.optimizer_offload is not None and not p.distributed_optimizer:
        problems.append(f"train.pai.optimizer_offload={p.optimizer_offload:g} needs train.pai.distributed_optimizer="
                        "true (the script would turn it on behind your back)")
    if p.load.strip() == "none":
        problems.append("train.pai.load=none: the script copies *.json and merges.txt out of the checkpoint path "
                        "with `find | xargs cp` under `set -e`, which aborts when nothing matches; give a "
                        "checkpoint directory holding the HF tokenizer files (the converter copies them there)")
    if dataset_type(t) == "raw" and (p.pad_len or t.seq_len) != t.seq_len:
        problems.append(f"train.pai.pad_len={p.pad_len} must equal train.seq_len={t.seq_len} for JSON SFT (samples "
                        f"are padded to PAD_LEN and batched as SEQ_LEN tokens)")
    if t.mode == "sft" and t.sft_data == "mmap" and not t.sft_mmap:
        problems.append("train.sft_mmap: required with train.sft_data=mmap: an SFT idxmap built with Pai's "
                        "toolkits/sft_data_preprocessing (the pretraining corpus is not one); or use sft_data=json")
    if model.pattern and not p.flash_attention and spec.cluster.machine_type.startswith("a4-"):
        problems.append("train.pai.flash_attention=false: Transformer Engine's fused attention has no B200 (SM100) "
                        "kernel for Qwen3-Next's kv_channels=256; A4 needs flash attention")
    return problems


def _layer_checks(spec: RecipeJob, model: PaiModel) -> list[str]:
    p = spec.train.pai
    par, layers, problems = p.parallel, model.layers, []
    if p.first_stage_layers is not None:
        if par.pp == 1:
            problems.append("train.pai.first_stage_layers: an uneven pipeline split needs train.pai.parallel.pp > 1")
        elif (layers - p.first_stage_layers) % (par.pp - 1) or p.first_stage_layers >= layers:
            problems.append(f"train.pai.first_stage_layers={p.first_stage_layers}: the other {layers} - "
                            f"{p.first_stage_layers} layers must split evenly over pp - 1 = {par.pp - 1} stages")
        per_stage = None
    elif layers % par.pp:
        problems.append(f"train.pai.parallel.pp={par.pp} does not divide the {layers} layers of {p.model_size}")
        per_stage = None
    else:
        per_stage = layers // par.pp
    if per_stage and p.virtual_pipeline_layers and per_stage % p.virtual_pipeline_layers:
        problems.append(f"train.pai.virtual_pipeline_layers={p.virtual_pipeline_layers} does not divide the "
                        f"{per_stage} layers of a pipeline stage")
    if per_stage and p.recompute in ("full", "offload") and per_stage % (p.recompute_layers or 1):
        problems.append(f"train.pai.recompute_layers={p.recompute_layers} does not divide the {per_stage} layers of "
                        f"a pipeline stage (the script exits: 'must be a multiple of the recompute layers')")
    if p.recompute_layers and p.recompute not in ("full", "offload"):
        problems.append(f"train.pai.recompute_layers applies to recompute=full|offload, not {p.recompute!r}")
    return problems


def check_hf_config(config: dict, model: PaiModel, spec: RecipeJob, where: str) -> list[str]:
    """The staged model against the shape the script hard-codes (it loads weights into that shape)."""
    p = spec.train.pai
    got = {"architecture": (config.get("architectures") or ["?"])[0], "layers": config.get("num_hidden_layers"),
           "hidden size": config.get("hidden_size"), "attention heads": config.get("num_attention_heads"),
           "query groups": config.get("num_key_value_heads"),
           "experts": config.get("num_experts") or config.get("num_local_experts") or 0}
    want = {"architecture": model.architecture, "layers": model.hf_layers, "hidden size": model.hidden,
            "attention heads": model.heads, "query groups": model.kv_groups, "experts": model.experts}
    wrong = [f"{k} {got[k]} (the script's {p.model_size}: {want[k]})" for k in want if got[k] != want[k]]
    if model.pattern:
        interval = config.get("full_attention_interval", 4)
        if interval != 4:
            wrong.append(f"full attention every {interval} layers (the script's hybrid pattern {model.pattern!r} "
                         "has it every 4th)")
    if not wrong:
        return []
    extra = (f"; {p.script} builds {model.layers} Megatron layers with the hybrid pattern {model.pattern!r} x "
             f"{model.layers // len(model.pattern)} and has no knob for fewer" if model.pattern else "")
    return [f"train.model: {where} is not Pai's {p.model_size}: " + ", ".join(wrong) + extra]


# -------------------------------------------------------------------------------------- the command


@dataclass
class PaiPaths:
    """Absolute paths on the nodes."""

    repo: str
    load: str
    data: str
    valid: str
    output: str

    @classmethod
    def resolve(cls, spec: RecipeJob, workspace: str, load: str) -> PaiPaths:
        t, at = spec.train, spec.on_nodes
        valid = t.sft_json_valid if dataset_type(t) == "raw" else t.data
        return cls(repo=at(workspace, t.pai.repo), load=at(workspace, t.pai.load or load), data=at(workspace, t.data),
                   valid=at(workspace, valid), output=at(workspace, spec.train_output))


def pai_args(spec: RecipeJob, paths: PaiPaths) -> list[tuple[str, str]]:
    """The 27 positional arguments, (name, value) in the script's order."""
    t = spec.train
    p, par = t.pai, t.pai.parallel
    gbs = spec.global_batch
    if t.mode == "pretrain":  # the script counts pretraining in tokens: iterations = tokens / GBS / SEQ_LEN
        length = (t.iterations * gbs * t.seq_len, t.warmup_iterations * gbs * t.seq_len)
    else:
        length = (t.iterations, t.warmup_iterations)
    values = [
        "dlc", p.model_size, t.micro_batch_size, gbs, _number(t.lr), _number(t.min_lr), t.seq_len,
        p.pad_len or t.seq_len, p.precision,
        par.tp, par.pp, par.cp, par.etp, par.ep, _bool(par.sp), _bool(p.distributed_optimizer),
        _bool(p.flash_attention), _bool(t.mode == "sft"),
        p.recompute, "false" if p.optimizer_offload is None else _number(p.optimizer_offload), t.save_interval,
        paths.data, paths.valid, paths.load, *length, paths.output,
    ]
    assert len(values) == len(ARG_NAMES)
    return list(zip(ARG_NAMES, (str(v) for v in values)))


def run_name(spec: RecipeJob) -> str:
    """The checkpoint directory name the script derives from its arguments (`<output>/checkpoint/<name>`)."""
    t, script = spec.train, script_of(spec)
    args = dict(pai_args(spec, PaiPaths("", "", "", "", "")))
    mode = "finetune" if t.mode == "sft" else "pretrain"
    return (f"{mode}-{script.prefix if script else '?'}-{args['MODEL_SIZE']}-lr-{args['LR']}-minlr-{args['MIN_LR']}"
            f"-bs-{args['BATCH_SIZE']}-gbs-{args['GLOBAL_BATCH_SIZE']}-seqlen-{args['SEQ_LEN']}-pr-{args['PR']}"
            f"-tp-{args['TP']}-pp-{args['PP']}-cp-{args['CP']}-ac-{args['AC']}-do-{args['DO']}-sp-{args['SP']}"
            f"-ti-{t.iterations}-wi-{t.warmup_iterations}")


def pai_env(spec: RecipeJob, node: NodeContext) -> dict[str, str]:
    t = spec.train
    p = t.pai
    env = {**pai_contract_env(node), "OMP_NUM_THREADS": str(p.omp_num_threads), "MP_DATASET_TYPE": dataset_type(t)}
    if p.recompute_layers:
        env["MP_AC_LAYERS"] = str(p.recompute_layers)
    if p.virtual_pipeline_layers:
        env["MP_VP"] = str(p.virtual_pipeline_layers)
    if p.first_stage_layers:
        env["MP_PP0_LAYERS"] = str(p.first_stage_layers)
    if p.sft_packing:
        env["MP_SFT_PACKING"] = "true"
    return {**env, **p.env}


class PaiTrainResult(WorkloadResult):
    kind: str = "pai"
    iterations: int = 0
    last_iteration: int | None = None
    loss: float | None = None
    checkpoint_dir: str = ""


class PaiTrain(Trainer):
    """The train step with trainer `pai`: every node runs the run script with the DLC contract."""

    name = kind = "pai"
    checks_model = True

    @property
    def paths(self) -> PaiPaths:
        return PaiPaths.resolve(self.spec, self.workspace, self.checkpoint)

    def runs(self) -> str:
        return (f"Pai-Megatron-Patch {self.spec.train.pai.script} on every node (bash; the script starts torchrun "
                "per node)")

    def problems(self) -> list[str]:
        return check(self.spec)

    def check_model(self, config: dict, where: str) -> list[str]:
        model = model_of(self.spec)
        return check_hf_config(config, model, self.spec, where) if model else []

    def convert_section(self, section: ConvertSpec) -> ConvertSpec:
        # The recipe knows its model: the converter script is the one for it, also where config.json is not
        # staged yet (a dry run), rather than a default for another model.
        model = model_of(self.spec)
        if section.backend != "pai" or section.pai.script or model is None:
            return section
        script = pai_script(model.architecture, self.spec.train.pai.model_size)
        return section.model_copy(update={"pai": section.pai.model_copy(update={"script": script})})

    @property
    def script_dir(self) -> str:
        return str(PurePosixPath(self.paths.repo) / PurePosixPath(self.spec.train.pai.script).parent)

    @property
    def checkpoint_dir(self) -> str:
        return str(PurePosixPath(self.paths.output) / "checkpoint" / run_name(self.spec))

    @property
    def checkpoints(self) -> str:
        return self.checkpoint_dir

    def straggler_check(self) -> str:
        return ("off: Megatron-LM's loop prints no per-rank compute time (its --log-straggler reports only the "
                "min/max ranks of whole steps, waits included)")

    def plan_lines(self) -> list[str]:
        return ["run_mcore_qwen3.sh arguments:", *(f"  {line}" for line in self.describe()),
                f"checkpoints: {self.checkpoint_dir}, synchronous, every train.save_interval: Pai's script takes no "
                "further Megatron-LM argument, though its Megatron-LM has --async-save, --non-persistent-* and "
                "--exit-signal-handler (a4ray's Megatron trainer, train.trainer=megatron, saves in the background, "
                "locally and on notice)"]

    def outputs(self, result: WorkloadResult) -> dict[str, str]:
        return {**super().outputs(result), "checkpoints": self.checkpoint_dir}

    def inputs(self) -> dict[str, str]:
        """What must exist on the nodes before launching, by what it is."""
        t = self.spec.train
        script = str(PurePosixPath(self.paths.repo) / t.pai.script)
        needed = {"the run script (train.pai.repo, train.pai.script)": script,
                  "the checkpoint's tracker (train.pai.load / convert)":
                      str(PurePosixPath(self.paths.load) / "latest_checkpointed_iteration.txt")}
        needed.update({f"tokenizer file {f} in the checkpoint (train.pai.load)": str(PurePosixPath(self.paths.load) / f)
                       for f in TOKENIZER_FILES})
        if dataset_type(t) == "raw":
            needed.update({"the SFT JSON (train.sft_json)": self.paths.data,
                           "the SFT validation JSON (train.sft_json_valid)": self.paths.valid})
        else:
            field = "train.pretrain_data" if t.mode == "pretrain" else "train.sft_mmap"
            needed.update({f"the dataset ({field}) .{ext}": f"{self.paths.data}.{ext}" for ext in ("bin", "idx")})
        return needed

    def resume_note(self) -> str:
        # Its own checkpoints cannot be resumed through the script: pointing PRETRAIN_CHECKPOINT_PATH at its
        # save directory makes its `cp -t` of the tokenizer files copy files onto themselves and abort.
        return "Pai's script starts again from train.pai.load (it cannot resume its own saves)"

    def launch(self, node: NodeContext) -> Launch:
        script = PurePosixPath(self.spec.train.pai.script).name
        argv = ["bash", script, *(value for _, value in pai_args(self.spec, self.paths))]
        return Launch(argv=argv, env=pai_env(self.spec, node), cwd=self.script_dir)

    def describe(self) -> list[str]:
        """The 27 arguments by name, for plans."""
        return [f"{i:>2} {name}={shlex.quote(value)}" for i, (name, value) in
                enumerate(pai_args(self.spec, self.paths), start=1)]

    def result(self, gang: GangResult) -> PaiTrainResult:
        last = None
        for node in gang.nodes:  # Megatron prints iteration lines from one rank; find the newest
            for line in node.last_lines:
                progress = parse_progress(line)
                if progress and (last is None or progress.iteration >= last.iteration):
                    last = progress
        iterations = self.spec.train.iterations
        if gang.ok:
            loss = f", lm loss {last.loss:.4g}" if last and last.loss is not None else ""
            verdict = f"PASS: Pai trained {iterations} iterations{loss}; checkpoints in {self.checkpoint_dir}"
        else:
            verdict = f"FAIL: {gang.brief or 'the gang failed'}"
        return PaiTrainResult(ok=gang.ok, verdict=verdict, gang=gang, iterations=iterations,
                              last_iteration=gang.last_iteration, loss=last.loss if last else None,
                              checkpoint_dir=self.checkpoint_dir)

