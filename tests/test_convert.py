"""HF -> Megatron-core conversion: real tiny Qwen3 / Qwen3-MoE / Qwen3-Next checkpoints (transformers, random
weights, GQA, several experts, sharded safetensors), converted by Ray tasks on the session's simulated A4 nodes
and verified with megatron-core on CPU (logits against the HF model, and a tensor-by-tensor round trip;
Qwen3-Next's layers on megatron-core's local layers, `a4ray.mcore.hybrid`, its gated delta rule on mcore's
torch reference).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from a4ray.core.errors import (
    ConvertFailed,
    ConvertInputError,
    InsufficientResources,
    SpecError,
    UnsupportedModel,
    VerifyFailed,
)
from a4ray.driver.execute import run as convert
from a4ray.hf2mcore.hf import HFCheckpoint
from a4ray.hf2mcore.mapping import (
    CONV_PARTS,
    IN_PROJ_PARTS,
    ExtraState,
    dropped,
    hf_tensors,
    slots,
    to_hf,
    to_mcore,
)
from a4ray.hf2mcore.native import check_disk, check_memory
from a4ray.staging.tiny import QWEN3_NEXT_TINY, write_tiny, write_tiny_next
from a4ray.mcore.architecture import Architecture
from a4ray.mcore.names import EXPERT_ROLES, LAYERS
from conftest import PYTHON, REPO, isolated_env, job
from upstream import PAI_CONVERTER_ARGS, PAI_DLC_ENV, pai_standin


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "moe": write_tiny(root / "tiny-moe", moe=True, layers=3, experts=4, topk=2),
        "dense": write_tiny(root / "tiny-dense", moe=False, layers=2, tied=True),
        "next": write_tiny_next(root / "tiny-next"),  # the Qwen3-Next stand-in's shape, every norm random
    }


def _spec(model: Path, output: Path, *sets: str, nodes: int = 2):
    return job("convert", f"convert.input={model}", f"convert.output={output}", f"cluster.nodes={nodes}",
               "cluster.gpus_per_node=2", "convert.tasks_per_node=2", *sets, workspace=output.parent)


def _committed(output: Path) -> list[str]:
    return sorted(p.name for p in output.iterdir()) if output.exists() else []


# ------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_moe_converts_on_two_nodes_verifies_and_is_then_a_cache_hit(local_cluster, models, tmp_path):
    out = tmp_path / "out"
    first = convert(_spec(models["moe"], out, "convert.min_part_mb=0"))  # a part per task slot: 4 of a tiny model
    assert first.ok and first.status == "ran"
    v = first.verify
    assert v.ok and v.logits_checked and v.max_abs_diff < 1e-4 and v.top1_agreement == 1.0
    assert v.tensors_checked == v.tensors_equal == sum(len(s.sources) for s in slots(_arch(models["moe"])))
    assert not v.missing_keys and not v.unexpected_keys
    assert len({p.node for p in first.parts}) == 2, "parts ran on both simulated nodes"

    root = Path(first.checkpoint)
    assert root.parent == out and (out / "latest").resolve() == root
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "release"
    release = root / "release"
    assert json.loads((release / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    common = torch.load(release / "common.pt", weights_only=False)
    assert common["args"].num_layers == 3 and common["args"].num_experts == 4 and common["checkpoint_version"] == 3.0
    assert len(list(release.glob("__*_0.distcp"))) == len(first.parts) > 2
    assert (root / "config.json").is_file() and not (root / "model.safetensors.index.json").exists()
    record = json.loads((root / "a4ray-convert.json").read_text())
    assert record["naming"] == "te" and record["layout"]["nodes"] == 2 and record["verify"]["ok"]
    # What the parts' and the verifier's Ray tasks print is in the run's logs (observe/stream.py), not Ray's stream.
    [logs] = (tmp_path / "runs").glob("convert-*/logs")
    assert sorted(p.name for p in logs.glob("*.log")) == sorted([f"part-{i}.log" for i in range(len(first.parts))]
                                                                + ["verify.log"])

    again = convert(_spec(models["moe"], out))
    assert again.status == "cached" and again.checkpoint == first.checkpoint and again.verify.ok

    # Another option is another conversion, next to the first: never written over it.
    local = convert(_spec(models["moe"], out, "convert.naming=local", "convert.precision=bf16"))
    assert local.status == "ran" and local.checkpoint != first.checkpoint and local.verify.ok
    assert local.verify.max_abs_diff < 1e-4  # the reference holds the same bf16-rounded weights
    assert (out / "latest").resolve() == Path(local.checkpoint)
    assert json.loads((root / "a4ray-convert.json").read_text()) == record
    assert _committed(out) == sorted([root.name, Path(local.checkpoint).name, "latest"])


@pytest.mark.slow
def test_qwen3_next_converts_on_two_nodes_verifies_by_logits_and_is_then_a_cache_hit(local_cluster, models, tmp_path):
    out = tmp_path / "out"
    first = convert(_spec(models["next"], out))
    assert first.ok and first.status == "ran"
    assert len({p.node for p in first.parts}) == 2, "parts ran on both simulated nodes"
    v, arch = first.verify, _arch(models["next"])
    # Every HF tensor back exactly (in_proj_qkvz / in_proj_ba / conv1d from their parts, the gated norm
    # through its -1 shift), and the logits of megatron-core's model of it equal to transformers' within the
    # tolerance every model is held to.
    assert v.ok and v.tensors_checked == v.tensors_equal == len(hf_tensors(arch)) and not v.tensors_rounded
    assert v.logits_checked and v.max_abs_diff < 1e-4 and v.top1_agreement == 1.0
    assert not v.missing_keys and not v.unexpected_keys
    assert f"round trip {v.tensors_equal}/{v.tensors_equal} HF tensors identical" in first.verdict
    assert "logits max |diff|" in first.verdict

    release = Path(first.checkpoint) / "release"
    from torch.distributed.checkpoint import FileSystemReader

    stored = {k: tuple(m.size) for k, m in FileSystemReader(str(release)).read_metadata().state_dict_metadata.items()
              if hasattr(m, "size")}
    # Layers keyed by index (mcore's non_homogeneous_layers); DeltaNet projections in mcore's parts.
    assert not any(k.startswith("decoder.layers.self_attention") for k in stored)
    L0, L3 = "decoder.layers.0.", "decoder.layers.3."
    assert [stored[f"{L0}self_attention.in_proj.weight.{part}"] for part in IN_PROJ_PARTS] == [
        (32, 64), (32, 64), (64, 64), (64, 64), (4, 64), (4, 64)]
    assert [stored[f"{L0}self_attention.conv1d.weight.{part}"] for part in CONV_PARTS] == [
        (32, 1, 4), (32, 1, 4), (64, 1, 4)]
    assert stored[L3 + "self_attention.linear_qkv.weight"] == ((2 * 4 + 2 * 2) * 16, 64)  # queries, gates, k, v
    assert stored[L3 + "mlp.experts.experts.linear_fc1.weight"] == (8, 64, 64)
    assert stored[L0 + "mlp.shared_experts.gate_weight"] == (1, 64)
    args = torch.load(release / "common.pt", weights_only=False)["args"]
    assert args.experimental_attention_variant == "gated_delta_net" and args.linear_attention_freq == 4

    again = convert(_spec(models["next"], out))
    assert again.status == "cached" and again.checkpoint == first.checkpoint and again.verify == first.verify

    # Mapping errors a round trip cannot see (wrong both ways) fail the logits, naming the tensors to look at.
    planted = subprocess.run([PYTHON, str(REPO / "tests" / "programs" / "plant_mapping_errors.py"), first.checkpoint,
                              str(models["next"]), str(tmp_path / "planted"), "none", "in_proj_groups", "norm_shift",
                              "gate_query"], capture_output=True, text=True, timeout=300, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    reports = [json.loads(line) for line in planted.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 4, planted.stderr[-3000:]
    clean, in_proj, shift, gate = reports
    assert clean["ok"] and clean["max_abs_diff"] < 1e-4 and clean["tensors_equal"] == len(hf_tensors(arch))
    for report, module, tensor in ((in_proj, "layer 0's linear_attn", "model.layers.0.linear_attn.in_proj_qkvz.weight"),
                                   (shift, "layer 0's linear_attn", "model.layers.0.linear_attn.norm.weight"),
                                   (gate, "layer 3's self_attn", "model.layers.3.self_attn.q_proj.weight")):
        assert not report["ok"] and report["logits_checked"] and len(report["problems"]) == 1
        problem = report["problems"][0]
        assert problem.startswith("logits: max |diff|") and f"{module} is the first to depart" in problem, problem
        assert tensor in problem, problem

    with pytest.raises(UnsupportedModel, match="convert.naming=local: Qwen3-Next has one naming, Transformer "
                                               "Engine's"):
        convert(_spec(models["next"], out, "convert.naming=local"))


@pytest.mark.slow
def test_dense_tied_embeddings_in_the_legacy_format(local_cluster, models, tmp_path):
    result = convert(_spec(models["dense"], tmp_path / "out", "convert.naming=local", "convert.format=legacy",
                           "convert.precision=bf16"))
    assert result.ok and result.verify.ok and result.verify.max_abs_diff < 1e-4
    state = torch.load(Path(result.checkpoint) / "release/mp_rank_00/model_optim_rng.pt", weights_only=False)["model"]
    assert "output_layer.weight" not in state  # tied: mcore reuses the embedding
    assert state["embedding.word_embeddings.weight"].dtype == torch.bfloat16


@pytest.mark.slow
def test_a_killed_task_commits_nothing_and_the_rerun_completes(local_cluster, models, tmp_path):
    out = tmp_path / "out"
    spec = _spec(models["moe"], out, "convert.max_mb_s_per_task=0.02", "name=killed")
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("error", _raises(convert, spec)))
    thread.start()
    victim = _wait_for_process("ray::a4ray-convert-killed-part-1", timeout=120)
    time.sleep(0.5)  # mid-run: the throttled part writes for seconds
    os.kill(victim, signal.SIGKILL)
    thread.join(timeout=180)
    error = outcome["error"]
    assert isinstance(error, ConvertFailed), error
    assert "part 1" in str(error) and "worker process died" in str(error)
    assert [p for p in _committed(out) if p != ".failed"] == [], "nothing committed, no temporary left"

    rerun = convert(_spec(models["moe"], out))
    assert rerun.status == "ran" and rerun.verify.ok
    assert (Path(rerun.checkpoint) / "release/.metadata").is_file()


@pytest.mark.slow
def test_pai_backend_runs_the_toolkit_script_on_every_node(local_cluster, models, tmp_path):
    """Pai's converter needs Transformer Engine and GPUs; a stand-in for its run_8xH20.sh, with the same
    contract, checks the positional arguments and env it is given on each node and writes what Pai's rank 0
    writes (a TE-named torch_dist checkpoint under release/, made here by the native backend). What is tested
    is a4ray's side: the gang launch, the env contract, the commit and the verification of a pai output."""
    made = convert(_spec(models["moe"], tmp_path / "native"))
    repo = tmp_path / "Pai-Megatron-Patch"
    script = repo / "toolkits/distributed_checkpoints_convertor/scripts/qwen3/run_8xH20.sh"
    seen = tmp_path / "seen"
    seen.mkdir()
    pai_standin(script, args=len(PAI_CONVERTER_ARGS), env=PAI_DLC_ENV, body=f"""\
[ "$(basename "$PWD")" = distributed_checkpoints_convertor ]
[ "$1" = A3B ] && [ "$4" = false ] && [ "$5" = true ] && [ "$6" = fp32 ]
echo "$WORLD_SIZE $RANK $KUBERNETES_CONTAINER_RESOURCE_GPU $MASTER_ADDR $MASTER_PORT $2" > {seen}/node-$RANK
if [ "$RANK" = 0 ]; then
  mkdir -p "$3" && cp -r {made.checkpoint}/release "$3/" && echo release > "$3/latest_checkpointed_iteration.txt"
fi
""")
    result = convert(_spec(models["moe"], tmp_path / "out", "convert.backend=pai", f"convert.pai.repo={repo}",
                           "convert.pai.model_size=A3B", "convert.verify.enabled=true"))
    assert result.ok and result.status == "ran" and result.verify.ok and result.verify.max_abs_diff < 1e-4
    lines = sorted((seen / f"node-{r}").read_text().split() for r in (0, 1))
    assert [line[:3] for line in lines] == [["2", "0", "2"], ["2", "1", "2"]]
    assert lines[0][3:] == lines[1][3:] and lines[0][5] == str(models["moe"])


def test_pai_and_swift_dry_runs_print_each_nodes_documented_command(tmp_path):
    model = tmp_path / "Qwen3-30B-A3B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 48, "hidden_size": 2048,
        "num_experts": 128, "torch_dtype": "bfloat16"}))

    def start(*sets: str) -> None:
        result = tmp_path / f"plan-{len(runs)}.json"
        proc = subprocess.Popen([PYTHON, "-m", "a4ray.cli", "convert", "--dry-run", "--result", str(result),
                                 "--set", f"convert.input={model}", "--set", f"storage.workspace={tmp_path}",
                                 *[a for s in sets for a in ("--set", s)]],
                                env=isolated_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=REPO)
        runs.append((proc, result))

    def dry(index: int) -> dict:
        err, code, result = finished[index]
        assert code == 0, err
        return json.loads(result.read_text())

    # All four at once: each is mostly Python importing a4ray, and side by side they share the cores.
    runs: list[tuple[subprocess.Popen, Path]] = []
    start("convert.backend=pai", "convert.pai.repo=/opt/pai", "cluster.nodes=2")
    start("convert.backend=swift", "cluster.nodes=1", "convert.swift.version=3.8.0")
    start("convert.backend=swift", "cluster.nodes=1", "convert.swift.version=3.12.0",
          "convert.swift.nproc_per_node=8", "convert.swift.expert_model_parallel_size=8")
    start("convert.backend=swift", "cluster.nodes=1", "convert.swift.version=4.5.2")
    finished = [(proc.communicate(timeout=300)[1], proc.returncode, result) for proc, result in runs]

    pai = dry(0)
    toolkit = "/opt/pai/toolkits/distributed_checkpoints_convertor"
    for rank, node in enumerate(pai["nodes"]):
        assert node["cwd"] == toolkit
        assert node["argv"][:4] == ["bash", "scripts/qwen3/run_8xH20.sh", "A3B", str(model)]
        assert node["argv"][5:] == ["false", "true", "bf16"] and "/.tmp-" in node["argv"][4]
        assert node["env"]["WORLD_SIZE"] == "2" and node["env"]["RANK"] == str(rank)
        assert node["env"]["KUBERNETES_CONTAINER_RESOURCE_GPU"] == "8"
        assert {"MASTER_ADDR", "MASTER_PORT"} <= set(node["env"])

    swift = dry(1)
    (node,) = swift["nodes"]
    assert node["argv"][:6] == ["swift", "export", "--model", str(model), "--to_mcore", "true"]
    assert node["argv"][6:8] == ["--torch_dtype", "bfloat16"] and node["argv"][8] == "--output_dir"
    # The output is the temporary a4ray made already; ms-swift refuses an existing one unless exist_ok
    # (v3.8.0 swift/llm/argument/export_args.py L67, L95-96). tests/test_swift_contract.py parses it for real.
    assert node["argv"][10:12] == ["--exist_ok", "true"]

    multi = dry(2)
    (node,) = multi["nodes"]
    assert node["argv"][:2] == ["megatron", "export"] and "--save" in node["argv"]
    assert node["argv"][node["argv"].index("--exist_ok") + 1] == "true"
    assert node["argv"][node["argv"].index("--expert_model_parallel_size") + 1] == "8"
    assert node["env"]["NPROC_PER_NODE"] == "8"

    skipped = dry(3)
    assert skipped["nodes"] == [] and any("trains from the HF safetensors directly" in d for d in skipped["details"])


# -------------------------------------------------------------------------------- bad input


def test_bad_inputs_get_errors_that_name_the_problem(models, tmp_path):
    config = json.loads((models["moe"] / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match="Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3NextForCausalLM") as err:
        Architecture.from_config({**config, "architectures": ["DeepseekV3ForCausalLM"]}, "input x")
    assert "backend: pai" in err.value.hint

    broken = tmp_path / "broken"
    shutil.copytree(models["moe"], broken)
    victim = sorted(broken.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ConvertInputError, match=victim.name):
        HFCheckpoint.open(broken)

    wrong = tmp_path / "wrong"
    shutil.copytree(models["moe"], wrong)
    (wrong / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 48}))
    hf = HFCheckpoint.open(wrong)
    with pytest.raises(ConvertInputError, match=r"gate_proj.weight in .*shape \[32, 64\], config.json implies \[48"):
        hf.check(hf_tensors(hf.architecture()))

    with pytest.raises(InsufficientResources, match="free"):
        check_disk(tmp_path, 10**18)

    with pytest.raises(SpecError, match="convert.naming=local"):
        from a4ray.hf2mcore.converter import ConvertWorkload

        ConvertWorkload(job("convert", "convert.input=x", "convert.backend=pai", "convert.naming=local")).check()


def test_the_cache_key_follows_the_input(tmp_path):
    from a4ray.hf2mcore.hf import fingerprint

    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = fingerprint(tmp_path)
    assert fingerprint(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"y" * 11)
    assert fingerprint(tmp_path) != first
    (tmp_path / "manifest.json").write_text('{"files": {"model.safetensors": {"sha256": "abc"}}}')
    staged = fingerprint(tmp_path)
    assert staged["kind"] == "staging-manifest"
    (tmp_path / "model.safetensors").touch()  # staging's manifest, not file times, identifies a staged input
    assert fingerprint(tmp_path) == staged


def test_temporaries_of_dead_runs_are_swept_and_live_ones_kept(tmp_path):
    import socket

    from a4ray.hf2mcore.cache import OWNER, OutputDir

    dead = subprocess.Popen(["true"])
    dead.wait()
    for name, pid in ((".tmp-aaaa-dead", dead.pid), (".tmp-aaaa-live", os.getpid())):
        (tmp_path / name).mkdir()
        (tmp_path / name / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    fresh = OutputDir(tmp_path, "b" * 64).temporary()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".tmp-aaaa-live", fresh.name])


def test_too_little_memory_is_refused_before_anything_runs(local_cluster):
    with pytest.raises(InsufficientResources, match="lower convert.tasks_per_node"):
        check_memory(job("convert", "cluster.nodes=2"), 10**15, "the conversion")


@pytest.mark.slow
def test_a_failed_conversion_leaves_no_checkpoint(local_cluster, models, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(models["moe"], broken)
    (broken / "config.json").write_text(json.dumps({**json.loads((broken / "config.json").read_text()),
                                                    "hidden_size": 96}))
    with pytest.raises(ConvertInputError, match="do not match config.json"):
        convert(_spec(broken, tmp_path / "out"))
    assert _committed(tmp_path / "out") == []


# ----------------------------------------------------------------------------------- mapping


def test_qkv_is_interleaved_per_query_group_and_maps_back():
    arch = Architecture(family="qwen3", layers=1, hidden=4, heads=4, groups=2, head_dim=1, ffn=8, vocab=8,
                        tied=False, norm_eps=1e-6, rope_theta=1e6, rope_type="default", max_positions=8,
                        dtype="float32")
    slot = next(s for s in slots(arch) if s.role == "qkv")
    q = torch.arange(4.0)[:, None].expand(4, 4)  # query heads 0..3
    k, v = 10 + torch.arange(2.0)[:, None].expand(2, 4), 20 + torch.arange(2.0)[:, None].expand(2, 4)
    fused = to_mcore(slot, [q, k, v], arch)
    # group g = [its query heads, its key head, its value head]
    assert fused[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert all(torch.equal(a, b) for a, b in zip(to_hf(slot, fused, arch), [q, k, v]))


def _next_arch() -> Architecture:
    from transformers import Qwen3NextConfig

    return Architecture.from_config({**Qwen3NextConfig(**QWEN3_NEXT_TINY).to_dict(),
                                     "architectures": ["Qwen3NextForCausalLM"]}, "stand-in")


def test_qwen3_next_layouts_give_mcore_what_hf_computes():
    """Each mcore tensor, split as megatron-core's forward splits it (attention.py, gated_delta_net.py),
    yields what the HF module computes from the HF tensors: the mapping's meaning, not only its inverse."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    arch = _next_arch()
    layer = {s.role: s for s in slots(arch) if s.layer == 0} | {s.role: s for s in slots(arch) if s.layer == 3}
    torch.manual_seed(0)
    x = torch.randn(5, arch.hidden)

    # Gated attention: HF's q_proj holds each head's [query; gate]; mcore's linear_qkv, per group,
    # [queries; gates; k; v], split by get_query_key_value_tensors(output_gate=True).
    d, ng, per = arch.head_dim, arch.groups, arch.heads // arch.groups
    q_proj, k_proj, v_proj = (torch.randn(shape) for _, shape in layer["qkv"].sources)
    hf_query, hf_gate = (x @ q_proj.T).view(5, arch.heads, 2 * d).chunk(2, dim=-1)
    mixed = (x @ to_mcore(layer["qkv"], [q_proj, k_proj, v_proj], arch).T).view(5, ng, (2 * per + 2) * d)
    query, gate, key, value = mixed.split([per * d, per * d, d, d], dim=-1)
    assert torch.allclose(query.reshape(5, arch.heads, d), hf_query)
    assert torch.allclose(gate.reshape(5, arch.heads, d), hf_gate)
    assert torch.allclose(key.reshape(5, ng, d), (x @ k_proj.T).view(5, ng, d))
    assert torch.allclose(value.reshape(5, ng, d), (x @ v_proj.T).view(5, ng, d))

    # DeltaNet: mcore's in_proj (its parts, in order) then its forward's splits = HF's fix_query_key_value_ordering.
    hf = Qwen3NextGatedDeltaNet(Qwen3NextConfig(**QWEN3_NEXT_TINY), 0)
    tensors = {name: param.detach() for name, param in hf.named_parameters()}

    def mcore(role):
        slot = layer[role]
        return to_mcore(slot, [tensors[slot.sources[0][0].split("linear_attn.")[1]]], arch)

    in_proj = torch.cat([mcore(f"in_proj.{part}") for part in IN_PROJ_PARTS])
    qk, v, heads = 2 * 16, 4 * 16, 4
    qkv, z, beta, alpha = (x @ in_proj.T).split([2 * qk + v, v, heads, heads], dim=-1)
    query, key, value = qkv.split([qk, qk, v], dim=-1)
    with torch.no_grad():
        want = hf.fix_query_key_value_ordering(hf.in_proj_qkvz(x[None]), hf.in_proj_ba(x[None]))
    for ours, theirs in zip((query, key, value, z, beta, alpha), want):
        assert torch.allclose(ours, theirs.reshape(5, -1))
    # conv1d runs over [q; k; v] channels in both: the parts, in order, are HF's weight.
    assert torch.equal(torch.cat([mcore(f"conv1d.{part}") for part in CONV_PARTS]), tensors["conv1d.weight"])


def test_qwen3_next_mtp_layer_is_said_to_be_dropped(models):
    arch = _arch(models["next"])
    names = list(HFCheckpoint.open(str(models["next"])).tensors)
    assert dropped(arch, names) is None  # transformers' tiny model has no MTP layer: nothing to say
    note = dropped(arch, [*names, "mtp.fc.weight", "mtp.layers.0.mlp.gate.weight", "mtp.norm.weight"])
    assert note == ("not converted: 3 tensor(s) of qwen3_next's multi-token-prediction layer (mtp.*): the "
                    "megatron-core model is built without MTP (mtp_num_layers unset), as transformers' model is; "
                    "pretraining from this checkpoint starts without the MTP loss")


def test_the_parameter_count_is_every_element_of_the_checkpoint(models):
    """What the preflight reckons the checkpoints' size from: the count from config.json alone equals the elements
    of the real safetensors transformers wrote (tied embeddings counted once), and the published Qwen3-Next is
    the 80B its name says."""
    import math

    from a4ray.hf2mcore.mapping import parameters
    from a4ray.mcore.architecture import PUBLISHED_CONFIGS

    for name in ("moe", "dense", "next"):
        stored = HFCheckpoint.open(str(models[name])).tensors.values()
        assert parameters(_arch(models[name])) == sum(math.prod(t.shape) for t in stored), name
    published = Architecture.from_config(PUBLISHED_CONFIGS["Qwen/Qwen3-Next-80B-A3B-Instruct"], "published")
    assert 79e9 < parameters(published) < 81e9


def test_qwen3_next_slots_tile_every_hf_tensor_and_map_back():
    """Every HF row goes to exactly one mcore tensor, and back; the gated norm by its zero-centring shift,
    which is exact where w - 1 is representable and otherwise rounds once (what the verifier then checks)."""
    arch = _next_arch()
    torch.manual_seed(0)
    hf = {name: (1 + 0.1 * torch.randn(shape)).to(torch.bfloat16) for name, shape in hf_tensors(arch).items()}
    back: dict = {}
    for slot in slots(arch):
        tensor = to_mcore(slot, [hf[name] for name, _ in slot.sources], arch)
        assert tensor.shape == slot.shape, slot.role
        to_hf(slot, tensor, arch, into=back)
    assert all(torch.equal(hf[name], back[name]) for name in hf)
    norm = next(s for s in slots(arch) if s.role == "out_norm")
    w = torch.tensor([1.5, 1.0, 0.5, 0.25] * 4, dtype=torch.bfloat16)  # a value head's 16 weights
    shifted = to_mcore(norm, [w], arch)
    assert shifted.tolist() == [0.5, 0.0, -0.5, -0.75] * 4 and torch.equal(to_hf(norm, shifted, arch)[0], w)
    tiny = torch.full((16,), 0.001, dtype=torch.bfloat16)  # 0.001 - 1 rounds to -1 in bf16
    assert to_hf(norm, to_mcore(norm, [tiny], arch), arch)[0].eq(0).all()


@pytest.mark.parametrize("refuse", ["", "copy_file_range", "skip_data"])
def test_spliced_records_load_as_the_tensor_they_stand_for(tmp_path, monkeypatch, refuse):
    """A record whose bytes the kernel copies in from the input loads as that tensor, also where the
    kernel refuses to copy between the two filesystems or torch.save leaves no room for the bytes."""
    import contextlib
    import errno
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    from a4ray.hf2mcore import writer

    def cross_device(*args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    source = torch.arange(24, dtype=torch.float32)
    (tmp_path / "src.bin").write_bytes(b"head" + source.numpy().tobytes())
    if refuse == "copy_file_range":
        monkeypatch.setattr(os, "copy_file_range", cross_device)
    if refuse == "skip_data":
        monkeypatch.setattr(torch.serialization, "skip_data", contextlib.nullcontext)
    fd = os.open(tmp_path / "src.bin", os.O_RDONLY)
    # rows 4..5 then rows 0..1 of a [6, 4] tensor: two runs, reordered
    splice = writer.Splice((4, 4), torch.float32, [(fd, 4 + 64, 32), (fd, 4, 32)])
    plan = writer.FileSystemWriter(".").prepare_global_plan(
        [SavePlan([WriteItem(index=MetadataIndex("t"), type=WriteItemType.TENSOR)])])[0]
    (result,) = writer.write_part(tmp_path, plan, lambda item: splice)
    os.close(fd)
    info = result.storage_data
    record = (tmp_path / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    loaded = torch.load(io.BytesIO(record), weights_only=True)
    assert torch.equal(loaded, torch.cat([source.view(6, 4)[4:], source.view(6, 4)[:2]]))


def test_extra_state_names_are_mcores_sharded_object_keys():
    extra = ExtraState("decoder.layers.mlp.experts.experts.linear_fc1", (0, 1), (2, 4), "layer 0")
    assert extra.fqn == "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_0.1_2.4"


# ----------------------------------------------------------------------------------- helpers


def _arch(model: Path) -> Architecture:
    return HFCheckpoint.open(model).architecture()


def _raises(fn, *args):
    try:
        fn(*args)
    except Exception as error:  # noqa: BLE001 - returned for the test to inspect
        return error
    return None


def _wait_for_process(title: str, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if title in " ".join(proc.info["cmdline"] or []):
                return proc.info["pid"]
        time.sleep(0.1)
    raise AssertionError(f"no process {title!r} within {timeout}s")


@pytest.mark.slow
def test_verification_catches_a_corrupted_checkpoint(local_cluster, models, tmp_path):
    """Converted without verification, then one tensor's bytes are damaged on disk: verifying the cached
    conversion must fail, name what differs, and take the checkpoint out of service."""
    from torch.distributed.checkpoint import FileSystemReader

    out = tmp_path / "out"
    unverified = convert(_spec(models["moe"], out, "convert.verify.enabled=false"))
    assert unverified.status == "ran" and unverified.verify is None
    release = Path(unverified.checkpoint) / "release"
    storage = FileSystemReader(str(release)).read_metadata().storage_data
    where = next(info for index, info in storage.items()
                 if index.fqn == "decoder.layers.self_attention.linear_qkv.weight" and index.offset[0] == 1)
    with open(release / where.relative_path, "r+b") as f:  # inside the tensor's payload: readable, wrong
        f.seek(where.offset + where.length // 2)
        f.write(bytes(64))
    with pytest.raises(VerifyFailed, match=r"round trip: model.layers.1.self_attn.[qkv]_proj.weight differs"):
        convert(_spec(models["moe"], out))
    assert not (out / "latest").exists() and not Path(unverified.checkpoint).exists()
    assert list((out / ".failed").iterdir())


def _te_parameters(arch: Architecture) -> dict[int | None, dict[str, tuple[int, ...]]]:
    """layer (None: outside the layers) -> {state-dict name: shape} of megatron-core's TE spec of Qwen3-Next, as
    a4ray.mcore.names describes it (the tensors the converter writes), the experts aside."""
    out: dict[int | None, dict[str, tuple[int, ...]]] = {}
    for slot in slots(arch):
        if slot.role in EXPERT_ROLES:
            continue
        name, shape = slot.state_key("te"), slot.shape
        known = out.setdefault(slot.layer, {}).get(name)
        if known:  # in_proj / conv1d: one parameter, its parts' rows stacked
            shape = (known[0] + shape[0], *shape[1:])
        out[slot.layer][name] = shape
    return out


@pytest.mark.slow
def test_one_qwen3_next_checkpoint_loads_into_each_spec_with_the_te_names(local_cluster, models, tmp_path):
    """The converted checkpoint loads into megatron-core's local layers (and, where Transformer Engine
    imports, its TE spec); the local spec's parameters are, layer by layer, the names and shapes the TE
    naming of a4ray.mcore.names describes, and its experts (SequentialMLP, not TEGroupedMLP) have the TE
    spec's torch_dist keys and shapes."""
    arch = _arch(models["next"])
    converted = convert(_spec(models["next"], tmp_path / "out", "convert.verify.enabled=false"))
    done = subprocess.run([PYTHON, str(REPO / "tests" / "programs" / "spec_layers.py"), converted.checkpoint,
                           str(models["next"])], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    specs = json.loads(done.stdout.splitlines()[-1])
    assert "local" in specs and ("te" in specs) == (importlib.util.find_spec("transformer_engine") is not None)
    expected = _te_parameters(arch)
    for naming, built in specs.items():
        params: dict[int | None, dict[str, tuple[int, ...]]] = {}
        for name, shape in built["params"].items():
            if ".mlp.experts." in name:
                continue
            layer = int(name.split(".")[2]) if name.startswith(LAYERS) else None
            params.setdefault(layer, {})[name] = tuple(shape)
        for layer in [None, *range(arch.layers)]:
            assert params[layer] == expected[layer], f"{naming} spec, layer {layer}"
        experts = {s.sharded_key("te"): s.global_shape(arch) for s in slots(arch) if s.role in EXPERT_ROLES}
        assert set(built["expert_keys"]) == set(experts)
        assert all(tuple(shape) == experts[key] for key, shape in built["expert_keys"].items() if shape)
