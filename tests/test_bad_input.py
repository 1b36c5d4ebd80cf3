"""Malformed input, as a new user types it, at every entry point (the `a4ray` CLI, `python -m a4ray.<job>`,
the Python API): one clear error naming the file, field and value, exit code 2 (a typed `A4RayError` from
the API), no traceback, and a planted secret nowhere: not in the output, run directories, --result JSON,
rendered manifests, or what would reach Ray (ray.init's runtime env, a submitted job).

Most cases run in this process through `a4ray.cli.main` (fast); nothing may start a cluster (`ray.init`
and the embedded cluster are replaced by tripwires). A few run as real subprocesses, end to end.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import annotated_types
import pytest
import ray
from conftest import PYTHON, REPO, isolated_env
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

import a4ray
from a4ray.cli import main as cli
from a4ray.core.errors import A4RayError
from a4ray.runtime import connect as connection
from a4ray.runtime.simulated import SimulatedCluster
from a4ray.spec.job import JOB_KINDS

TOKEN = "hf_PlantedToken0123456789abcdefXYZ"  # a Hub token
PASSWORD = "pw-Planted-9f8e7d6c5b4a3210"  # a password in a URL
SIG = "c2lnUGxhbnRlZDAxMjM0NTY3ODlhYmNk"  # a signed URL's signature
SECRETS = (TOKEN, PASSWORD, SIG)
USER_URL = f"https://alice:{PASSWORD}@files.example.com/models"
SIGNED_URL = f"https://storage.googleapis.com/b/f.bin?X-Goog-Signature={SIG}&X-Goog-Expires=600"


@dataclass
class Case:
    id: str
    entry: str  # "cli" (a4ray ...), "module:<job>" (python -m a4ray.<job>), "api:<call>"
    args: list[str]
    field: str  # what the error must name
    spec: str | bytes | None = None  # written to {spec}
    other: str | None = None  # a second file, {other}


def y(text: str) -> str:
    return text.replace("{TOKEN}", TOKEN).replace("{USER_URL}", USER_URL).replace("{SIGNED_URL}", SIGNED_URL)


SECRET_SET = f"network.env.HF_TOKEN={TOKEN}"
DDP = "kind: ddp_test\ncluster: {nodes: 2, gpus_per_node: 1}\n"
STAGE = "kind: stage\nartifacts:\n"


def art(**fields: str) -> str:
    body = ", ".join(f"{k}: {json.dumps(v)}" for k, v in fields.items())
    return f"  - {{{body}}}\n"


CASES = [
    # ---------------------------------------------------------------- the file itself
    Case("yaml-syntax-run", "cli", ["run", "-f", "{spec}"], "line 3", "kind: ddp_test\ncluster: {nodes: 2\n"),
    Case("yaml-syntax-module", "module:nccl_test", ["-f", "{spec}"], "line 3", "kind: nccl_test\nnccl: [a\n"),
    Case("yaml-syntax-stage", "cli", ["stage", "-f", "{spec}"], "line 2", "kind: stage\nartifacts: {a: [}\n"),
    Case("yaml-syntax-render", "cli", ["render", "cluster", "-f", "{spec}"], "not valid YAML", "kind: 'cluster\n"),
    Case("yaml-tab-indent", "cli", ["run", "-f", "{spec}"], "not valid YAML",
         "kind: command\ncommand:\n\targv: [x]\n"),
    Case("yaml-secret-line", "cli", ["run", "-f", "{spec}"], "line 3",
         y("kind: ddp_test\nnetwork: {env: {HF_TOKEN: {TOKEN}\n")),
    Case("top-list-run", "cli", ["run", "-f", "{spec}"], "top level", "- kind: ddp_test\n- b\n"),
    Case("top-list-module", "module:qwen3_next", ["-f", "{spec}"], "top level", "- kind: qwen3_next\n"),
    Case("top-scalar-render", "cli", ["render", "cluster", "-f", "{spec}"], "top level", "just some text\n"),
    Case("top-scalar-stage", "cli", ["stage", "-f", "{spec}"], "top level", "42\n"),
    Case("missing-file-run", "cli", ["run", "-f", "{tmp}/nope.yaml"], "nope.yaml"),
    Case("missing-file-module", "module:convert", ["-f", "{tmp}/nope.yaml"], "nope.yaml"),
    Case("missing-file-stage", "cli", ["stage", "-f", "{tmp}/nope.yaml"], "nope.yaml"),
    Case("missing-file-render", "cli", ["render", "job", "-f", "{tmp}/nope.yaml"], "nope.yaml"),
    Case("missing-file-up", "cli", ["up", "-f", "{tmp}/nope.yaml", "--dry-run"], "nope.yaml"),
    Case("directory-as-file", "cli", ["run", "-f", "{tmp}"], "directory"),
    Case("not-utf8", "cli", ["run", "-f", "{spec}"], "UTF-8", b"kind: ddp_test\nname: \xff\xfe\n"),
    Case("empty-file", "cli", ["run", "-f", "{spec}"], "kind", ""),
    Case("comments-only", "cli", ["run", "-f", "{spec}"], "kind", "# nothing here\n"),
    Case("no-kind-run", "cli", ["run", "-f", "{spec}"], "kind", "cluster: {nodes: 2}\n"),
    Case("no-kind-render", "cli", ["render", "cluster", "-f", "{spec}"], "kind", "cluster: {nodes: 2}\n"),
    Case("no-kind-doctor", "cli", ["doctor", "-f", "{spec}"], "kind", "cluster: {nodes: 2}\n"),
    Case("kind-unknown", "cli", ["run", "-f", "{spec}"], "ddp_test", "kind: ddp\n"),
    Case("kind-a-list", "cli", ["run", "-f", "{spec}"], "kind", "kind: [ddp_test]\n"),
    Case("kind-a-mapping", "cli", ["stage", "-f", "{spec}"], "kind", "kind: {a: 1}\n"),
    Case("kind-mismatch", "module:ddp_test", ["-f", "{spec}"], "kind", "kind: nccl_test\n"),
    Case("kind-cluster-run", "cli", ["run", "-f", "{spec}"], "kind: cluster", "kind: cluster\n"),
    Case("unknown-top-field", "cli", ["run", "-f", "{spec}"], "clusterr", "kind: ddp_test\nclusterr: {}\n"),
    Case("no-config-run", "cli", ["run"], "--config"),
    # ---------------------------------------------------------------- cluster, network, storage
    Case("nodes-a-word", "cli", ["run", "-f", "{spec}"], "cluster.nodes",
         "kind: command\ncommand: {argv: [true]}\ncluster: {nodes: two}\n"),
    # An option that stands for a field is named as typed, not as the --set it becomes.
    Case("local-nodes-zero", "module:ddp_test", ["--local-nodes", "0"], "cluster.nodes: expected a value greater "
         "than 0, got 0 (from --local-nodes 0)"),
    Case("local-nodes-zero-recipe", "module:qwen3_next", ["--local-nodes", "0", "--dry-run"],
         "cluster.nodes: expected a value greater than 0, got 0 (from --local-nodes 0)"),
    Case("local-nodes-zero-rehearsal", "module:qwen3_next", ["--local-nodes", "0"], "(from --local-nodes 0)"),
    Case("local-nodes-zero-run", "cli", ["run", "-f", "{spec}", "--local-nodes", "0"], "(from --local-nodes 0)",
         "kind: command\ncommand: {argv: [true]}\n"),
    Case("gpus-negative", "module:nccl_test", ["--gpus-per-node", "-1"], "cluster.gpus_per_node: expected a value "
         "greater than 0, got -1 (from --gpus-per-node -1)"),
    Case("local-up-nodes-zero", "cli", ["local", "up", "--nodes", "0"], "cluster.nodes: expected a value greater "
         "than 0, got 0 (from --nodes 0)"),
    Case("local-nodes-a-word", "module:deepep_test", ["--local-nodes", "abc"], "--local-nodes"),
    Case("cluster-a-list", "cli", ["run", "-f", "{spec}"], "cluster", "kind: ddp_test\ncluster: [1, 2]\n"),
    # ---------------------------------------------------------------- counts that are not integers
    Case("nodes-true-yaml", "cli", ["run", "-f", "{spec}", "--dry-run"], "cluster.nodes: expected an integer",
         "kind: ddp_test\ncluster: {nodes: true, gpus_per_node: 1}\n"),
    Case("nodes-true-set", "module:qwen3_next", ["--dry-run", "--set", "cluster.nodes=true"],
         "cluster.nodes: expected an integer (true and false are not numbers), got True (from --set "
         "cluster.nodes=true)"),
    Case("nodes-fraction", "module:ddp_test", ["--dry-run", "--set", "cluster.nodes=1.5"],
         "cluster.nodes: expected an integer, got 1.5"),
    Case("nodes-whole-float", "cli", ["doctor", "--dry-run", "-f", "{spec}"], "cluster.nodes: expected an integer",
         "kind: ddp_test\ncluster: {nodes: 2.0}\n"),
    Case("steps-true", "module:ddp_test", ["--dry-run", "--set", "ddp_test.steps=true"], "ddp_test.steps"),
    Case("exit-code-true", "module:ddp_test", ["--dry-run", "--set", "restart.retry_exit_codes=[true]"],
         "restart.retry_exit_codes[0]"),
    Case("threshold-nodes-true", "module:nccl_test", ["--dry-run", "-f", "{spec}"], "nccl.thresholds.all_reduce",
         "kind: nccl_test\nnccl: {thresholds: {all_reduce: {true: 100}}}\n"),
    Case("timeout-true", "cli", ["run", "-f", "{spec}", "--dry-run"], "timeout_s: expected a number",
         "kind: command\ncommand: {argv: [true]}\ntimeout_s: true\n"),
    Case("cpus-true", "cli", ["stage", "-f", "{spec}", "--set", "staging.cpus=true"], "staging.cpus",
         STAGE + art(name="a", source="/data/a", target="a")),
    Case("ttl-true", "cli", ["render", "job", "-f", "{spec}", "--set", "kuberay.job.ttl_s=true"],
         "kuberay.job.ttl_s", "kind: ddp_test\nkuberay: {image: 'registry.example/a4ray:1.0'}\n"),
    Case("start-timeout-zero", "module:ddp_test", ["--set", "cluster.start_timeout_s=0"], "cluster.start_timeout_s"),
    Case("gib-maybe", "module:nccl_test", ["-f", "{spec}"], "network.gib",
         "kind: nccl_test\nnetwork: {gib: maybe}\n"),
    Case("env-bad-name", "module:deepep_test", ["-f", "{spec}"], "network.env",
         "kind: deepep_test\nnetwork: {env: {1BAD: x}}\n"),
    Case("env-bool", "cli", ["run", "-f", "{spec}"], "network.env.NCCL_DEBUG",
         "kind: command\ncommand: {argv: [true]}\nnetwork: {env: {NCCL_DEBUG: true}}\n"),
    Case("env-secret-yaml", "cli", ["run", "-f", "{spec}"], "network.env.HF_TOKEN",
         y(DDP + "network: {env: {HF_TOKEN: {TOKEN}}}\n")),
    Case("env-secret-set", "module:nccl_test", ["--set", SECRET_SET], "network.env.HF_TOKEN"),
    Case("env-secret-stage", "cli", ["stage", "-f", "{spec}", "--set", SECRET_SET], "network.env.HF_TOKEN",
         STAGE + art(name="a", source="/data/a", target="a")),
    Case("env-secret-command", "cli", ["run", "-f", "{spec}"], "command.env.WANDB_API_KEY",
         y("kind: command\ncommand: {argv: [true], env: {WANDB_API_KEY: {TOKEN}}}\n")),
    Case("env-secret-deepep", "module:deepep_test", ["--set", f"deepep.env.GITHUB_TOKEN={TOKEN}"],
         "deepep.env.GITHUB_TOKEN"),
    Case("env-secret-gib-overrides", "cli", ["doctor", "--set", f"network.gib_overrides.NCCL_PASSWORD={TOKEN}"],
         "network.gib_overrides.NCCL_PASSWORD"),
    Case("env-secret-recipe", "module:qwen3_next", ["--set", SECRET_SET], "network.env.HF_TOKEN"),
    Case("env-secret-render", "cli", ["render", "job", "-f", "{spec}", "--set", SECRET_SET],
         "network.env.HF_TOKEN", "kind: ddp_test\nkuberay: {image: 'registry.example/a4ray:1.0'}\n"),
    Case("env-secret-plus-other", "module:ddp_test", ["--set", SECRET_SET, "--set", "cluster.nodes=0"],
         "cluster.nodes"),
    Case("gib-script-relative", "module:ddp_test", ["--set", "network.gib_script=gib/set_nccl_env.sh"],
         "network.gib_script"),
    Case("workspace-relative", "module:convert", ["-f", "{spec}"], "storage.workspace",
         "kind: convert\nstorage: {workspace: mnt}\n"),
    Case("name-not-dns", "module:nccl_test", ["-f", "{spec}"], "name", "kind: nccl_test\nname: Bad_Name\n"),
    Case("timeout-negative", "cli", ["run", "-f", "{spec}"], "timeout_s",
         "kind: command\ncommand: {argv: [true]}\ntimeout_s: -1\n"),
    # ---------------------------------------------------------------- --set and options
    Case("set-no-equals", "module:ddp_test", ["--set", "cluster.nodes"], "cluster.nodes"),
    Case("set-bad-yaml", "module:ddp_test", ["--set", "cluster.nodes=["], "cluster.nodes"),
    Case("set-empty-key", "module:nccl_test", ["--set", "=3"], "key=value"),
    Case("set-into-scalar", "module:ddp_test", ["--set", "cluster.nodes.x=1"], "cluster.nodes"),
    Case("set-past-the-end", "cli", ["stage", "-f", "{spec}", "--set", "artifacts[5].name=x"], "artifacts",
         STAGE + art(name="a", source="/data/a", target="a")),
    Case("set-unknown-path", "module:deepep_test", ["--set", "clusterr.nodes=1"], "clusterr"),
    Case("set-list-index-on-mapping", "module:ddp_test", ["--set", "cluster[0]=1"], "cluster"),
    Case("set-kind", "cli", ["run", "-f", "{spec}", "--set", "kind=nccl_test"], "kind", DDP),
    Case("set-secret-key-bad-value", "module:ddp_test", ["--set", f"network.env.HF_TOKEN=[{TOKEN}"],
         "network.env.HF_TOKEN"),
    Case("from-bogus", "module:qwen3", ["--from", "bogus"], "--from"),
    Case("skip-bogus", "module:qwen3_next", ["--skip", "bogus"], "pipeline.skip[0]: expected 'stage', 'convert', "
         "'preflight' or 'train', got 'bogus' (from --skip bogus)"),
    Case("run-dir-missing", "module:ddp_test", ["--run-dir", "{tmp}/no-run"], "no-run"),
    Case("only-unknown", "cli", ["stage", "-f", "{spec}", "--only", "nope"], "nope",
         STAGE + art(name="a", source="/data/a", target="a")),
    # ---------------------------------------------------------------- workload sections
    Case("command-missing", "cli", ["run", "-f", "{spec}"], "command", "kind: command\n"),
    Case("command-argv-empty", "cli", ["run", "-f", "{spec}"], "command.argv",
         "kind: command\ncommand: {argv: []}\n"),
    Case("command-nproc-zero", "cli", ["run", "-f", "{spec}", "--set", "command.nproc=0"], "command.nproc",
         "kind: command\ncommand: {argv: [true]}\n"),
    Case("ddp-typo", "module:ddp_test", ["-f", "{spec}"], "ddp_test.stepz",
         "kind: ddp_test\nddp_test: {stepz: 3}\n"),
    Case("ddp-steps-negative", "module:ddp_test", ["--set", "ddp_test.steps=-1"], "ddp_test.steps"),
    Case("nccl-collective-bogus", "module:nccl_test", ["--set", "nccl.collectives=[bogus]"], "nccl.collectives"),
    Case("nccl-size-word", "module:nccl_test", ["--set", "nccl.min_bytes=lots"], "nccl.min_bytes"),
    Case("nccl-threshold-negative", "cli", ["nccl-test", "-f", "{spec}"], "nccl.thresholds",
         "kind: nccl_test\nnccl: {thresholds: {all_reduce: {2: -1}}}\n"),
    Case("deepep-launcher-bogus", "module:deepep_test", ["--set", "deepep.launcher=ssh"], "deepep.launcher"),
    Case("deepep-experts-zero", "cli", ["deepep-test", "--set", "deepep.num_experts=0"], "deepep.num_experts"),
    Case("convert-backend-bogus", "module:convert", ["--set", "convert.backend=magic"], "convert.backend"),
    Case("convert-output-outside", "module:convert", ["-f", "{spec}"], "convert.output",
         "kind: convert\nconvert: {input: hf/m, output: /etc/a4ray-out}\n"),
    Case("convert-output-dotdot", "cli", ["convert", "-f", "{spec}"], "convert.output",
         "kind: convert\nconvert: {input: hf/m, output: ../../escape}\n"),
    Case("convert-tolerance-zero", "module:convert", ["--set", "convert.verify.tolerance=0"],
         "convert.verify.tolerance"),
    # ---------------------------------------------------------------- staging
    Case("stage-no-target", "cli", ["stage", "-f", "{spec}"], "artifacts[0].target",
         STAGE + art(name="a", source="/data/a")),
    Case("stage-scheme-ftp", "cli", ["stage", "-f", "{spec}"], "artifacts[0].source",
         STAGE + art(name="a", source=f"ftp://alice:{PASSWORD}@host/x", target="a")),
    Case("stage-hf-userinfo", "cli", ["stage", "-f", "{spec}"], "artifacts[0].source",
         STAGE + art(name="a", source=f"hf://alice:{PASSWORD}@org/repo", target="a")),
    Case("stage-https-dir-no-files", "module:stage", ["-f", "{spec}"], "artifacts[0]",
         STAGE + art(name="a", source=USER_URL + "/", target="a")),
    Case("stage-target-absolute-outside", "cli", ["stage", "-f", "{spec}"], "artifacts[0].target",
         STAGE + art(name="a", source=USER_URL + "/f.bin", target="/etc/a4ray-x")),
    Case("stage-target-signed-url-outside", "module:stage", ["-f", "{spec}"], "artifacts[0].target",
         STAGE + art(name="a", source=SIGNED_URL, target="/var/a4ray-x")),
    Case("stage-target-dotdot", "cli", ["stage", "-f", "{spec}"], "artifacts[0].target",
         STAGE + art(name="a", source="/data/a", target="ckpts/../../x")),
    Case("stage-git-branch", "cli", ["stage", "-f", "{spec}"], "artifacts[0].source",
         STAGE + art(name="a", source="git+https://github.com/o/r.git@main", target="a")),
    Case("stage-duplicate-names", "cli", ["stage", "-f", "{spec}"], "artifacts",
         STAGE + art(name="a", source="/d/a", target="a") + art(name="a", source="/d/b", target="b")),
    Case("stage-overlap", "cli", ["stage", "-f", "{spec}"], "artifacts",
         STAGE + art(name="a", source="/d/a", target="m") + art(name="b", source="/d/b", target="m/sub")),
    Case("stage-sha-not-hex", "cli", ["stage", "-f", "{spec}", "--set", "artifacts[0].sha256.f=xyz"],
         "artifacts[0].sha256", STAGE + art(name="a", source="/data/a", target="a")),
    Case("stage-token-file-relative", "cli", ["stage", "-f", "{spec}"], "staging.token_file",
         STAGE + art(name="a", source="/data/a", target="a") + "staging: {token_file: secrets/hf}\n"),
    Case("stage-artifacts-mapping", "cli", ["stage", "-f", "{spec}"], "artifacts",
         "kind: stage\nartifacts: {name: a}\n"),
    Case("stage-a-ddp-spec", "cli", ["stage", "-f", "{spec}"], "artifacts", DDP),
    Case("stage-query-token-outside", "cli", ["stage", "-f", "{spec}"], "artifacts[0].target",
         STAGE + art(name="a", source=f"https://h.example.com/f.bin?token={TOKEN}", target="/a4ray-x")),
    # ---------------------------------------------------------------- recipes
    Case("recipe-iterations-zero", "module:qwen3_next", ["--set", "train.iterations=0"], "train.iterations"),
    Case("recipe-warmup-too-long", "module:qwen3_next", ["--set", "train.warmup_iterations=500"],
         "train.warmup_iterations"),
    Case("recipe-output-outside", "module:qwen3_next", ["--set", "train.output=/etc/a4ray-out"], "train.output"),
    Case("recipe-output-dotdot", "module:qwen3", ["--set", "train.output=../../out"], "train.output"),
    Case("recipe-trainer-bogus", "cli", ["run", "-f", "{spec}"], "train.trainer",
         "kind: qwen3_next\ntrain: {trainer: jax}\n"),
    Case("recipe-tp-does-not-divide", "module:qwen3_next", ["--dry-run", "--set", "train.pai.parallel.tp=3"],
         "train.pai.parallel"),
    Case("recipe-standins-dotdot", "module:qwen3_next", ["--set", "standins=../../standins"], "standins"),
    Case("recipe-convert-backend", "module:qwen3", ["--set", "convert.backend=magic"], "convert.backend"),
    Case("recipe-target-outside", "module:qwen3", ["--set", "artifacts[0].target=/etc/a4ray-ckpt"],
         "artifacts[0].target"),
    Case("recipe-convert-output-outside", "module:qwen3_next", ["--set", "convert.output=/opt/a4ray-mcore"],
         "convert.output"),
    Case("recipe-source-userinfo-bad", "module:qwen3_next",
         ["--set", f"artifacts[0].source=hf://alice:{PASSWORD}@Qwen"], "artifacts[0].source"),
    Case("swift-version-word", "module:swift_dpo", ["--dry-run", "--set", "train.version=latest"], "train.version"),
    Case("swift-output-outside", "module:swift_dpo", ["--dry-run", "--set", "train.output=/etc/megatron"], "train.output"),
    Case("swift-dataset-not-list", "cli", ["run", "-f", "{spec}"], "train.dataset",
         "kind: swift_dpo\ntrain: {dataset: {a: 1}}\n"),
    Case("swift-skip-bogus", "module:swift_dpo", ["--dry-run", "--skip", "stage,bake"], "pipeline.skip"),
    # ---------------------------------------------------------------- cluster specs and rendering
    Case("cluster-render-gpus", "cli", ["render", "cluster", "-f", "{spec}", "--set", "cluster.gpus_per_node=4"],
         "cluster.gpus_per_node", "kind: cluster\nkuberay: {image: 'registry.example/a4ray:1.0'}\n"),
    Case("cluster-render-machine", "cli", ["render", "cluster", "-f", "{spec}"], "cluster.machine_type",
         "kind: cluster\ncluster: {machine_type: A4!}\n"),
    Case("cluster-render-unknown-field", "cli", ["render", "cluster", "-f", "{spec}"], "kuberay.imagee",
         "kind: cluster\nkuberay: {imagee: 'registry.example/a4ray:1.0'}\n"),
    Case("cluster-submit-dry-run", "cli", ["submit", "-f", "{spec}", "--dry-run", "--set", SECRET_SET, "--", "python", "-m", "a4ray.ddp_test"],
         "network.env.HF_TOKEN", "kind: cluster\nkuberay: {image: 'registry.example/a4ray:1.0'}\n"),
    Case("cluster-up-list", "cli", ["up", "-f", "{spec}", "--dry-run"], "top level", "- kind: cluster\n"),
    Case("cluster-as-a-job", "module:ddp_test", ["-f", "{spec}"], "kind", "kind: cluster\n"),
    # ---------------------------------------------------------------- the Python API
    Case("api-load-list", "api:load", ["{spec}"], "top level", "- a\n"),
    Case("api-load-missing", "api:load", ["{tmp}/nope.yaml"], "nope.yaml"),
    Case("api-load-bad-yaml", "api:load", ["{spec}"], "line 3", "kind: ddp_test\ncluster: [\n"),
    Case("api-load-no-kind", "api:load", ["{spec}"], "kind", "cluster: {nodes: 1}\n"),
    Case("api-load-set", "api:load-kind:ddp_test", ["cluster.nodes=0"], "cluster.nodes"),
    Case("api-load-bad-kind", "api:load-kind:bogus", [], "kind"),
    Case("api-set-secret", "api:set", ["network.env.HF_TOKEN", TOKEN], "network.env.HF_TOKEN", DDP),
    Case("api-set-word", "api:set", ["cluster.nodes", "two"], "cluster.nodes", DDP),
    Case("api-run-cluster", "api:run", [], "kind: cluster", "kind: cluster\n"),
    Case("api-run-target-outside", "api:run", [], "artifacts[0].target",
         STAGE + art(name="a", source=USER_URL + "/f.bin", target="/etc/a4ray-api")),
    Case("api-plan-convert-outside", "api:plan", [], "convert.output",
         "kind: convert\nconvert: {input: m, output: /root/a4ray-out}\n"),
]

# Well-formed but absurd: each is refused at once (before, some were worked on for minutes), naming the field and
# what is allowed; nothing is written. A hang fails the case at its own timeout, far below the suite's.
LAUGHS = "kind: ddp_test\na: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)) + "name: *i\n"
ABSURD = [
    # ---------------------------------------------------------------- sizes no cluster has
    Case("nodes-billion-dry-run", "module:ddp_test", ["--dry-run", "--set", "cluster.nodes=1000000000"],
         "less than or equal to 4096"),
    Case("nodes-huge-yaml", "cli", ["run", "-f", "{spec}", "--dry-run"], "cluster.nodes",
         "kind: command\ncommand: {argv: [true]}\ncluster: {nodes: 100000000000}\n"),
    Case("nodes-huge-recipe", "module:qwen3_next", ["--dry-run", "--local-nodes", "100000000"], "cluster.nodes"),
    Case("gpus-per-node-huge", "module:nccl_test", ["--dry-run", "--gpus-per-node", "1000000"],
         "cluster.gpus_per_node"),
    Case("cpus-per-node-huge", "cli", ["doctor", "--dry-run", "--set", "cluster.cpus_per_node=1e12"],
         "cluster.cpus_per_node"),
    Case("nproc-huge", "cli", ["run", "-f", "{spec}", "--dry-run", "--set", "command.nproc=100000"], "command.nproc",
         "kind: command\ncommand: {argv: [true], torchrun: true}\n"),
    Case("embedded-nodes-too-many", "module:ddp_test", ["--local-nodes", "100"], "at most 32"),
    Case("local-up-nodes-huge", "cli", ["local", "up", "--nodes", "100000"], "cluster.nodes"),
    Case("local-up-nodes-many", "cli", ["local", "up", "--nodes", "200", "--gpus-per-node", "1"], "at most 32"),
    Case("local-up-port", "cli", ["local", "up", "--dashboard-port", "99999"], "--dashboard-port"),
    Case("steps-huge", "module:ddp_test", ["--dry-run", "--set", "ddp_test.steps=1000000000000"], "ddp_test.steps"),
    Case("iterations-huge", "module:qwen3_next", ["--dry-run", "--set", "train.iterations=99999999999999"],
         "train.iterations"),
    Case("deepep-tokens-huge", "module:deepep_test", ["--dry-run", "--set", "deepep.num_tokens=1000000000000000"],
         "deepep.num_tokens"),
    Case("nccl-size-petabyte", "module:nccl_test", ["--dry-run", "--set", "nccl.max_bytes=1024T"], "nccl.max_bytes"),
    Case("seed-huge", "module:qwen3", ["--dry-run", "--set", "train.torch.seed=100000000000000000000"],
         "train.torch.seed"),
    Case("exit-code-300", "module:ddp_test", ["--dry-run", "--set", "restart.retry_exit_codes=[300]"],
         "restart.retry_exit_codes[0]"),
    Case("restarts-huge", "module:ddp_test", ["--dry-run", "--set", "restart.max_restarts=1000000000"],
         "restart.max_restarts"),
    Case("ttl-huge", "cli", ["render", "job", "-f", "{spec}", "--set", "kuberay.job.ttl_s=100000000000"],
         "kuberay.job.ttl_s", "kind: ddp_test\nkuberay: {image: 'registry.example/a4ray:1.0'}\n"),
    Case("machine-type-long", "module:ddp_test", ["--dry-run", "--set", "cluster.machine_type=" + "a" * 300],
         "cluster.machine_type"),
    # ---------------------------------------------------------------- times: infinite, NaN, past a year
    Case("timeout-inf", "cli", ["run", "-f", "{spec}", "--dry-run"], "timeout_s",
         "kind: command\ncommand: {argv: [true]}\ntimeout_s: .inf\n"),
    Case("timeout-overflows", "module:nccl_test", ["--dry-run", "--set", "timeout_s=1e400"], "timeout_s"),
    Case("start-timeout-huge", "module:ddp_test", ["--dry-run", "--set", "cluster.start_timeout_s=1e300"],
         "cluster.start_timeout_s"),
    Case("backoff-huge", "module:qwen3_next", ["--dry-run", "--set", "restart.backoff_s=1e12"], "restart.backoff_s"),
    Case("hang-window-inf", "module:ddp_test", ["--dry-run", "--set", "observe.watchdog.no_progress_s=.inf"],
         "observe.watchdog.no_progress_s"),
    Case("lr-inf", "module:qwen3_next", ["--dry-run", "--set", "train.lr=.inf"], "train.lr"),
    # ---------------------------------------------------------------- YAML a strict loader refuses
    Case("yaml-duplicate-key", "cli", ["run", "-f", "{spec}", "--dry-run"], "'cluster' is given twice",
         "kind: ddp_test\ncluster: {nodes: 2}\nname: x\ncluster: {nodes: 4}\n"),
    Case("yaml-duplicate-nested", "module:convert", ["-f", "{spec}", "--dry-run"], "'output' is given twice",
         "kind: convert\nconvert:\n  input: m\n  output: a\n  output: b\n"),
    Case("yaml-duplicate-kind", "cli", ["render", "cluster", "-f", "{spec}"], "'kind' is given twice",
         "kind: cluster\nkind: ddp_test\n"),
    Case("yaml-duplicate-in-set", "module:ddp_test", ["--dry-run", "--set", "network.env={A: '1', A: '2'}"],
         "'A' is given twice"),
    Case("yaml-duplicate-stage", "cli", ["stage", "-f", "{spec}", "--dry-run"], "'target' is given twice",
         STAGE + "  - {name: a, source: /data/a, target: a, target: b}\n"),
    Case("yaml-alias-bomb", "cli", ["run", "-f", "{spec}", "--dry-run"], "alias", LAUGHS),
    Case("yaml-nested-deep", "module:ddp_test", ["-f", "{spec}", "--dry-run"], "nested too deeply",
         "kind: ddp_test\nname: " + "[" * 20000 + "\n"),
    Case("api-load-duplicate", "api:load", ["{spec}"], "'nodes' is given twice",
         "kind: ddp_test\ncluster: {nodes: 2, nodes: 3}\n"),
    # ---------------------------------------------------------------- paths no OS can hold
    Case("path-nul-yaml", "module:convert", ["-f", "{spec}", "--dry-run"], "convert.input",
         'kind: convert\nconvert: {input: "ckpts/m\\0x"}\n'),
    Case("path-nul-set", "module:qwen3_next", ["--dry-run", "--set", 'train.output="out\\0put"'], "train.output"),
    Case("path-newline", "module:ddp_test", ["-f", "{spec}", "--dry-run"], "network.gib_script",
         'kind: ddp_test\nnetwork: {gib_script: "/usr/local/gib/\\nset_nccl_env.sh"}\n'),
    Case("path-component-too-long", "module:qwen3", ["--dry-run", "--set", "train.output=logs/" + "x" * 300],
         "train.output"),
    Case("path-too-long", "cli", ["stage", "-f", "{spec}", "--dry-run"], "artifacts[0].target",
         STAGE + art(name="a", source="/data/a", target="/".join(["d" * 200] * 30))),
    Case("path-nul-token-file", "cli", ["stage", "-f", "{spec}", "--dry-run"], "staging.token_file",
         STAGE + art(name="a", source="/data/a", target="a") + 'staging: {token_file: "/secrets/hf\\0"}\n'),
    Case("path-nul-deepep", "module:deepep_test", ["--dry-run", "--set", 'deepep.deepep_dir="/opt/deep\\0ep"'],
         "deepep.deepep_dir"),
    Case("path-nul-kuberay-mount", "cli", ["render", "cluster", "-f", "{spec}"], "kuberay.storage[0].local_ssd.mount_path",
         "kind: cluster\nkuberay: {image: 'r.example/a:1', storage: [{type: local_ssd, name: ssd, "
         'mount_path: "/ss\\0d"}]}\n'),
    Case("argv-nul", "cli", ["run", "-f", "{spec}", "--dry-run"], "command.argv[1]",
         'kind: command\ncommand: {argv: [echo, "a\\0b"]}\n'),
    Case("env-nul", "module:ddp_test", ["--dry-run", "--set", 'network.env.NCCL_DEBUG="IN\\0FO"'],
         "network.env.NCCL_DEBUG"),
    Case("api-set-nul", "api:set", ["convert.output", "a\0b"], "convert.output", "kind: convert\n"),
    # ---------------------------------------------------------------- absurd workspace roots
    Case("workspace-root", "module:ddp_test", ["--dry-run", "--set", "storage.workspace=/"], "storage.workspace"),
    Case("workspace-root-slashes", "cli", ["run", "-f", "{spec}", "--dry-run"], "storage.workspace",
         "kind: command\ncommand: {argv: [true]}\nstorage: {workspace: ///}\n"),
    Case("workspace-etc", "module:qwen3_next", ["--dry-run", "--set", "storage.workspace=/etc"], "storage.workspace"),
    Case("workspace-proc", "module:convert", ["--dry-run", "--set", "storage.workspace=/proc/self"],
         "storage.workspace"),
    Case("workspace-usr-dotted", "module:nccl_test", ["--dry-run", "--set", "storage.workspace=/usr/./"],
         "storage.workspace"),
    Case("local-workspace-root", "module:ddp_test", ["--set", "storage.local_workspace=/"],
         "storage.local_workspace"),
    Case("local-workspace-dev", "cli", ["stage", "-f", "{spec}"], "storage.local_workspace",
         STAGE + art(name="a", source="/data/a", target="a") + "storage: {local_workspace: /dev/shm}\n"),
    Case("stage-workspace-option-root", "cli", ["stage", "-f", "{spec}", "--workspace", "/"], "--workspace",
         STAGE + art(name="a", source="/data/a", target="a")),
    Case("api-load-workspace-root", "api:load-kind:stage", ["storage.workspace=/"], "storage.workspace"),
    Case("api-set-workspace-sys", "api:set", ["storage.workspace", "/sys"], "storage.workspace", DDP),
]


class ClusterStarted(Exception):
    """A malformed input got as far as starting or joining a Ray cluster."""


@pytest.fixture
def tripwires(monkeypatch, tmp_path):
    """No Ray cluster is joined or started, nothing is submitted; what would have been sent is kept."""
    sent: list[str] = []

    def init(*args, **kwargs):
        sent.append(repr((args, kwargs)))
        raise ClusterStarted(f"ray.init{args}")

    def start(self, *args, **kwargs):
        raise ClusterStarted("an embedded cluster was started")

    def submit_job(self, **kwargs):
        sent.append(repr(kwargs))
        raise ClusterStarted("a job was submitted")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(SimulatedCluster, "start", start)
    monkeypatch.setattr(connection, "_running_local_address", lambda: None)
    monkeypatch.setattr("ray.job_submission.JobSubmissionClient.submit_job", submit_job)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # the default local workspace (.a4ray/) lands here
    return sent


def _materialize(case: Case, tmp_path: Path) -> list[str]:
    inputs = tmp_path / "in"
    inputs.mkdir(exist_ok=True)
    spec = inputs / "spec.yaml"
    if case.spec is not None:
        spec.write_bytes(case.spec if isinstance(case.spec, bytes) else case.spec.encode())
    return [a.replace("{spec}", str(spec)).replace("{tmp}", str(tmp_path)) for a in case.args]


def _written(tmp_path: Path) -> str:
    """Everything a4ray wrote (run directories, --result, manifests), not the inputs."""
    texts = []
    for path in tmp_path.rglob("*"):
        if path.is_file() and "in" not in path.relative_to(tmp_path).parts[:1]:
            texts.append(f"{path}:\n{path.read_text(errors='replace')}")
    return "\n".join(texts)


def _run_api(case: Case, args: list[str]) -> BaseException:
    call = case.entry.removeprefix("api:")
    spec_path = args[0] if call == "load" else None
    try:
        if call == "load":
            a4ray.load(spec_path)
        elif call.startswith("load-kind:"):
            a4ray.load(None, *args, kind=call.removeprefix("load-kind:"))
        else:
            spec = a4ray.load(str(Path.cwd().parent / "in" / "spec.yaml"))
            if call == "set":
                spec.set(args[0], args[1])
            elif call == "run":
                a4ray.run(spec)
            elif call == "plan":
                a4ray.plan(spec)
    except A4RayError as error:
        return error
    except Exception as error:  # noqa: BLE001 - the case fails below, naming it
        return error
    pytest.fail(f"{case.id}: the API accepted a malformed input")


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.timeout(60)) for c in ABSURD],
                         ids=[c.id for c in CASES + ABSURD])
def test_a_malformed_input_is_one_clear_error(case, tripwires, tmp_path, capsys):
    args = _materialize(case, tmp_path)
    if case.entry.startswith("api:"):
        error = _run_api(case, args)
        assert isinstance(error, A4RayError), f"{type(error).__name__}: {error}"
        assert error.exit_code == 2, error
        shown = str(error)
        out = capsys.readouterr()
        printed = shown + out.out + out.err
    else:
        result = tmp_path / "result.json"
        argv = args + (["--result", str(result)] if _takes_result(case, args) else [])
        try:
            if case.entry == "cli":
                code = cli(argv)
            else:
                code = importlib.import_module(f"a4ray.{case.entry.removeprefix('module:')}").main(argv)
        except SystemExit as exit:  # argparse
            code = exit.code
        out = capsys.readouterr()
        shown = out.err
        printed = out.out + out.err
        assert code == 2, f"exit {code}\n{printed}"
        if result.exists():
            recorded = json.loads(result.read_text())
            assert recorded["ok"] is False and case.field in recorded["error"], recorded
    assert case.field in shown, shown
    assert "Traceback" not in printed
    everything = printed + _written(tmp_path) + "\n".join(tripwires)
    for secret in SECRETS:
        assert secret not in everything, f"{case.id}: a planted secret was shown or recorded:\n{everything}"
    assert not tripwires, f"{case.id}: it got as far as Ray: {tripwires}"
    if case in ABSURD:
        written = [p for p in tmp_path.rglob("*") if p.is_file() and p.relative_to(tmp_path).parts[0] != "in"
                   and p.name != "result.json"]
        assert not written, f"{case.id}: refused, yet it wrote {written}"


def _takes_result(case: Case, args: list[str]) -> bool:
    return case.entry.startswith("module:") or (args[:1] and args[0] in ("run", "stage", "convert", "doctor",
                                                                        "nccl-test", "deepep-test"))


def _unbounded(annotation, metadata=(), where="") -> list[str]:
    """Integers and seconds in `annotation` (with the constraints `metadata` around it) that have no upper bound.
    (Every float is finite: `Spec` refuses inf and NaN.)"""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _unbounded(args[0], (*metadata, *args[1:]), where)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [found for name, info in annotation.model_fields.items()
                for found in _unbounded(info.annotation, info.metadata, f"{where}.{name}".lstrip("."))]
    if origin is not None or args:  # list[...], dict[..., ...], X | None, Literal[...]
        if origin is typing.Literal:
            return []
        return [found for arg in args for found in _unbounded(arg, metadata if origin in (types.UnionType,
                                                                                          typing.Union) else (),
                                                              where)]
    counted = annotation is int or (annotation is float and where.endswith("_s"))  # counts, sizes and seconds
    if counted and not any(isinstance(m, (annotated_types.Le, annotated_types.Lt))
                                              for m in _flat(metadata)):
        return [where]
    return []


def _flat(metadata):
    for item in metadata:
        if isinstance(item, FieldInfo):
            yield from _flat(item.metadata)
        else:
            yield item


def test_every_number_in_every_spec_has_an_upper_bound():
    """The limits live in the models: a count without one is how `cluster.nodes=1000000000` got through."""
    unbounded = {f"{kind}: {field}" for kind, cls in JOB_KINDS.items() for field in _unbounded(cls)}
    assert not unbounded, sorted(unbounded)


def _models(cls: type[BaseModel], seen: dict) -> dict:
    """Every spec model reachable from `cls`, by name."""
    if cls.__name__ not in seen:
        seen[cls.__name__] = cls
        for info in cls.model_fields.values():
            for sub in _leaves(info.annotation):
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    _models(sub, seen)
    return seen


def _leaves(annotation) -> list:
    args = typing.get_args(annotation)
    return [leaf for arg in args for leaf in _leaves(arg)] if args else [annotation]


def _holding(annotation, wrong: dict):
    """A value of `annotation`'s shape with `wrong[int]` / `wrong[float]` where it holds an integer / a number
    (mapping keys included), else None: a field of no such number."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _holding(args[0], wrong)
    if annotation in (int, float):
        return wrong.get(annotation)
    if origin in (types.UnionType, typing.Union):
        return next((value for arg in args if (value := _holding(arg, wrong)) is not None), None)
    if origin is list and (item := _holding(args[0], wrong)) is not None:
        return [item]
    if origin is dict:
        key, value = _holding(args[0], wrong), _holding(args[1], wrong)
        if key is not None:
            return {key: _fine(args[1])}
        if value is not None:
            return {_fine(args[0]): value}
    return None


def _fine(annotation):
    """A well-formed value of a mapping's key or value type."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _fine(args[0])
    return args[0] if origin is typing.Literal else {int: 1, float: 1.0, str: "x"}.get(annotation, {})


@pytest.mark.parametrize("wrong", [{int: True, float: True}, {int: 1.5}, {int: 2.0}], ids=["true", "fraction",
                                                                                        "whole-float"])
def test_every_number_in_every_spec_is_a_number(wrong):
    """YAML's `true` is no count, and neither is 1.5 or 2.0 where an integer is asked (a real number takes an
    integer): every number of every spec, mapping keys and list items included, refuses them at its own field."""
    models = {}
    for cls in JOB_KINDS.values():
        _models(cls, models)
    taken = []
    for cls in models.values():
        for name, info in cls.model_fields.items():
            value = _holding(info.annotation, wrong)
            if value is None:
                continue
            try:
                cls.model_validate({name: value})
            except ValidationError as error:
                if any(e["loc"][:1] == (name,) for e in error.errors()):
                    continue
            taken.append(f"{cls.__name__}.{name}={value!r}")
    assert len(models) > 30 and not taken, taken


def test_the_corpus_covers_every_job_kind():
    assert len(CASES) >= 60
    text = " ".join(f"{c.entry} {c.args} {c.spec!r}" for c in CASES)
    for kind in ("command", "ddp_test", "nccl_test", "deepep_test", "convert", "stage", "qwen3_next", "qwen3",
                 "swift_dpo", "cluster"):
        assert kind in text, kind


# ------------------------------------------------------------------------------ end to end


SUBPROCESS_CASES = [
    ("yaml", [PYTHON, "-m", "a4ray.ddp_test", "-f", "{spec}"], "kind: ddp_test\ncluster: {nodes: 2\n", "line 3"),
    ("list", [PYTHON, "-m", "a4ray.cli", "run", "-f", "{spec}"], "- kind: ddp_test\n", "top level"),
    ("missing", [PYTHON, "-m", "a4ray.qwen3_next", "-f", "{tmp}/nope.yaml"], None, "nope.yaml"),
    ("no-kind", [PYTHON, "-m", "a4ray.cli", "render", "cluster", "-f", "{spec}"], "cluster: {nodes: 2}\n", "kind"),
    ("secret", [PYTHON, "-m", "a4ray.nccl_test", "--set", SECRET_SET], None, "network.env.HF_TOKEN"),
    ("url", [PYTHON, "-m", "a4ray.stage", "-f", "{spec}"],
     STAGE + art(name="a", source=USER_URL + "/", target="a"), "artifacts[0]"),
    # Absurd but well-formed: before, this dry-run worked for minutes.
    ("nodes-billion", [PYTHON, "-m", "a4ray.ddp_test", "--dry-run", "--set", "cluster.nodes=1000000000"], None,
     "cluster.nodes"),
    ("duplicate-key", [PYTHON, "-m", "a4ray.cli", "run", "-f", "{spec}"], "kind: ddp_test\nname: a\nname: b\n",
     "'name' is given twice"),
    ("local-nodes-zero", [PYTHON, "-m", "a4ray.qwen3_next", "--local-nodes", "0", "--dry-run"], None,
     "cluster.nodes: expected a value greater than 0, got 0 (from --local-nodes 0)"),
]


@pytest.fixture(scope="module")
def end_to_end(tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """Every end-to-end case run as its own process, all at once (each is mostly Python importing a4ray: run
    side by side they share the cores instead of waiting in turn): name -> (exit code, stdout, stderr)."""
    running = {}
    for name, argv, spec, _ in SUBPROCESS_CASES:
        tmp = tmp_path_factory.mktemp(name)
        path = tmp / "spec.yaml"
        if spec is not None:
            path.write_text(spec)
        argv = [a.replace("{spec}", str(path)).replace("{tmp}", str(tmp)) for a in argv]
        running[name] = subprocess.Popen(argv, cwd=tmp, env=isolated_env(tmp), stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
    done = {}
    for name, proc in running.items():
        out, err = proc.communicate(timeout=300)
        done[name] = (proc.returncode, out, err)
    return done


@pytest.mark.parametrize("name, field", [(c[0], c[3]) for c in SUBPROCESS_CASES], ids=[c[0] for c in SUBPROCESS_CASES])
def test_no_traceback_end_to_end(name, field, end_to_end):
    code, out, err = end_to_end[name]
    assert code == 2, out + err
    assert field in err and "Traceback" not in out + err
    assert "cluster:" not in out  # refused before any cluster was started or joined
    for secret in SECRETS:
        assert secret not in out + err


def test_repo_jobs_still_load():
    """The corpus's rules refuse nothing the repo's own specs say."""
    for path in sorted((REPO / "jobs").glob("*.yaml")):
        a4ray.load(path)


# ------------------------------------------------------------------ symlinks, where the workspace is known


@pytest.mark.parametrize("kind, sets, link, field", [
    ("stage", ["artifacts[0].name=a", "artifacts[0].source=/nonexistent/a", "artifacts[0].target=link/a"],
     "link", "artifacts[0].target"),
    ("convert", ["convert.input=hf/m", "convert.output=link/mcore"], "link", "convert.output"),
    ("command", ["command.argv=[true]"], "runs", "run directory"),
])
def test_a_symlink_out_of_the_workspace_is_refused_before_anything_runs(local_cluster, tmp_path, kind, sets, link,
                                                                         field):
    workspace, outside = tmp_path / "ws", tmp_path / "outside"
    workspace.mkdir()
    outside.mkdir()
    (workspace / link).symlink_to(outside)
    spec = a4ray.load(None, f"storage.local_workspace={workspace}", "cluster.nodes=1", "cluster.gpus_per_node=1",
                      *sets, kind=kind)
    with pytest.raises(A4RayError) as error:
        a4ray.run(spec)
    assert error.value.exit_code == 2 and field in str(error.value) and str(outside) in str(error.value)
    assert list(outside.iterdir()) == [], "nothing was written through the link"
    assert link == "runs" or not (workspace / "runs").exists(), "no run directory either"


# ------------------------------------------------------------------ credentials in URLs


def test_the_dry_run_plan_and_its_result_mask_url_credentials(tripwires, tmp_path, capsys):
    spec = tmp_path / "in" / "stage.yaml"
    spec.parent.mkdir()
    spec.write_text(STAGE + art(name="a", source=USER_URL + "/f.bin", target="a")
                    + art(name="b", source=SIGNED_URL, target="b")
                    + art(name="c", source=f"https://h.example.com/f.bin?access_token={TOKEN}&v=2", target="c")
                    + art(name="d", source=f"git+https://x-access-token:{TOKEN}@github.com/o/r.git@{'a' * 40}",
                          target="d"))
    result = tmp_path / "plan.json"
    assert cli(["stage", "-f", str(spec), "--dry-run", "--result", str(result)]) == 0
    out = capsys.readouterr().out
    assert "https://alice:***@files.example.com/models/f.bin" in out
    assert "X-Goog-Signature=***&X-Goog-Expires=600" in out and "access_token=***&v=2" in out
    assert "git+https://x-access-token:***@github.com/o/r.git" in out
    assert a4ray.plan(a4ray.load(spec)) in out  # the API's plan is the same text
    for secret in SECRETS:
        assert secret not in out + _written(tmp_path)


def test_a_submitted_run_refuses_a_spec_whose_url_holds_credentials():
    from a4ray.driver.handle import submit
    from a4ray.runtime.connect import Connection

    spec = a4ray.load(None, f"artifacts[0].source={SIGNED_URL}", kind="qwen3_next")
    with pytest.raises(A4RayError) as refused:
        submit(spec, Connection(address="127.0.0.1:1", mode="address", dashboard_url="http://127.0.0.1:1"))
    assert "credentials" in str(refused.value) and SIG not in str(refused.value)


def test_a_signed_url_signed_again_is_the_same_source():
    from a4ray.spec.artifacts import ArtifactSpec

    first = ArtifactSpec(name="a", source=SIGNED_URL, target="a")
    again = ArtifactSpec(name="a", source=SIGNED_URL.replace(SIG, "b3RoZXJTaWduYXR1cmU"), target="a")
    assert first.fingerprint() == again.fingerprint()
    assert first.fingerprint() != ArtifactSpec(name="a", source=SIGNED_URL.replace("f.bin", "g.bin"),
                                               target="a").fingerprint()
