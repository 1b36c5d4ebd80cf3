"""Facts read from the pinned upstream files of the tools that do not install here, as data.

Pai-Megatron-Patch a098ca5 (and its Megatron-LM submodules), DeepEP 8a07e7e and nccl-tests v2.17.6 need GPUs,
Transformer Engine, NVSHMEM or CUDA to run. What a4ray hands them is held to these facts instead: the tests in
tests/test_upstream_contracts.py compare a4ray's commands with them, and the stand-in scripts other tests launch
are made here from them (`pai_standin`), so a launch that the real script would get wrong fails there too. Each
fact names its file and lines; nothing here is upstream code.
"""

from __future__ import annotations

from pathlib import Path

PAI_COMMIT = "a098ca5acbdeaf7172ce0393fa309b39a77506db"

# examples/qwen3_next/run_mcore_qwen3.sh L3 (ENV=$1), L27-62 ($2..$27); examples/qwen3/run_mcore_qwen3.sh L3,
# L26-61: the same 27 positional arguments, by these names.
PAI_RUN_ARGS = (
    "ENV", "MODEL_SIZE", "BATCH_SIZE", "GLOBAL_BATCH_SIZE", "LR", "MIN_LR", "SEQ_LEN", "PAD_LEN", "PR",
    "TP", "PP", "CP", "ETP", "EP", "SP", "DO", "FL", "SFT", "AC", "OPTIMIZER_OFFLOAD", "SAVE_INTERVAL",
    "DATASET_PATH", "VALID_DATASET_PATH", "PRETRAIN_CHECKPOINT_PATH", "TRAIN_TOKENS", "WARMUP_TOKENS",
    "OUTPUT_BASEPATH",
)
# dlc mode (qwen3_next L17-20, L24): NNODES=$WORLD_SIZE NODE_RANK=$RANK GPUS_PER_NODE=$KUBERNETES_CONTAINER_RESOURCE_GPU,
# MASTER_ADDR/MASTER_PORT straight into torchrun's flags.
PAI_DLC_ENV = ("WORLD_SIZE", "RANK", "KUBERNETES_CONTAINER_RESOURCE_GPU", "MASTER_ADDR", "MASTER_PORT")
# The run name's prefix (qwen3_next L261/L270, qwen3 L388/L397) and the checkpoint directory
# `${OUTPUT_BASEPATH}/checkpoint/${NAME}` (qwen3_next L298/L305, qwen3 L425/L432), NAME =
# "${PREFIX}-pr-${PR}-tp-${TP}-pp-${PP}-cp-${CP}-ac-${AC}-do-${DO}-sp-${SP}-ti-${TRAIN_ITERS}-wi-${LR_WARMUP_ITERS}",
# PREFIX = "<pretrain|finetune>-<model>-${MODEL_SIZE}-lr-${LR}-minlr-${MIN_LR}-bs-${BATCH_SIZE}-gbs-..-seqlen-..".
PAI_RUN_MODEL = {"examples/qwen3_next/run_mcore_qwen3.sh": "mcore-qwen3-next",
                 "examples/qwen3/run_mcore_qwen3.sh": "mcore-qwen3-moe-megatron"}


def pai_run_name(args: dict[str, str], script: str) -> str:
    """NAME as the run script computes it from its arguments: pretraining counts TRAIN_TOKENS and WARMUP_TOKENS
    in tokens, TRAIN_ITERS = TRAIN_TOKENS / GLOBAL_BATCH_SIZE / SEQ_LEN in shell integer arithmetic (qwen3_next
    L267-268); SFT takes them as iterations (L258-259)."""
    a = args
    if a["SFT"] == "true":
        mode, iters, warmup = "finetune", int(a["TRAIN_TOKENS"]), int(a["WARMUP_TOKENS"])
    else:
        gbs, seq = int(a["GLOBAL_BATCH_SIZE"]), int(a["SEQ_LEN"])
        mode, iters, warmup = "pretrain", int(a["TRAIN_TOKENS"]) // gbs // seq, int(a["WARMUP_TOKENS"]) // gbs // seq
    prefix = (f"{mode}-{PAI_RUN_MODEL[script]}-{a['MODEL_SIZE']}-lr-{a['LR']}-minlr-{a['MIN_LR']}-bs-{a['BATCH_SIZE']}"
              f"-gbs-{a['GLOBAL_BATCH_SIZE']}-seqlen-{a['SEQ_LEN']}")
    return (f"{prefix}-pr-{a['PR']}-tp-{a['TP']}-pp-{a['PP']}-cp-{a['CP']}-ac-{a['AC']}-do-{a['DO']}-sp-{a['SP']}"
            f"-ti-{iters}-wi-{warmup}")


# toolkits/distributed_checkpoints_convertor/scripts/<model>/run_*.sh L11-23: WORLD_SIZE, RANK,
# KUBERNETES_CONTAINER_RESOURCE_GPU, MASTER_ADDR, MASTER_PORT; then MODEL_SIZE LOAD_DIR SAVE_DIR MG2HF USE_CUDA PR
# [HF_DIR] ($7 only for mcore -> HF). The sizes each defines (its `if [ $MODEL_SIZE = ... ]` blocks: qwen3/run_8xH20.sh
# L103-213, qwen3/run_A22B_16xH20.sh L103, qwen3_next/run_8xH20.sh L103 with `--synchronizer qwen3_next` L168),
# and its Megatron-LM submodule (L6).
PAI_CONVERTER_ARGS = ("MODEL_SIZE", "LOAD_DIR", "SAVE_DIR", "MG2HF", "USE_CUDA", "PR")
PAI_CONVERTERS = {
    "scripts/qwen3/run_8xH20.sh": {"sizes": {"0.6B", "1.7B", "4B", "8B", "14B", "32B", "A3B", "A22B"},
                                   "megatron": "Megatron-LM-250624", "synchronizer": "general"},
    "scripts/qwen3/run_A22B_16xH20.sh": {"sizes": {"A22B"}, "megatron": "Megatron-LM-250624", "synchronizer": "general"},
    "scripts/qwen3_next/run_8xH20.sh": {"sizes": {"A3B"}, "megatron": "Megatron-LM-250908",
                                        "synchronizer": "qwen3_next"},
}

# DeepEP 8a07e7e tests/test_internode.py L372-384: its options (all `--name value`, store_true for the last).
DEEPEP_OPTIONS = {"--num-processes", "--num-tokens", "--hidden", "--num-topk-groups", "--num-topk",
                  "--pressure-test-mode", "--num-experts", "--test-ll-compatibility"}

# DeepEP 8a07e7e tests/test_internode.py, what local rank 0 of each node prints: L32 config, L96 layout, L121-123
# each case (end='') then L228 ' passed' on the same line (2 previous x 2 async x 4 inputs x 2 top-k = 32 cases,
# L115-118), L259-263 the best dispatch per input type, L306-310 the best combine (note `, ` before its times
# where dispatch has `: `, and %.2f times where dispatch has %.0f).
DEEPEP_LINES = {
    "config": "[config] num_tokens={tokens}, hidden={hidden}, num_topk_groups={groups}, num_topk={topk}",
    "layout": "[layout] Kernel performance: {ms:.3f} ms",
    "case": "[testing] Running with {dtype}, {topk} top-k (async={async_}, previous={previous}) ...",
    "passed": " passed",
    "dispatch": ("[tuning] Best dispatch ({dtype}): SMs {sms}, NVL chunk {nvl}, RDMA chunk {rdma}: {notify:.0f} + "
                 "{t:.0f} us, {rdma_gbps:.2f} GB/s (RDMA), {nvl_gbps:.2f} GB/s (NVL)"),
    "combine": ("[tuning] Best combine: SMs {sms}, NVL chunk {nvl}, RDMA chunk {rdma}, {notify:.2f} + {t:.2f} us, "
                "{rdma_gbps:.2f} GB/s (RDMA), {nvl_gbps:.2f} GB/s (NVL)"),
}
DEEPEP_CASES = 32

# nccl-tests v2.17.6 src/util.cu L480: a row's #wrong is printed with %6g; L643: `# Out of bounds values : %d %s`
# (errors[0]: the sizes whose check failed, `FAILED` if any).
NCCL_TESTS_WRONG_FORMAT = "%6g"
NCCL_TESTS_OOB_FORMAT = "# Out of bounds values : %d %s"
# src/util.cu L623-624: the columns of a row (no -C cputime, no -S timestamps), L644: the average's line (%g, then
# OK/FAILED only with NCCL_TESTS_MIN_BW), L646: `# Collective test concluded: <program>`.
NCCL_TESTS_COLUMNS = ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                      "time", "algbw", "busbw", "#wrong")
NCCL_TESTS_AVG_FORMAT = "# Avg bus bandwidth    : %g %s"
NCCL_TESTS_CONCLUDED_FORMAT = "# Collective test concluded: %s"


def pai_standin(path: Path, *, args: int, env: tuple[str, ...], body: str) -> Path:
    """A stand-in for one of Pai's scripts that refuses what the real one would get wrong: a different
    number of positional arguments than the pinned script takes, or an unset variable of its env contract
    (the real script would pass an empty value to torchrun). `body` then runs with the arguments."""
    checks = "\n".join(f'[ -n "${{{name}:-}}" ] || {{ echo "stand-in: {name} is not set" >&2; exit 97; }}'
                       for name in env)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""#!/bin/bash
set -euo pipefail
[ $# -eq {args} ] || {{ echo "stand-in: $# arguments; the pinned script takes {args}" >&2; exit 96; }}
{checks}
{body}
""")
    return path

# ms-swift v4.5.2's Megatron RLHF arguments: MegatronRLHFArguments (swift/megatron/arguments/rlhf_args.py L9) <
# MegatronSftArguments (sft_args.py L13) < MegatronBaseArguments (megatron_base_args.py L13) < MegatronArguments
# (megatron_args.py L480, with RLHFMegatronArgumentsMixin L25) and BaseArguments (swift/arguments/base_args/base_args.py
# L47). Read, not parsed, for 4.x: importing them imports mcore-bridge, whose patcher imports Transformer Engine (CUDA
# only). The fields a4ray may pass, each where the tag defines it (tests/test_swift_contract.py parses 3.x for real).
SWIFT_4_5_2_MEGATRON_RLHF_FIELDS = {
    "rlhf_type": "megatron/arguments/megatron_args.py:26",
    "model": "arguments/base_args/model_args.py:68",
    "save_safetensors": "megatron/arguments/megatron_args.py:679",
    "dataset": "arguments/base_args/data_args.py:75",
    "load_from_cache_file": "arguments/base_args/data_args.py:83",
    "split_dataset_ratio": "arguments/base_args/data_args.py:79",
    "packing": "arguments/base_args/base_args.py:105",
    "tensor_model_parallel_size": "megatron/arguments/megatron_args.py:592",
    "expert_tensor_parallel_size": "megatron/arguments/megatron_args.py:619",
    "expert_model_parallel_size": "megatron/arguments/megatron_args.py:618",
    "moe_permute_fusion": "megatron/arguments/megatron_args.py:660",
    "moe_grouped_gemm": "megatron/arguments/megatron_args.py:659",
    "moe_shared_expert_overlap": "megatron/arguments/megatron_args.py:663",
    "moe_aux_loss_coeff": "megatron/arguments/megatron_args.py:661",
    "micro_batch_size": "megatron/arguments/megatron_args.py:482",
    "global_batch_size": "megatron/arguments/megatron_args.py:483",
    "recompute_granularity": "megatron/arguments/megatron_args.py:484",
    "recompute_method": "megatron/arguments/megatron_args.py:485",
    "recompute_num_layers": "megatron/arguments/megatron_args.py:486",
    "num_train_epochs": "megatron/arguments/megatron_args.py:489",
    "finetune": "megatron/arguments/megatron_args.py:570",
    "cross_entropy_loss_fusion": "megatron/arguments/megatron_args.py:496",
    "lr": "megatron/arguments/megatron_args.py:529",
    "lr_warmup_fraction": "megatron/arguments/megatron_args.py:534",
    "min_lr": "megatron/arguments/megatron_args.py:535",
    "output_dir": "megatron/arguments/megatron_args.py:562",
    "eval_steps": "megatron/arguments/megatron_args.py:633",
    "save_steps": "megatron/arguments/megatron_args.py:563",
    "max_length": "arguments/base_args/template_args.py:130",
    "dataloader_num_workers": "megatron/arguments/megatron_args.py:516",
    "dataset_num_proc": "arguments/base_args/data_args.py:82",
    "no_save_optim": "megatron/arguments/megatron_args.py:564",
    "no_save_rng": "megatron/arguments/megatron_args.py:565",
    "async_save": "megatron/arguments/megatron_args.py:573",
    "sequence_parallel": "megatron/arguments/megatron_args.py:602",
    "attention_backend": "megatron/arguments/megatron_args.py:499",
    "optimizer_cpu_offload": "megatron/arguments/megatron_args.py:501",
    "use_precision_aware_optimizer": "megatron/arguments/megatron_args.py:504",
    "optimizer_offload_fraction": "megatron/arguments/megatron_args.py:502",
    "beta": "megatron/arguments/megatron_args.py:31",
    "loss_type": "megatron/arguments/megatron_args.py:27",
    "rpo_alpha": "megatron/arguments/megatron_args.py:32",
}
