"""What a4ray launches, held to facts read from the pinned upstream files of tools that cannot run here
(tests/upstream.py: Pai-Megatron-Patch a098ca5, DeepEP 8a07e7e, nccl-tests v2.17.6, ms-swift's tags), and to
a4ray's own images (docker/). ms-swift itself parses a4ray's commands in tests/test_swift_contract.py.
"""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from a4ray.hf2mcore.backends import PAI_SIZES, pai_script, swift_check
from a4ray.parsers import deepep_log, nccl_tests
from a4ray.spec import load_job
from a4ray.spec.conversion import SwiftConvertSpec
from a4ray.spec.job import JOB_KINDS
from a4ray.spec.nccl import NCCL_TESTS_DIRS
from a4ray.trainers import trainer_for
from a4ray.workloads.internode import DeepEPTest
from conftest import PYTHON, REPO, isolated_env
from upstream import (
    DEEPEP_CASES,
    DEEPEP_LINES,
    DEEPEP_OPTIONS,
    NCCL_TESTS_AVG_FORMAT,
    NCCL_TESTS_COLUMNS,
    NCCL_TESTS_CONCLUDED_FORMAT,
    NCCL_TESTS_OOB_FORMAT,
    NCCL_TESTS_WRONG_FORMAT,
    PAI_CONVERTER_ARGS,
    PAI_CONVERTERS,
    PAI_DLC_ENV,
    PAI_RUN_ARGS,
    pai_run_name,
)

WS, CKPT = "/mnt", "/mnt/ckpts/mcore/latest"


# ------------------------------------------------------------------------------------------------ Pai


@pytest.mark.parametrize("kind, sets", [
    ("qwen3_next", []), ("qwen3", []), ("qwen3", ["train.mode=sft", "train.iterations=7", "train.warmup_iterations=2"]),
])
def test_pai_run_script_gets_its_27_arguments_dlc_env_and_checkpoint_name(kind, sets):
    """Pai-Megatron-Patch a098ca5 `examples/qwen3_next/run_mcore_qwen3.sh` L3, L17-24, L27-62 (positional
    arguments and the dlc env), L258-270 (TRAIN_TOKENS -> TRAIN_ITERS), L298/L305 (checkpoint directory);
    `examples/qwen3/run_mcore_qwen3.sh` L3, L26-61, L385-397, L425/L432 (the same)."""
    spec = load_job(None, ["cluster.nodes=2", *sets], kind=kind)
    trainer = trainer_for(spec, WS, CKPT)
    trainer.check()
    for rank, node in enumerate(trainer.plan().nodes):
        assert node.argv[0] == "bash" and node.argv[1].endswith("run_mcore_qwen3.sh")
        args = dict(zip(PAI_RUN_ARGS, node.argv[2:], strict=True))  # 27 positional arguments, in this order
        assert args["ENV"] == "dlc"
        assert set(PAI_DLC_ENV) <= set(node.env) and node.env["WORLD_SIZE"] == "2" and node.env["RANK"] == str(rank)
        t = spec.train
        if t.mode == "pretrain":  # the script divides tokens by GBS and SEQ_LEN, in integers
            assert int(args["TRAIN_TOKENS"]) // int(args["GLOBAL_BATCH_SIZE"]) // int(args["SEQ_LEN"]) == t.iterations
        else:
            assert (args["TRAIN_TOKENS"], args["WARMUP_TOKENS"]) == ("7", "2")
        script = spec.train.pai.script
        assert trainer.checkpoint_dir == f"{args['OUTPUT_BASEPATH']}/checkpoint/{pai_run_name(args, script)}"


@pytest.mark.parametrize("arch_and_shape, size", list(PAI_SIZES.items()))
def test_each_model_size_goes_to_the_converter_script_that_defines_it(arch_and_shape, size):
    """Pai-Megatron-Patch a098ca5 `toolkits/distributed_checkpoints_convertor/scripts/qwen3/run_8xH20.sh` L103-213,
    `scripts/qwen3/run_A22B_16xH20.sh` L103, `scripts/qwen3_next/run_8xH20.sh` L103 (sizes), L168 (synchronizer)."""
    arch = arch_and_shape[0]
    script = pai_script(arch, size)
    assert size in PAI_CONVERTERS[script]["sizes"]
    assert (PAI_CONVERTERS[script]["synchronizer"] == "qwen3_next") == (arch == "Qwen3NextForCausalLM")


@pytest.mark.parametrize("kind, script", [("qwen3_next", "scripts/qwen3_next/run_8xH20.sh"),
                                          ("qwen3", "scripts/qwen3/run_8xH20.sh")])
def test_recipe_plans_show_their_models_converter_before_anything_is_staged(kind, script, tmp_path):
    """The convert step of a recipe's dry run (no config.json staged yet) names the converter the run launches:
    Qwen3-Next's own (a098ca5 `scripts/qwen3_next/run_8xH20.sh`: `--synchronizer qwen3_next`, Megatron-LM-250908),
    not Qwen3-30B-A3B's. Its argument count and env are the script's (L11-23)."""
    out = subprocess.run([PYTHON, "-m", f"a4ray.{kind}", "-f", str(REPO / "jobs" / f"{kind}.yaml"), "--dry-run",
                          "--set", f"storage.workspace={tmp_path}"], env=isolated_env(tmp_path), capture_output=True,
                         text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    converts = [shlex.split(line) for line in out.stdout.splitlines() if "run_8xH20.sh" in line]
    assert converts and all(words[:2] == ["bash", script] for words in converts), out.stdout
    assert all(len(words) - 2 == len(PAI_CONVERTER_ARGS) for words in converts)
    if kind == "qwen3_next":  # the one size its converter defines; Qwen3's defines several (read from config.json)
        assert all(words[2] == "A3B" for words in converts)


# ----------------------------------------------------------------------------------------- ms-swift


def test_multi_gpu_swift_export_is_allowed_from_the_version_that_has_megatron_export():
    """ms-swift tag v3.10.0 is the first with `swift/cli/_megatron/export.py` (v3.9.0 has none)."""
    assert swift_check(SwiftConvertSpec(version="3.10.0", nproc_per_node=8)) == []
    assert "has no `megatron export`" in swift_check(SwiftConvertSpec(version="3.9.0", nproc_per_node=8))[0]


# ------------------------------------------------------------------------------------------- DeepEP


def test_deepep_test_gets_only_options_test_internode_defines():
    """DeepEP 8a07e7e `tests/test_internode.py` L372-384 (argparse options)."""
    spec = load_job(str(REPO / "jobs" / "deepep_test.yaml"), ["deepep.num_topk_groups=2"])
    (launch,) = [n.argv for n in DeepEPTest(spec).plan().nodes if spec.deepep.test_script in n.argv]  # mpirun's node
    options = {a.split("=", 1)[0] for a in launch[launch.index(spec.deepep.test_script) + 1:]}
    assert options and options <= DEEPEP_OPTIONS, options - DEEPEP_OPTIONS


def test_deepep_output_as_test_internode_prints_it_is_parsed():
    """DeepEP 8a07e7e `tests/test_internode.py` L32, L96, L115-123, L228, L259-263, L306-310 (tests/upstream.py)."""
    f = DEEPEP_LINES
    out = [f["config"].format(tokens=4096, hidden=7168, groups=2, topk=8), f["layout"].format(ms=0.0394)]
    for previous in (False, True):
        for async_ in (False, True):
            for dtype in ("BF16", "BF16", "FP8", "FP8"):  # x_pure_rand, x, and their e4m3 casts
                for topk in ("without", "with"):
                    out.append(f["case"].format(dtype=dtype, topk=topk, async_=async_, previous=previous) + f["passed"])
    out += [f["dispatch"].format(dtype=d, sms=24, nvl=6, rdma=16, notify=31, t=512, rdma_gbps=g, nvl_gbps=2 * g)
            for d, g in (("FP8", 45.1), ("BF16", 48.7))]
    out.append(f["combine"].format(sms=24, nvl=6, rdma=16, notify=30.5, t=700.25, rdma_gbps=44.0, nvl_gbps=88.0))
    (node,) = deepep_log.parse((0, line) for line in out)
    assert node.cases == node.passed == DEEPEP_CASES and node.all_passed and node.layout_ms == 0.039
    assert {k: (b.rdma_gbps, b.nvl_gbps) for k, b in node.best.items()} == {
        "dispatch FP8": (45.1, 90.2), "dispatch BF16": (48.7, 97.4), "combine": (44.0, 88.0)}
    failed = out[:2] + [line.removesuffix(f["passed"]) if i == 5 else line for i, line in enumerate(out[2:34])]
    assert not deepep_log.parse((0, line) for line in failed)[0].all_passed  # an assert in one case: no " passed"


# --------------------------------------------------------------------------------------- nccl-tests


def _row(wrong: int) -> str:
    w = NCCL_TESTS_WRONG_FORMAT % wrong
    return f"  8589934592  2147483648  float  sum  -1  41000  209.5  392.8  {w}  40900  210.0  393.7  {w}"


def test_nccl_tests_wrong_counts_in_g_notation_and_out_of_bounds_are_the_verdicts_reason():
    """nccl-tests v2.17.6 `src/util.cu` L480 (#wrong printed with %6g: 1234567 -> 1.23457e+06) and L643 (the
    `# Out of bounds values` footer, counting the sizes whose check failed)."""
    lines = ["# nThread 1 nGpus 1 minBytes 8589934592 maxBytes 8589934592 step: 2(factor) warmup iters: 5 iters: 5",
             _row(1234567), NCCL_TESTS_OOB_FORMAT % (1, "FAILED"), "# Avg bus bandwidth    : 393.2"]
    (run,) = nccl_tests.parse(lines, binary="all_reduce_perf")
    assert run.rows and run.out_of_bounds == 1
    assert run.wrong == 2 * 1234570  # %6g keeps six digits
    assert run.check_problem() == "2469140 wrong elements in 1 size(s)"
    (clean,) = nccl_tests.parse([lines[0], _row(0), NCCL_TESTS_OOB_FORMAT % (0, "OK")], binary="all_reduce_perf")
    assert clean.check_problem() is None


def test_nccl_tests_columns_and_summary_lines_are_read_as_printed():
    """nccl-tests v2.17.6 `src/util.cu` L623-624 (the 13 columns), L644 (`# Avg bus bandwidth`, %g, OK/FAILED only
    with NCCL_TESTS_MIN_BW) and L646 (`# Collective test concluded`)."""
    header = "#  " + "  ".join(NCCL_TESTS_COLUMNS)
    assert len(_row(3).split()) == len(NCCL_TESTS_COLUMNS)  # one value per column
    lines = ["# Collective test starting: alltoall_perf", header, _row(3), NCCL_TESTS_OOB_FORMAT % (1, "FAILED"),
             NCCL_TESTS_AVG_FORMAT % (1.5e-05, ""), NCCL_TESTS_CONCLUDED_FORMAT % "alltoall_perf"]
    (run,) = nccl_tests.parse(lines)
    (row,) = run.rows
    assert (row.size, row.count, row.dtype, row.redop, row.root) == (8589934592, 2147483648, "float", "sum", -1)
    assert (row.out_of_place.time_us, row.out_of_place.algbw, row.out_of_place.busbw) == (41000, 209.5, 392.8)
    assert (row.in_place.busbw, row.wrong) == (393.7, 6)
    assert run.avg_busbw == 1.5e-05 and run.concluded and run.collective == "alltoall"


# ---------------------------------------------------------------------------------- a4ray's images


def test_nccl_tests_default_location_is_where_a4rays_images_build_them():
    """docker/a4ray.Dockerfile builds nccl-tests (`make -C <dir>`: binaries in <dir>/build) and the DeepEP and
    Pai images start FROM it; Google's gIB installer image ships them in /third_party/nccl-tests/build."""
    dockerfile = (REPO / "docker" / "a4ray.Dockerfile").read_text()
    (built,) = set(re.findall(r"make -C (\S+) ", dockerfile))
    assert NCCL_TESTS_DIRS[0] == f"{built}/build" and "/third_party/nccl-tests/build" in NCCL_TESTS_DIRS
    for name in ("deepep.Dockerfile", "pai.Dockerfile"):
        assert re.search(r"^ARG BASE_IMAGE=a4ray:", (REPO / "docker" / name).read_text(), re.M), name
    assert load_job(str(REPO / "jobs" / "nccl_test.yaml"), []).nccl.binaries_dir in ("", *NCCL_TESTS_DIRS)


def test_deepep_image_names_pr_466_by_its_title():
    """deepseek-ai/DeepEP pull request #466 is "Allow NVSHMEM PE to NIC mapping to be initialized by DeepEP rank";
    "If CUDA_VISIBLE_DEVICES is set, map cuda.current_device()" is only its head commit 8a07e7e's message."""
    text = (REPO / "docker" / "deepep.Dockerfile").read_text()
    assert 'PR #466 ("Allow NVSHMEM PE to NIC mapping to be initialized by DeepEP rank")' in text


SEEDS = REPO / "tests" / "fixtures" / "seeds"  # the runbooks the recipes replace (README.md there)


@pytest.mark.parametrize("kind, mentions", [("qwen3_next", "qwen3_next"), ("qwen3", "qwen3"),
                                            ("swift_dpo", "swift")])
def test_recipes_name_the_seed_they_come_from(kind, mentions):
    (number,) = re.findall(r"\(seed (\d{3})\)", JOB_KINDS[kind].__doc__)
    (seed,) = SEEDS.glob(f"{number}_*.txt")
    assert mentions in seed.read_text().lower(), f"{kind} names seed {number}, which is not about {mentions}"
