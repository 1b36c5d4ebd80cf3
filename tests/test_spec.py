"""Spec loading: YAML files, Helm-style --set overrides, and errors that name file, field and type."""

from __future__ import annotations

from pathlib import Path

import pytest

from a4ray.core.errors import SpecError
from a4ray.spec import JOB_KINDS, load_job

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(excinfo) -> str:
    return str(excinfo.value)


def test_every_shipped_job_spec_loads():
    for path in sorted((REPO / "jobs").glob("*.yaml")):
        spec = load_job(path)
        assert spec.kind in JOB_KINDS, path


def test_good_yaml_with_defaults(tmp_path):
    path = write(tmp_path, """
kind: ddp_test
cluster: {nodes: 4}
network:
  gib: on            # YAML 1.1 would read this as True; specs use YAML 1.2 booleans
  env: {NCCL_IB_QPS_PER_CONNECTION: 2, NCCL_DEBUG: INFO}
ddp_test: {steps: 5}
""")
    spec = load_job(path)
    assert spec.name == "ddp-test"
    assert (spec.cluster.nodes, spec.cluster.gpus_per_node) == (4, 8)
    assert spec.network.gib == "on"
    assert spec.network.env == {"NCCL_IB_QPS_PER_CONNECTION": "2", "NCCL_DEBUG": "INFO"}
    assert spec.network.gib_lib_dir == "/usr/local/gib/lib64"
    assert spec.storage.workspace == "/mnt"
    assert spec.ddp_test.steps == 5 and spec.ddp_test.hidden == 1024
    assert spec.source == str(path)


def test_unknown_key_is_named_with_a_suggestion(tmp_path):
    path = write(tmp_path, "kind: ddp_test\ncluster: {node: 4}\n")
    with pytest.raises(SpecError) as e:
        load_job(path)
    text = problems(e)
    assert str(path) in text
    assert "cluster.node: unknown field; did you mean 'nodes'?" in text


def test_wrong_type_names_field_expected_and_given(tmp_path):
    path = write(tmp_path, "kind: ddp_test\ncluster: {nodes: two}\nddp_test: {backend: mpi}\n")
    with pytest.raises(SpecError) as e:
        load_job(path)
    text = problems(e)
    assert "cluster.nodes: expected an integer" in text and "got 'two'" in text
    assert "ddp_test.backend: expected 'auto', 'nccl' or 'gloo', got 'mpi'" in text


def test_env_values_refuse_booleans_and_bad_names(tmp_path):
    path = write(tmp_path, "kind: ddp_test\nnetwork: {env: {NCCL_DEBUG: true, 1BAD: x}}\n")
    with pytest.raises(SpecError) as e:
        load_job(path)
    assert "network.env" in problems(e)
    assert "'1BAD' is not a valid environment variable name" in problems(e)


def test_set_overrides_nested_and_list_fields(tmp_path):
    path = write(tmp_path, "kind: command\ncommand: {argv: [echo, a, b]}\n")
    spec = load_job(path, ["cluster.nodes=3,network.env.NCCL_DEBUG=INFO", "command.argv[1]=x",
                           "command.argv.2=y", "command.argv[3]=appended", "cluster.topology.order=ip"])
    assert spec.cluster.nodes == 3
    assert spec.network.env["NCCL_DEBUG"] == "INFO"
    assert spec.command.argv == ["echo", "x", "y", "appended"]
    assert spec.cluster.topology.order == "ip"


def test_set_values_are_typed_by_yaml():
    spec = load_job(None, ["command.argv=[bash, -c, 'echo 1,2']", "timeout_s=1e3", "network.gib=off"],
                    kind="command")
    assert spec.command.argv == ["bash", "-c", "echo 1,2"]
    assert spec.timeout_s == 1000.0
    assert spec.network.gib == "off"


def test_set_errors_name_the_override():
    with pytest.raises(SpecError) as e:
        load_job(None, ["cluster.nodes=two"], kind="ddp_test")
    assert "cluster.nodes: expected an integer" in problems(e)
    assert "(from --set cluster.nodes=two)" in problems(e)
    with pytest.raises(SpecError) as e:
        load_job(None, ["ddp_test.stepz=3"], kind="ddp_test")
    assert "ddp_test.stepz: unknown field; did you mean 'steps'?" in problems(e)
    with pytest.raises(SpecError) as e:
        load_job(None, ["command.argv=[a]", "command.argv[5]=x"], kind="command")
    assert "index 5 is past the end of command.argv (1 items)" in problems(e)
    with pytest.raises(SpecError) as e:
        load_job(None, ["cluster.nodes"], kind="ddp_test")
    assert "expected key=value" in problems(e)


def test_set_can_supply_a_required_field():
    spec = load_job(None, ["command.argv=[hostname]"], kind="command")
    assert spec.command.argv == ["hostname"]
    with pytest.raises(SpecError) as e:
        load_job(None, [], kind="command")
    assert "command: required field is missing" in problems(e)


def test_kind_mismatch_and_unknown_kind(tmp_path):
    path = write(tmp_path, "kind: command\ncommand: {argv: [x]}\n")
    with pytest.raises(SpecError) as e:
        load_job(path, kind="ddp_test")
    assert "this is a 'command' spec, but this entry point runs 'ddp_test'" in problems(e)
    with pytest.raises(SpecError) as e:
        load_job(write(tmp_path, "kind: nope\n", "n.yaml"))
    assert "unknown job kind 'nope'" in problems(e)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(SpecError) as e:
        load_job(tmp_path / "absent.yaml")
    assert "absent.yaml" in problems(e) and "file not found" in problems(e)
    with pytest.raises(SpecError) as e:
        load_job(write(tmp_path, "kind: ddp_test\ncluster: [\n"))
    assert "not valid YAML (line" in problems(e)


def test_python_set_returns_a_validated_copy():
    spec = load_job(None, kind="ddp_test")
    four = spec.set("cluster.nodes", 4)
    assert (spec.cluster.nodes, four.cluster.nodes) == (2, 4)
    with pytest.raises(SpecError):
        spec.set("cluster.nodes", "many")


def test_resolved_spec_round_trips_through_yaml(tmp_path):
    spec = load_job(None, ["cluster.nodes=3", "network.env.X=1"], kind="ddp_test")
    again = load_job(write(tmp_path, spec.to_yaml()))
    assert again.model_dump() == spec.model_dump()


def test_compile_caches_go_under_the_workspace_as_given_or_nowhere():
    def env(*sets: str) -> dict[str, str]:
        return load_job(None, list(sets), kind="ddp_test").storage.compile_cache_env("/mnt")

    assert env() == {"TORCHINDUCTOR_CACHE_DIR": "/mnt/cache/compile/inductor",
                     "TRITON_CACHE_DIR": "/mnt/cache/compile/triton"}
    assert env("storage.compile_cache=/mnt/compile")["TRITON_CACHE_DIR"] == "/mnt/compile/triton"
    assert env("storage.compile_cache=") == {}
    with pytest.raises(SpecError) as e:  # a write path, as every other: inside the workspace
        env("storage.compile_cache=/lustre/compile")
    assert "storage.compile_cache" in problems(e)
