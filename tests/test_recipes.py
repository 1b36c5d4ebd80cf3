"""The recipes' launches against the documented contracts, from the spec alone (no cluster):

Pai-Megatron-Patch's run_mcore_qwen3.sh: 27 positional arguments in the script's order, run from the
script's directory with WORLD_SIZE = nodes, RANK = node rank, KUBERNETES_CONTAINER_RESOURCE_GPU, MASTER_*;
ms-swift's `megatron rlhf` DPO: the flags of each version and its NNODES/NODE_RANK/NPROC_PER_NODE env;
and the configurations Pai, Megatron or ms-swift would reject later, each refused naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from a4ray.api import plan
from a4ray.core.errors import SpecError
from a4ray.driver.main import main as pipeline_main
from a4ray.spec import load_job
from a4ray.trainers import trainer_for
from a4ray.workloads.workload import Plan

REPO = Path(__file__).resolve().parents[1]
WS = "/mnt"
CKPT = "/mnt/ckpts/mcore/latest"


def launch_plan(kind: str, *sets: str) -> tuple[object, Plan]:
    spec = load_job(None, list(sets), kind=kind)
    work = trainer_for(spec, WS, CKPT)
    work.check()
    return work, work.plan()


def refusals(kind: str, *sets: str) -> str:
    spec = load_job(None, list(sets), kind=kind)
    with pytest.raises(SpecError) as e:
        trainer_for(spec, WS, CKPT).check()
    return str(e.value)


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_pai_qwen3_next_command_and_env_per_node(nodes):
    work, p = launch_plan("qwen3_next", f"cluster.nodes={nodes}")
    gbs = nodes * 8  # default: one micro-batch per data-parallel rank (TP=PP=CP=1), as the seeds' B200 run
    args = ["dlc", "A3B", "1", str(gbs), "1e-05", "1e-06", "1024", "1024", "bf16",
            "1", "1", "1", "1", "8", "true", "true", "true", "false", "none", "false", "50",
            f"{WS}/datasets/qwen-mmap/mmap_qwen3_datasets_text_document",
            f"{WS}/datasets/qwen-mmap/mmap_qwen3_datasets_text_document", CKPT,
            str(100 * gbs * 1024), str(10 * gbs * 1024),  # pretraining counts tokens: iterations x GBS x SEQ_LEN
            f"{WS}/logs/output_pai_qwen3_next_pretrain"]
    assert len(p.nodes) == nodes
    for rank, node in enumerate(p.nodes):
        assert node.argv == ["bash", "run_mcore_qwen3.sh", *args]
        assert len(node.argv) - 2 == 27
        assert node.cwd == f"{WS}/Pai-Megatron-Patch/examples/qwen3_next"
        assert node.env == {"WORLD_SIZE": str(nodes), "RANK": str(rank), "KUBERNETES_CONTAINER_RESOURCE_GPU": "8",
                            "MASTER_ADDR": "<node-0 ip>", "MASTER_PORT": "<free port on node 0>",
                            "OMP_NUM_THREADS": "12", "MP_DATASET_TYPE": "idxmap"}
    described = work.describe()
    assert described[0] == " 1 ENV=dlc" and described[23].startswith("24 PRETRAIN_CHECKPOINT_PATH=")
    assert described[26] == f"27 OUTPUT_BASEPATH={WS}/logs/output_pai_qwen3_next_pretrain"
    assert work.checkpoint_dir.endswith(f"checkpoint/pretrain-mcore-qwen3-next-A3B-lr-1e-05-minlr-1e-06-bs-1-gbs-{gbs}"
                                        "-seqlen-1024-pr-bf16-tp-1-pp-1-cp-1-ac-none-do-true-sp-true-ti-100-wi-10")


def test_pai_sft_from_json_is_the_seeds_use_json_sft():
    work, p = launch_plan("qwen3_next", "train.mode=sft", "train.iterations=200", "train.warmup_iterations=20",
                          "train.pai.recompute=full", "train.pai.recompute_layers=4", "train.pai.sft_packing=true")
    argv = p.nodes[0].argv[2:]
    assert argv[17] == "true" and argv[18] == "full"  # SFT, AC
    assert argv[21:23] == [f"{WS}/datasets/alpaca/alpaca_zh-train-general.json",
                           f"{WS}/datasets/alpaca/alpaca_zh-valid-general.json"]
    assert argv[24:26] == ["200", "20"]  # SFT counts iterations
    assert p.nodes[0].env["MP_DATASET_TYPE"] == "raw"
    assert p.nodes[0].env["MP_AC_LAYERS"] == "4" and p.nodes[0].env["MP_SFT_PACKING"] == "true"
    assert "finetune-mcore-qwen3-next-A3B" in work.checkpoint_dir


def test_pai_qwen3_is_seed_002():
    _, p = launch_plan("qwen3")
    seed = "dlc A3B 1 8 1e-05 1e-06 128 128 bf16 4 2 1 1 4 true true true false sel false 100"
    assert p.nodes[0].argv[2:23] == seed.split()
    assert p.nodes[0].argv[26:28] == [str(9 * 8 * 128), "0"]  # 9 iterations, like the seed's 10000 tokens
    assert p.nodes[0].cwd == f"{WS}/Pai-Megatron-Patch/examples/qwen3"
    for nodes in (1, 4):
        launch_plan("qwen3", f"cluster.nodes={nodes}")  # TP4 x PP2 fits 8, 16 and 32 GPUs with GBS 8


@pytest.mark.parametrize("sets, field", [
    (["cluster.nodes=4", "train.global_batch_size=8"],
     "train.global_batch_size=8 must be a multiple of train.micro_batch_size x data-parallel size = 1 x 32"),
    (["train.pai.parallel.tp=4"], "train.pai.parallel.tp=4 does not divide the 2 query groups"),
    (["train.pai.parallel.tp=3"], "tp*pp*cp = 3*1*1 = 3 does not divide the 16 GPUs"),
    (["train.pai.parallel.pp=5"], "train.pai.parallel.pp=5 does not divide the 96 layers"),
    (["train.pai.parallel.ep=16", "cluster.nodes=1"], "etp*ep*pp = 1*16*1 does not divide the 8 GPUs"),
    (["train.pai.parallel.pp=2", "train.pai.recompute=full", "train.pai.recompute_layers=5"],
     "train.pai.recompute_layers=5 does not divide the 48 layers of a pipeline stage"),
    (["train.pai.first_stage_layers=10"], "train.pai.first_stage_layers: an uneven pipeline split needs"),
    (["train.pai.optimizer_offload=0.5", "train.pai.distributed_optimizer=false"],
     "train.pai.optimizer_offload=0.5 needs train.pai.distributed_optimizer=true"),
    (["train.pai.load=none"], "train.pai.load=none: the script copies *.json and merges.txt"),
    (["train.mode=sft", "train.pai.pad_len=2048"], "train.pai.pad_len=2048 must equal train.seq_len=1024"),
    (["train.mode=sft", "train.sft_data=mmap"], "train.sft_mmap: required with train.sft_data=mmap"),
    (["train.pai.flash_attention=false"], "train.pai.flash_attention=false: Transformer Engine's fused attention"),
    (["train.pai.model_size=A37B"], "train.pai.model_size='A37B': examples/qwen3_next/run_mcore_qwen3.sh defines A3B"),
    (["train.pai.parallel.cp=2", "train.seq_len=1023"], "train.seq_len=1023 must be a multiple of 2 x"),
])
def test_pai_refuses_what_it_would_reject_later(sets, field):
    assert field in refusals("qwen3_next", *sets)


def test_refusals_come_before_anything_runs():
    spec = load_job(None, ["cluster.nodes=4", "train.global_batch_size=8"], kind="qwen3_next")
    with pytest.raises(SpecError, match="train.global_batch_size=8"):
        plan(spec)


def test_the_model_must_be_the_one_the_script_hard_codes():
    from a4ray.trainers.pai import check_hf_config, model_of

    spec = load_job(None, [], kind="qwen3_next")
    real = {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 48, "hidden_size": 2048,
            "num_attention_heads": 16, "num_key_value_heads": 2, "num_experts": 512, "full_attention_interval": 4}
    assert check_hf_config(real, model_of(spec), spec, "ckpt/config.json") == []
    tiny = {**real, "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_experts": 8}
    [problem] = check_hf_config(tiny, model_of(spec), spec, "ckpt/config.json")
    assert problem.startswith("train.model: ckpt/config.json is not Pai's A3B: layers 4 (the script's A3B: 48)")
    assert "hybrid pattern 'M-M-M-*-' x 12 and has no knob for fewer" in problem


def test_defaults_layer_under_partial_sections(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("kind: qwen3\ntrain:\n  pai:\n    parallel: {pp: 4}\n")
    spec = load_job(path)
    par = spec.train.pai.parallel
    assert (par.tp, par.pp, par.ep) == (4, 4, 4)  # the recipe's TP4/EP4 kept; PP from the file
    assert spec.train.pai.script == "examples/qwen3/run_mcore_qwen3.sh" and spec.train.global_batch_size == 8
    assert spec.set("train.pai.parallel.pp", 2).train.pai.parallel.ep == 4


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3", "swift_dpo"])
def test_shipped_a4_specs_are_the_recipe_defaults(kind):
    assert load_job(REPO / "jobs" / f"{kind}.yaml").model_dump() == load_job(None, kind=kind).model_dump()


# --------------------------------------------------------------------------------------------- swift


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_swift_3x_trains_from_mcore_with_the_seeds_flags(nodes):
    gbs = 4 if nodes < 4 else 8  # 4 nodes: TP4 leaves 8 data-parallel ranks (4 is refused below)
    _, p = launch_plan("swift_dpo", f"cluster.nodes={nodes}", f"train.global_batch_size={gbs}")
    for rank, node in enumerate(p.nodes):
        argv = node.argv
        assert argv[:4] == ["megatron", "rlhf", "--rlhf_type", "dpo"]
        flags = dict(zip(argv[4::2], argv[5::2]))
        assert flags["--load"] == CKPT and "--model" not in flags
        assert flags["--save"] == f"{WS}/megatron_output/Qwen3-30B-A3B-Instruct-2507"
        seed = {"--packing": "true", "--tensor_model_parallel_size": "4", "--expert_tensor_parallel_size": "1",
                "--expert_model_parallel_size": "8", "--recompute_granularity": "full", "--max_epochs": "1",
                "--num_workers": "8", "--save_interval": "200", "--eval_interval": "200",
                "--optimizer_cpu_offload": "true", "--attention_backend": "flash", "--sequence_parallel": "true",
                "--beta": "0.1", "--loss_type": "sigmoid", "--dataset": "AI-ModelScope/orpo-dpo-mix-40k",
                "--global_batch_size": str(gbs)}
        for flag, value in seed.items():
            assert flags[flag] == value, flag
        assert not {"--output_dir", "--num_train_epochs", "--save_steps", "--rpo_alpha"} & set(flags)
        assert node.env == {"NNODES": str(nodes), "NODE_RANK": str(rank), "NPROC_PER_NODE": "8",
                            "MASTER_ADDR": "<node-0 ip>", "MASTER_PORT": "<free port on node 0>",
                            "MODELSCOPE_CACHE": f"{WS}/modelscope-cache",
                            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_swift_3_12_and_4x_train_from_hf_weights():
    _, p = launch_plan("swift_dpo", "train.version=3.12.0")
    flags = dict(zip(p.nodes[0].argv[4::2], p.nodes[0].argv[5::2]))
    assert flags["--model"] == f"{WS}/ckpts/huggingface/Qwen3-30B-A3B-Instruct-2507"
    assert flags["--load_safetensors"] == "true" and "--load" not in flags and "--save" in flags
    _, p = launch_plan("swift_dpo", "train.version=4.5.2", "cluster.nodes=1", "train.rpo_alpha=0.1")
    flags = dict(zip(p.nodes[0].argv[4::2], p.nodes[0].argv[5::2]))
    assert flags["--model"] == f"{WS}/ckpts/huggingface/Qwen3-30B-A3B-Instruct-2507"
    assert flags["--save_safetensors"] == "true" and "--load_safetensors" not in flags
    assert flags["--output_dir"] == f"{WS}/megatron_output/Qwen3-30B-A3B-Instruct-2507"
    assert (flags["--num_train_epochs"], flags["--dataloader_num_workers"]) == ("1", "8")
    assert (flags["--save_steps"], flags["--eval_steps"], flags["--rpo_alpha"]) == ("200", "200", "0.1")
    assert flags["--load_from_cache_file"] == "true"  # ms-swift's default is false from 3.10; a4ray passes true
    assert not {"--save", "--max_epochs", "--num_workers", "--save_interval"} & set(flags)


@pytest.mark.parametrize("sets, field", [
    (["cluster.nodes=4"], "train.global_batch_size=4 must be a multiple of train.micro_batch_size x data-parallel "
                          "size = 1 x 8"),
    (["train.version=3.7.1"], "train.packing=true: ms-swift 3.7.1 has no DPO packing"),
    (["train.version=3.5.0", "train.packing=false"], "train.version=3.5.0: `megatron rlhf` (DPO) exists from"),
    (["train.version=4.0.0", "train.load=ckpts/x"], "train.load: ms-swift 4.0.0 trains from the HF weights"),
    (["train.parallel.ep=16", "cluster.nodes=1"], "etp*ep*pp = 1*16*1 does not divide the 8 GPUs"),
])
def test_swift_refuses_what_it_would_reject_later(sets, field):
    assert field in refusals("swift_dpo", *sets)


# ------------------------------------------------------------------------------------------ dry runs


def test_dry_run_prints_every_nodes_pai_command_for_4_nodes(capsys):
    assert pipeline_main("qwen3_next", ["--dry-run", "--set", "cluster.nodes=4"]) == 0
    out = capsys.readouterr().out
    assert "pipeline 'qwen3-next' (qwen3_next): stage -> convert -> preflight -> train on 4 node(s) x 8 GPU(s)" in out
    for rank in range(4):
        assert f"env: WORLD_SIZE=4 RANK={rank} KUBERNETES_CONTAINER_RESOURCE_GPU=8" in out
    assert out.count("bash run_mcore_qwen3.sh dlc A3B 1 32 ") == 4
    assert out.count("cd /mnt/Pai-Megatron-Patch/examples/qwen3_next") == 4
    assert "hf://Qwen/Qwen3-Next-80B-A3B-Instruct" in out and "[convert] Pai's distributed converter" in out


def test_dry_run_of_skips_names_what_must_exist(capsys):
    assert pipeline_main("qwen3_next", ["--dry-run", "--skip", "stage,convert", "--skip", "preflight"]) == 0
    out = capsys.readouterr().out
    assert "[stage] skipped: --skip stage" in out and "[preflight] skipped: --skip preflight" in out
    assert "must exist: the converted checkpoint (convert.output/latest): /mnt/ckpts/huggingface/" \
           "Qwen3-Next-80B-A3B-Instruct-to-mcore/latest/latest_checkpointed_iteration.txt" in out
    assert "must exist: artifact pai-megatron-patch (staged to Pai-Megatron-Patch): /mnt/Pai-Megatron-Patch" in out
    assert pipeline_main("qwen3_next", ["--dry-run", "--from", "train"]) == 0
    out = capsys.readouterr().out
    assert "[convert] skipped: --from train" in out and "[train] Pai-Megatron-Patch" in out
    # Where no later step runs, nothing reads a skipped step's outputs: staging alone asks for no checkpoint.
    assert pipeline_main("qwen3_next", ["--dry-run", "--skip", "convert,preflight,train"]) == 0
    out = capsys.readouterr().out
    assert "[convert] skipped: --skip convert" in out and "must exist" not in out, out
    assert "[stage] " in out and "[stage] skipped" not in out


def test_unknown_steps_and_bad_specs_are_refused(capsys, tmp_path):
    result = tmp_path / "r.json"
    assert pipeline_main("qwen3_next", ["--dry-run", "--skip", "download", "--result", str(result)]) == 2
    err = capsys.readouterr().err
    assert "pipeline.skip[0]: expected 'stage', 'convert', 'preflight' or 'train', got 'download'" in err
    assert json.loads(result.read_text())["ok"] is False


def test_the_a4_defaults_with_the_megatron_trainer_print_every_nodes_command_and_env(capsys):
    """`--dry-run --set train.trainer=megatron` of the A4 run: native conversion (the trainer loads megatron-core's
    own layout), and on each of the 2 nodes a4ray.mcore under the rank launcher with the seed's parallelism."""
    assert pipeline_main("qwen3_next", ["--dry-run", "--set", "train.trainer=megatron"]) == 0
    out = capsys.readouterr().out
    assert "[convert] a4ray's native converter: Ray tasks over layer ranges" in out
    assert "[train] a4ray's Megatron trainer: torchrun of a4ray.mcore on every node" in out
    for rank in (0, 1):
        command = next(line for line in out.splitlines() if line.strip().startswith("python3 -m a4ray.runtime.ranks")
                       and f"--node-rank={rank}" in line)
        assert "--nproc=8" in command and "-m a4ray.mcore --model /mnt/ckpts/huggingface/Qwen3-Next-80B" in command
        assert "--ep 8 " in command and "--global-batch-size 16 " in command and "--naming auto" in command
        assert "--load /mnt/ckpts/huggingface/Qwen3-Next-80B-A3B-Instruct-to-mcore/latest" in command
    assert "gib (auto): source /usr/local/gib/scripts/set_nccl_env.sh on each node" in out
    assert "layers: Transformer Engine's where it imports on the nodes" in out
    # The model every rank builds, before anything is staged: the published config of what stages there.
    assert ("model: qwen3_next: 48 layers (36 gated DeltaNet, 12 gated attention), hidden 2048, 16 heads / 2 KV "
            "groups, 512 experts (top-10), a gated shared expert, vocab 151936 (from "
            "Qwen/Qwen3-Next-80B-A3B-Instruct's published config.json)") in out
    # What the checkpoints will take, for the preflight's disk check: its published 80B parameters, 2 saves of 100.
    assert ("checkpoints: ~1,038.8 GiB each (79,674,391,296 parameters x 14 B: bf16 weights, fp32 main weights and "
            "Adam's two moments), 2 on disk at most under "
            "/mnt/logs/output_megatron_qwen3_next_pretrain/checkpoint") in out


def test_the_megatron_trainer_refuses_a_parallelism_the_model_cannot_take():
    spec = load_job(None, ["train.trainer=megatron", "train.megatron.parallel.ep=16", "cluster.nodes=4"],
                    kind="qwen3_next")
    moe = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32}
    problems = trainer_for(spec, WS, CKPT).check_model(moe, "/mnt/m/config.json")
    assert problems == ["train.megatron.parallel.ep=16 does not divide the 8 experts of /mnt/m/config.json"]
    tp = load_job(None, ["train.trainer=megatron", "train.megatron.parallel.tp=4", "train.megatron.parallel.ep=1"],
                  kind="qwen3_next")
    assert "train.megatron.parallel.tp=4 does not divide the 2 query groups of x" in \
        trainer_for(tp, WS, CKPT).check_model(moe, "x")
    sft = load_job(None, ["train.trainer=megatron", "train.mode=sft"], kind="qwen3_next")
    with pytest.raises(SpecError, match="train.mode=sft: the Megatron trainer pretrains"):
        trainer_for(sft, WS, CKPT).check()


def test_a4ray_run_and_stage_take_recipe_specs(capsys):
    from a4ray.cli import main

    assert main(["run", "-f", str(REPO / "jobs" / "qwen3.yaml"), "--dry-run"]) == 0
    assert "[train] Pai-Megatron-Patch examples/qwen3/run_mcore_qwen3.sh" in capsys.readouterr().out
    assert main(["stage", "-f", str(REPO / "jobs" / "qwen3_next.yaml"), "--dry-run"]) == 0
    assert "4 artifact(s)" in capsys.readouterr().out
    assert main(["stage", "-f", str(REPO / "jobs" / "ddp_test.yaml"), "--dry-run"]) == 2
    assert "a 'ddp_test' job stages nothing" in capsys.readouterr().err


def test_without_a_cluster_the_local_profile_is_used_or_the_gap_is_named(monkeypatch, capsys):
    import a4ray.runtime.connect

    monkeypatch.setattr(a4ray.runtime.connect, "will_embed", lambda address=None: True)
    assert pipeline_main("swift_dpo", []) == 2  # ms-swift DPO has no local trainer to rehearse with
    err = capsys.readouterr().err
    assert "swift_dpo has no local rehearsal profile" in err and "--dry-run" in err
    for kind in ("qwen3_next", "qwen3"):  # their profiles: the Megatron trainer on 2 simulated nodes
        spec = load_job(REPO / "jobs" / f"{kind}_local.yaml")
        assert spec.kind == kind and spec.train.trainer == "megatron" and spec.cluster.nodes == 2 and spec.standins
        assert spec.train.megatron.parallel.ep == 2  # expert parallelism across the two nodes
        assert {a.source.split("/")[1] for a in spec.artifacts} == {"standins"}
        # Both convert natively, never skipped: the trainer loads megatron-core's own layout.
        assert "[convert] a4ray's native converter: Ray tasks over layer ranges" in plan(spec)
    assert "the built-in trainer" not in plan(load_job(REPO / "jobs" / "qwen3_next_local.yaml"))


def test_the_a4_plan_and_a_backends_dry_run_import_no_torch(tmp_path):
    """The README's `python -m a4ray.qwen3_next --dry-run` (the A4 plan) and a pai conversion's dry run read specs and
    configs only: torch (and the converter's DCP writer behind it, 1.8 CPU-s) is imported where a checkpoint is opened,
    written or checked, never for a plan."""
    import subprocess
    import sys

    model = tmp_path / "Qwen3-30B-A3B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 48,
                                                   "hidden_size": 2048, "num_experts": 128}))
    probe = ("import runpy, sys; sys.argv = sys.argv[1:]; "
             "code = 0\ntry: runpy.run_module(sys.argv[0], run_name='__main__')\n"
             "except SystemExit as end: code = end.code\n"
             "print('TORCH', 'torch' in sys.modules, 'EXIT', code)")
    for argv in (["a4ray.qwen3_next", "--dry-run"],
                 ["a4ray.convert", "--dry-run", "--set", f"convert.input={model}", "--set", "convert.backend=pai",
                  "--set", "convert.pai.repo=/opt/pai", "--set", f"storage.workspace={tmp_path}"]):
        done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, cwd=tmp_path,
                              timeout=120)
        assert done.stdout.strip().endswith("TORCH False EXIT 0"), (argv, done.stdout[-2000:], done.stderr[-2000:])
