"""The pai and swift backends: each node's command line and environment, as those tools document them.

pai: Pai-Megatron-Patch's `toolkits/distributed_checkpoints_convertor/scripts/<model>/run_*.sh`, run from
that directory on every node with positional arguments `MODEL_SIZE LOAD_DIR SAVE_DIR MG2HF USE_CUDA PR`
and the PAI-DLC env contract the script reads: `WORLD_SIZE` = node count, `RANK` = node rank,
`KUBERNETES_CONTAINER_RESOURCE_GPU` = GPUs per node, `MASTER_ADDR`, `MASTER_PORT` (it runs one torchrun
per node itself). It needs Transformer Engine and GPUs, and writes `release/` with TE naming.

swift: `swift export --model <hf> --to_mcore true --torch_dtype <dtype> --output_dir <dir> --exist_ok true` on
one node (`<dir>` is the conversion's temporary, which exists already); with several GPUs, `megatron export ...
--to_mcore true --exist_ok true` with `NPROC_PER_NODE` (ms-swift >= 3.10; 4.x names the output `--output_dir`,
3.x `--save`). From 4.0 on ms-swift trains from the HF weights directly
(mcore-bridge), so the offline conversion is skipped unless forced.

Sources: Pai-Megatron-Patch a098ca5's `toolkits/distributed_checkpoints_convertor` (its scripts/qwen3*/ runners) and
ms-swift's `swift export --to_mcore` / `megatron export` (README quick start, `examples/megatron/export/full.sh`).
"""

from __future__ import annotations

from pathlib import Path

from a4ray.core.errors import UnsupportedModel
from a4ray.runtime.launch import Launch, NodeContext
from a4ray.spec.conversion import ConvertSpec, PaiConvertSpec, SwiftConvertSpec

PAI_TOOLKIT = "toolkits/distributed_checkpoints_convertor"
# (architecture, layers, hidden, experts) -> the MODEL_SIZE Pai's scripts define (they hard-code each
# size's shape, so a size that is not listed cannot go through them).
PAI_SIZES = {
    ("Qwen3ForCausalLM", 28, 1024, 0): "0.6B", ("Qwen3ForCausalLM", 28, 2048, 0): "1.7B",
    ("Qwen3ForCausalLM", 36, 2560, 0): "4B", ("Qwen3ForCausalLM", 36, 4096, 0): "8B",
    ("Qwen3ForCausalLM", 40, 5120, 0): "14B", ("Qwen3ForCausalLM", 64, 5120, 0): "32B",
    ("Qwen3MoeForCausalLM", 48, 2048, 128): "A3B", ("Qwen3MoeForCausalLM", 94, 4096, 128): "A22B",
    ("Qwen3NextForCausalLM", 48, 2048, 512): "A3B",
}
# The output directory is the conversion's fresh temporary, which cache.py creates (with its owner file) before
# the command runs; ms-swift's export refuses an existing output directory unless told (`exist_ok` defaults to
# false: v3.8.0 swift/llm/argument/export_args.py L67/L95-96, v4.5.2 swift/megatron/arguments/export_args.py
# L23/L37-38).
EXIST_OK = ("--exist_ok", "true")
MEGATRON_EXPORT_FROM = (3, 10)  # the first tag with swift/cli/_megatron/export.py
_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def pai_model(config: dict, pai: PaiConvertSpec, source: str) -> tuple[str, str]:
    """(MODEL_SIZE, script path relative to the toolkit) for this HF config."""
    arch = (config.get("architectures") or ["?"])[0]
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    size = pai.model_size or PAI_SIZES.get((arch, config.get("num_hidden_layers"), config.get("hidden_size"), experts))
    if not size:
        known = sorted({f"{a} {s}" for (a, *_), s in PAI_SIZES.items()})
        raise UnsupportedModel(
            f"{source}: {arch} with {config.get('num_hidden_layers')} layers, hidden {config.get('hidden_size')}"
            f"{f', {experts} experts' if experts else ''} is not a model Pai's converter scripts define "
            f"(they define: {', '.join(known)})",
            hint="use backend: native for Qwen3 / Qwen3-MoE / Qwen3-Next, or set convert.pai.model_size and "
                 "convert.pai.script")
    return size, pai.script or pai_script(arch, size)


def pai_planned_size(script: str) -> str:
    """MODEL_SIZE for a plan made before config.json is readable: the size, where the script defines only one."""
    sizes = {size for (arch, *_), size in PAI_SIZES.items() if pai_script(arch, size) == script}
    return sizes.pop() if len(sizes) == 1 else "<MODEL_SIZE from config.json>"


def pai_script(arch: str, size: str) -> str:
    """The converter script (relative to the toolkit) that defines this model: Qwen3-Next has its own
    (`--synchronizer qwen3_next`, Megatron-LM-250908), Qwen3 and Qwen3-MoE share one, A22B needs 16 GPUs."""
    if arch == "Qwen3NextForCausalLM":
        return "scripts/qwen3_next/run_8xH20.sh"
    return "scripts/qwen3/run_A22B_16xH20.sh" if size == "A22B" else "scripts/qwen3/run_8xH20.sh"


def precision_name(precision: str, config_dtype: str) -> str:
    return _PRECISION.get(config_dtype, "bf16") if precision == "auto" else precision


def pai_contract_env(node: NodeContext) -> dict[str, str]:
    """The PAI-DLC launch contract Pai's run and conversion scripts read in `dlc` mode."""
    return {"WORLD_SIZE": str(node.nnodes), "RANK": str(node.rank), "KUBERNETES_CONTAINER_RESOURCE_GPU": str(node.gpus),
            "MASTER_ADDR": str(node.master_addr), "MASTER_PORT": str(node.master_port)}


def pai_launch(node: NodeContext, c: ConvertSpec, repo: str, model: tuple[str, str], input_dir: str,
               save_dir: str, config_dtype: str) -> Launch:
    size, script = model
    env = {**pai_contract_env(node), "OMP_NUM_THREADS": str(c.pai.omp_num_threads)}
    if c.pai.model_parallel_args:
        env["MODEL_PARALLEL_ARGS"] = c.pai.model_parallel_args
    argv = ["bash", script, size, input_dir, save_dir, "false", "true" if c.pai.use_cuda else "false",
            precision_name(c.precision, config_dtype)]
    return Launch(argv=argv, env=env, cwd=str(Path(repo) / PAI_TOOLKIT))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3])


def swift_skip_reason(swift: SwiftConvertSpec) -> str | None:
    if _version(swift.version) >= (4,) and not swift.force:
        return (f"ms-swift {swift.version} trains from the HF safetensors directly (mcore-bridge): give the "
                f"trainer `--model <hf dir>`; no offline conversion needed (convert.swift.force=true converts anyway)")
    return None


def swift_check(swift: SwiftConvertSpec) -> list[str]:
    if swift.nproc_per_node > 1 and _version(swift.version) < MEGATRON_EXPORT_FROM:
        return [f"convert.swift.nproc_per_node={swift.nproc_per_node}: ms-swift {swift.version} has no "
                "`megatron export`; its `swift export` converts in one process (set nproc_per_node=1)"]
    return []


def swift_launch(node: NodeContext, c: ConvertSpec, input_dir: str, save_dir: str, config_dtype: str) -> Launch:
    s = c.swift
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[precision_name(c.precision, config_dtype)]
    check = ["--test_convert_precision", "true"] if s.test_convert_precision else []
    if s.nproc_per_node == 1:
        argv = ["swift", "export", "--model", input_dir, "--to_mcore", "true", "--torch_dtype", dtype,
                "--output_dir", save_dir, *EXIST_OK, *check]
        return Launch(argv=argv, env={})
    output_flag = "--output_dir" if _version(s.version) >= (4,) else "--save"
    argv = ["megatron", "export", "--model", input_dir, output_flag, save_dir, "--to_mcore", "true",
            "--torch_dtype", dtype, "--tensor_model_parallel_size", str(s.tensor_model_parallel_size),
            "--expert_model_parallel_size", str(s.expert_model_parallel_size),
            "--pipeline_model_parallel_size", str(s.pipeline_model_parallel_size), *EXIST_OK, *check]
    # swift's launcher execs torchrun with these (swift/cli/main.py); one node, the gang's port.
    return Launch(argv=argv, env={"NPROC_PER_NODE": str(s.nproc_per_node), "MASTER_PORT": str(node.master_port)})
