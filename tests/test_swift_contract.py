"""a4ray's ms-swift commands, parsed by ms-swift itself at the versions a4ray supports.

For each version (3.8.0, `train.version`'s default; 4.5.2) ms-swift is installed in its own venv
(tests/swift_envs/install.sh, once: `make swift-envs`). a4ray's `--dry-run` plans give the commands: `python -m
a4ray.swift_dpo` (its convert step's `swift export` and every node's `megatron rlhf`) and `a4ray convert` with
`backend: swift`. Each argv goes to ms-swift's own argument dataclass in a subprocess of that venv
(tests/swift_envs/parse_argv.py): the export arguments run their `__post_init__` too, against a tiny checkpoint
staged where the recipe stages its model and the output directory a4ray really creates first; the Megatron RLHF
arguments are parsed flag by flag (their `__post_init__` needs Megatron-LM). A flag ms-swift renamed, removed or
refuses fails the test naming the flag and the version.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from a4ray.hf2mcore.cache import OutputDir
from a4ray.staging.tiny import write_tiny
from conftest import PYTHON, REPO, free_port, isolated_env
from upstream import SWIFT_4_5_2_MEGATRON_RLHF_FIELDS

ENVS = REPO / "tests" / "swift_envs"
VERSIONS = ["3.8.0", "4.5.2"]
MODEL = "ckpts/huggingface/Qwen3-30B-A3B-Instruct-2507"  # jobs/swift_dpo.yaml's; ms-swift finds the model type by it


def swift_python(version: str) -> Path:
    install = subprocess.run(["bash", str(ENVS / "install.sh"), version], capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, f"installing ms-swift {version}: {install.stdout}{install.stderr}"
    if install.stdout.strip():
        print(install.stdout.strip())  # the install time, on the first run
    return REPO / ".venv-swift" / version / "bin" / "python"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("swift-ws")
    write_tiny(ws / MODEL, moe=True, layers=2, experts=4, topk=2)
    return ws


def dry_run(ws: Path, module: str, *sets: str) -> str:
    out = subprocess.run([PYTHON, "-m", module, "--dry-run", "--set", f"storage.workspace={ws}",
                          *[a for s in sets for a in ("--set", s)]],
                         env=isolated_env(ws), capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def commands(plan: str, ws: Path) -> list[list[str]]:
    """Every `swift ...` / `megatron ...` command line of a plan, with the paths a run resolves: the workspace,
    and the conversion's temporary directory, made as the converter makes it before the command runs."""
    found = []
    for line in plan.splitlines():
        words = shlex.split(line) if line.lstrip().startswith(("swift export ", "megatron rlhf ", "megatron export ")) else []
        if not words:
            continue
        argv = [w.replace("<workspace>/", f"{ws}/") for w in words]
        for i, word in enumerate(argv):
            if ".tmp-<key>" in word:
                output = OutputDir(Path(word.split("/.tmp-<key>")[0]), key="0" * 64)
                argv[i] = str(output.temporary())  # exists, with a4ray's owner file, as in a real run
        found.append(argv)
    return found


def parse(version: str, argv: list[str], ws: Path) -> dict:
    command, args = " ".join(argv[:2]), argv[2:]
    post_init = command == "swift export"
    request = json.dumps({"command": command, "argv": args, "post_init": post_init})
    env = {**isolated_env(ws), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "MODELSCOPE_CACHE": str(ws / "modelscope-cache"), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([str(swift_python(version)), str(ENVS / "parse_argv.py"), request], capture_output=True,
                         text=True, cwd=ws, env=env, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("A4RAY_PARSE ")]
    assert lines, f"ms-swift {version} `{command}` did not parse {argv}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    result = json.loads(lines[-1].removeprefix("A4RAY_PARSE "))
    assert not result["unknown"], f"ms-swift {version} `{command}` has no {result['unknown']}: renamed or removed"
    assert result["ok"], (f"ms-swift {version} `{command}` refuses a4ray's command: {result['error']}\n"
                          f"{shlex.join(argv)}\n{out.stderr[-3000:]}")
    return result


@pytest.mark.parametrize("version", ["3.8.0"])
def test_swift_dpo_commands_parse_with_ms_swifts_own_arguments(version, workspace):
    """3.8.0, swift_dpo's default: its convert step's `swift export` (with __post_init__: the output directory a4ray
    made exists) and every node's `megatron rlhf` (flag by flag). Not 4.x: its Megatron arguments import
    mcore-bridge, whose patcher imports Transformer Engine, which installs only with CUDA."""
    plan = dry_run(workspace, "a4ray.swift_dpo", f"train.version={version}", f"train.model={MODEL}")
    found = commands(plan, workspace)
    # < 3.12 converts with `swift export` first; from 3.12 ms-swift trains from the HF weights.
    assert sorted({" ".join(argv[:2]) for argv in found}) == ["megatron rlhf", "swift export"], plan
    for argv in {tuple(a) for a in found}:  # every node's command (the same flags on each)
        parse(version, list(argv), workspace)


@pytest.mark.parametrize("version", VERSIONS)
def test_convert_with_the_swift_backend_parses_with_ms_swifts_own_arguments(version, workspace):
    """`a4ray convert` with backend swift on one GPU: `swift export --to_mcore`, __post_init__ included (4.x only
    with convert.swift.force: it trains from the HF weights). `megatron export` (nproc_per_node > 1, from 3.10) is
    not parsed here: no venv of 3.10-3.12 yet, and 4.x's Megatron arguments need Transformer Engine."""
    sets = ["convert.backend=swift", f"convert.input={MODEL}", "cluster.nodes=1", f"convert.swift.version={version}",
            "convert.swift.force=true"]
    (single,) = commands(dry_run(workspace, "a4ray.convert", *sets), workspace)
    assert single[:2] == ["swift", "export"]
    parse(version, single, workspace)


def test_swift_dpo_4x_passes_only_fields_ms_swift_4_5_2_defines(workspace):
    """ms-swift v4.5.2's MegatronRLHFArguments and its bases (files and lines in tests/upstream.py): read, not parsed,
    because importing them needs Transformer Engine. Every flag of a4ray's 4.5.2 `megatron rlhf` is one of its fields
    (3.x's --load, --save, --max_epochs, --num_workers, --save_interval are not)."""
    plan = dry_run(workspace, "a4ray.swift_dpo", "train.version=4.5.2", f"train.model={MODEL}", "cluster.nodes=1",
                   "train.rpo_alpha=0.1")
    (argv,) = {tuple(a) for a in commands(plan, workspace)}
    flags = {a.removeprefix("--") for a in argv if a.startswith("--")}
    assert argv[:2] == ("megatron", "rlhf") and not flags - set(SWIFT_4_5_2_MEGATRON_RLHF_FIELDS), \
        f"ms-swift 4.5.2 `megatron rlhf` has no {sorted(flags - set(SWIFT_4_5_2_MEGATRON_RLHF_FIELDS))}"
