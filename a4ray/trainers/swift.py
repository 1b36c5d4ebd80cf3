"""ms-swift's `megatron rlhf --rlhf_type dpo` (seed 004) as a gang workload.

Every node runs the same `megatron rlhf ...`. ms-swift's launcher (swift/cli/main.py) then execs torchrun
with `--nnodes --node_rank --nproc_per_node --master_addr --master_port` taken from NNODES, NODE_RANK,
NPROC_PER_NODE, MASTER_ADDR and MASTER_PORT, which a4ray sets per node in the workload's env layer, with
MODELSCOPE_CACHE on the shared workspace (ms-swift: multi-node runs need one dataset cache, else they may hang).

The flags follow the configured `train.version` (examples/megatron/rlhf/dpo/moe.sh at each release):

    < 3.12   --load <mcore dir>                                   --save --save_interval --eval_interval
                                                                  --max_epochs --num_workers
    3.12.x   --model <hf dir> --load_safetensors true --save_safetensors true   (the same output flags)
    >= 4.0   --model <hf dir> --save_safetensors true             --output_dir --save_steps --eval_steps
                                                                  --num_train_epochs --dataloader_num_workers

`megatron rlhf` exists from 3.6, --expert_tensor_parallel_size from 3.7, DPO packing from 3.8. Async saves: 4.x's own
--async_save (its megatron_args.py; it refuses save_total_limit beside it), before 4.0 Megatron-LM's --async-save
passed through --extra_megatron_kwargs (3.8's megatron_args.py turns its keys into Megatron-LM flags). Neither
version has a save on notice a4ray could use (Megatron-LM's --exit-signal-handler acts on SIGTERM, which a4ray's
fault stops send) nor local checkpoints (4.x has no field for them).
Sources: ms-swift's `swift/cli/main.py` (the launch env) and `examples/megatron/rlhf/dpo/moe.sh` at its tags v3.8.0,
v3.12.0 and v4.0.0.
"""

from __future__ import annotations

import json

from a4ray.runtime.launch import GangResult, Launch, NodeContext
from a4ray.spec.conversion import ConvertSpec
from a4ray.spec.recipes import RecipeJob
from a4ray.spec.train import SwiftTrainSpec
from a4ray.trainers.interface import Trainer, fit_problems
from a4ray.workloads.workload import WorkloadResult


def version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def trains_from_mcore(train: SwiftTrainSpec) -> bool:
    """ms-swift before 3.12 needs an mcore checkpoint (`swift export --to_mcore` first)."""
    return version(train.version) < (3, 12)


def _flag(value: bool) -> str:
    return "true" if value else "false"


def check(spec: RecipeJob) -> list[str]:
    """What this ms-swift version would reject, beyond the batch and parallelism check every trainer runs."""
    t = spec.train
    par, v, problems = t.parallel, version(t.version), []
    if v < (3, 6):
        problems.append(f"train.version={t.version}: `megatron rlhf` (DPO) exists from ms-swift 3.6")
    if t.packing and v < (3, 8):
        problems.append(f"train.packing=true: ms-swift {t.version} has no DPO packing (from 3.8); set it false")
    if par.etp != 1 and v < (3, 7):
        problems.append(f"train.parallel.etp={par.etp}: ms-swift {t.version} has no --expert_tensor_parallel_size")
    if t.load.strip() and not trains_from_mcore(t):
        problems.append(f"train.load: ms-swift {t.version} trains from the HF weights (train.model); --load is "
                        "for < 3.12 (use train.extra_args with --mcore_model to resume an mcore checkpoint)")
    return problems


def check_hf_config(config: dict, spec: RecipeJob, where: str) -> list[str]:
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    return fit_problems("train.parallel", spec.train.parallel, where, experts=experts)


def swift_args(spec: RecipeJob, workspace: str, load: str) -> list[str]:
    t = spec.train
    par, v = t.parallel, version(t.version)

    def at(path: str) -> str:
        return spec.on_nodes(workspace, path)

    if trains_from_mcore(t):
        model = ["--load", at(t.load or load)]
    else:
        model = ["--model", at(t.model)] + (["--load_safetensors", "true"] if v < (4,) else []) + \
            ["--save_safetensors", "true"]
    datasets = [at(d) if _is_path(d) else d for d in t.dataset]
    argv = ["megatron", "rlhf", "--rlhf_type", "dpo", *model, "--dataset", *datasets,
            "--load_from_cache_file", _flag(t.load_from_cache_file), "--split_dataset_ratio", f"{t.split_dataset_ratio:g}"]
    if t.packing:
        argv += ["--packing", "true"]
    argv += ["--tensor_model_parallel_size", str(par.tp)]
    if v >= (3, 7):
        argv += ["--expert_tensor_parallel_size", str(par.etp)]
    argv += ["--expert_model_parallel_size", str(par.ep)]
    if par.pp > 1:
        argv += ["--pipeline_model_parallel_size", str(par.pp)]
    if par.cp > 1:
        argv += ["--context_parallel_size", str(par.cp)]
    argv += ["--moe_permute_fusion", _flag(t.moe_permute_fusion), "--moe_grouped_gemm", _flag(t.moe_grouped_gemm),
             "--moe_shared_expert_overlap", _flag(t.moe_shared_expert_overlap),
             "--moe_aux_loss_coeff", f"{t.moe_aux_loss_coeff:g}",
             "--micro_batch_size", str(t.micro_batch_size), "--global_batch_size", str(spec.global_batch)]
    if t.recompute != "none":
        argv += ["--recompute_granularity", t.recompute]
        if t.recompute == "full":
            argv += ["--recompute_method", t.recompute_method, "--recompute_num_layers", str(t.recompute_num_layers)]
    if t.iterations:
        argv += ["--train_iters", str(t.iterations)]
    else:
        argv += ["--num_train_epochs" if v >= (4,) else "--max_epochs", str(t.epochs)]
    argv += ["--finetune", _flag(t.finetune), "--cross_entropy_loss_fusion", _flag(t.cross_entropy_loss_fusion),
             "--lr", f"{t.lr:g}", "--lr_warmup_fraction", f"{t.lr_warmup_fraction:g}", "--min_lr", f"{t.min_lr:g}"]
    if v >= (4,):
        argv += ["--output_dir", at(t.output), "--eval_steps", str(t.eval_interval), "--save_steps",
                 str(t.save_interval)]
    else:
        argv += ["--save", at(t.output), "--eval_interval", str(t.eval_interval), "--save_interval",
                 str(t.save_interval)]
    argv += ["--max_length", str(t.max_length),
             "--dataloader_num_workers" if v >= (4,) else "--num_workers", str(t.num_workers),
             "--dataset_num_proc", str(t.dataset_num_proc)]
    if not t.save_optim:
        argv += ["--no_save_optim", "true"]
    if not t.save_rng:
        argv += ["--no_save_rng", "true"]
    if t.async_save:  # 4.x saves through dist_checkpointing itself; 3.x hands unknown flags to Megatron-LM's parser
        argv += ["--async_save", "true"] if v >= (4,) else ["--extra_megatron_kwargs", json.dumps({"async_save": True})]
    argv += ["--sequence_parallel", _flag(par.sp and par.tp > 1), "--attention_backend", t.attention_backend]
    if t.optimizer_cpu_offload:
        argv += ["--optimizer_cpu_offload", "true", "--use_precision_aware_optimizer",
                 _flag(t.use_precision_aware_optimizer), "--optimizer_offload_fraction",
                 f"{t.optimizer_offload_fraction:g}"]
    argv += ["--beta", f"{t.beta:g}"]
    if t.rpo_alpha is not None:
        argv += ["--rpo_alpha", f"{t.rpo_alpha:g}"]
    return argv + ["--loss_type", t.loss_type, *t.extra_args]


def _is_path(dataset: str) -> bool:
    """A staged dataset (a path, relative to the workspace), not a hub id (`org/name`, maybe `#<samples>`)."""
    name = dataset.split("#")[0]
    return name.startswith("/") or name.count("/") > 1 or name.endswith((".json", ".jsonl", ".csv", ".parquet"))


def swift_env(spec: RecipeJob, node: NodeContext, workspace: str) -> dict[str, str]:
    t = spec.train
    cache = spec.on_nodes(workspace, t.modelscope_cache)
    env = {"NNODES": str(node.nnodes), "NODE_RANK": str(node.rank), "NPROC_PER_NODE": str(node.gpus),
           "MASTER_ADDR": str(node.master_addr), "MASTER_PORT": str(node.master_port), "MODELSCOPE_CACHE": cache,
           "PYTORCH_CUDA_ALLOC_CONF": t.cuda_alloc_conf}
    if t.megatron_lm_path:
        env["MEGATRON_LM_PATH"] = t.megatron_lm_path
    return {**env, **t.env}


class SwiftTrain(Trainer):
    name = kind = "swift"
    checks_model = True

    def runs(self) -> str:
        return (f"ms-swift {self.spec.train.version} `megatron rlhf --rlhf_type dpo` on every node (its launcher "
                "starts torchrun)")

    def straggler_check(self) -> str:
        return ("off: Megatron-LM's loop prints no per-rank compute time (its --log-straggler reports only the "
                "min/max ranks of whole steps, waits included)")

    def problems(self) -> list[str]:
        return check(self.spec)

    def conversion_skipped(self) -> str | None:
        t = self.spec.train
        if not trains_from_mcore(t):
            return f"ms-swift {t.version} trains from the Hugging Face weights (--model): no offline conversion"
        return None

    def convert_section(self, section: ConvertSpec) -> ConvertSpec:
        # One ms-swift in the image: the trainer's version converts too.
        swift = section.swift.model_copy(update={"version": self.spec.train.version})
        return section.model_copy(update={"swift": swift})

    def check_model(self, config: dict, where: str) -> list[str]:
        return check_hf_config(config, self.spec, where)

    def inputs(self) -> dict[str, str]:
        t, at = self.spec.train, self.spec.on_nodes
        if trains_from_mcore(t):
            load = at(self.workspace, t.load or self.checkpoint)
            return {"the mcore checkpoint (train.load / convert)": f"{load}/latest_checkpointed_iteration.txt"}
        return {"the HF checkpoint's config.json (train.model)": f"{at(self.workspace, t.model)}/config.json"}

    def launch(self, node: NodeContext) -> Launch:
        return Launch(argv=swift_args(self.spec, self.workspace, self.checkpoint),
                      env=swift_env(self.spec, node, self.workspace), cwd=self.workspace)

    def result(self, gang: GangResult) -> WorkloadResult:
        out = self.spec.train.output
        verdict = (f"PASS: ms-swift DPO finished; output under <workspace>/{out}" if gang.ok
                   else f"FAIL: {gang.brief or 'the gang failed'}")
        return WorkloadResult(kind=self.kind, ok=gang.ok, verdict=verdict, gang=gang)
