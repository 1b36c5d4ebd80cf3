"""Launch environment: gIB sourced by real bash, layer precedence, the never-override rule, redaction."""

from __future__ import annotations

from pathlib import Path

import pytest

from a4ray.core.errors import GibMissing
from a4ray.core.redact import Redactor, redact, register_secret
from a4ray.runtime.netenv import EnvLayer, build_env, gib_layer, source_script
from a4ray.spec.cluster import NetworkSpec

SENTINEL = "hf_SENTINEL_secret_value_0123456789"


def fake_gib(tmp_path: Path) -> Path:
    """A gIB tree like /usr/local/gib: scripts/set_nccl_env.sh exporting A4-like values."""
    scripts = tmp_path / "gib" / "scripts"
    scripts.mkdir(parents=True)
    script = scripts / "set_nccl_env.sh"
    script.write_text(
        "echo 'this banner must not leak into the env'\n"
        "export NCCL_NET=gIB\nexport NCCL_CROSS_NIC=0\nexport NCCL_IB_QPS_PER_CONNECTION=4\n"
        "export NCCL_SOCKET_IFNAME=enp0s19\n"
        "export LD_LIBRARY_PATH=/opt/extra:$LD_LIBRARY_PATH\n"
        "export NCCL_NVLS_ENABLE=1\n"
        "unset UNWANTED\n"
    )
    return script


def network(script: Path, **kw) -> NetworkSpec:
    return NetworkSpec(gib_script=str(script), **kw)


def test_source_script_takes_exports_and_unsets(tmp_path):
    script = fake_gib(tmp_path)
    changed = source_script(str(script), {"PATH": "/usr/bin:/bin", "UNWANTED": "x", "KEEP": "y"})
    assert changed["NCCL_NET"] == "gIB"
    assert changed["UNWANTED"] is None
    assert "KEEP" not in changed and "SHLVL" not in changed and "PWD" not in changed


def test_env_precedence_and_gib_overrides(tmp_path):
    script = fake_gib(tmp_path)
    base = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/usr/lib/cuda", "NCCL_DEBUG": "WARN",
            "RANK": "7", "MASTER_ADDR": "stale"}
    net = network(script, env={"NCCL_IB_QPS_PER_CONNECTION": "2"})
    gib, note = gib_layer(net, base, "node 0")
    assert "sourced" in note
    env = build_env(base, [gib, EnvLayer("workload", {"NCCL_DEBUG": "INFO", "NCCL_CROSS_NIC": "1"}),
                           EnvLayer("user", net.env)])
    e = env.env
    assert e["NCCL_NET"] == "gIB"                                   # from the script
    assert e["NCCL_SOCKET_IFNAME"] == "eth0,eth1"                   # A4 override beats the script
    assert e["NCCL_TUNER_CONFIG_PATH"].endswith("tuner_config_a4.txtpb")
    assert e["GLOO_SOCKET_IFNAME"] == "eth0"  # as 27 of gpu-recipes' 29 A4 training recipes set it
    assert e["NCCL_CROSS_NIC"] == "1"                               # workload beats gIB
    assert e["NCCL_IB_QPS_PER_CONNECTION"] == "2"                   # user beats everything
    assert e["NCCL_DEBUG"] == "INFO"
    gib_lib = str(tmp_path / "gib" / "lib64")
    assert e["LD_LIBRARY_PATH"].split(":") == [gib_lib, "/opt/extra", "/usr/lib/cuda"]
    assert "RANK" not in e and "MASTER_ADDR" not in e              # stale launch contract dropped
    assert env.changes["NCCL_IB_QPS_PER_CONNECTION"] == ("2", "user")
    assert "PATH" not in env.changes


def test_operator_multicast_settings_are_never_overridden(tmp_path):
    script = fake_gib(tmp_path)  # it exports NCCL_NVLS_ENABLE=1
    base = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
    gib, _ = gib_layer(network(script), base, "node 0")
    env = build_env(base, [gib, EnvLayer("workload", {"NVSHMEM_DISABLE_NVLS": None}),
                           EnvLayer("user", {"NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"})])
    assert env.env["NCCL_NVLS_ENABLE"] == "0"
    assert env.env["NVSHMEM_DISABLE_NVLS"] == "1"
    # Not set by the operator on this node: the user may set it.
    assert env.env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "0"
    notes = " ".join(env.notes)
    assert "kept NCCL_NVLS_ENABLE=0" in notes and "kept NVSHMEM_DISABLE_NVLS=1" in notes
    assert "NCCL_NVLS_ENABLE" not in env.changes


def test_gib_modes_when_the_script_is_missing(tmp_path):
    missing = NetworkSpec(gib_script=str(tmp_path / "nope" / "set_nccl_env.sh"), gib="on")
    with pytest.raises(GibMissing) as e:
        gib_layer(missing, {}, "node 3 (host-a)")
    assert "node 3 (host-a)" in str(e.value) and "not found" in str(e.value)
    layer, note = gib_layer(missing.model_copy(update={"gib": "auto"}), {}, "node 3 (host-a)")
    assert layer is None and "gIB not used on node 3 (host-a)" in note
    layer, note = gib_layer(missing.model_copy(update={"gib": "off"}), {}, "n")
    assert layer is None and "off" in note


def test_a_failing_gib_script_is_named(tmp_path):
    script = tmp_path / "set_nccl_env.sh"
    script.write_text("return 3\n")
    with pytest.raises(GibMissing) as e:
        gib_layer(NetworkSpec(gib_script=str(script), gib="on"), {}, "node 1")
    assert "sourcing" in str(e.value) and "node 1" in str(e.value)


def test_env_report_masks_secrets():
    env = build_env({}, [EnvLayer("user", {"HF_TOKEN": SENTINEL, "NCCL_DEBUG": "INFO",
                                           "NOTE": f"token is {SENTINEL}"})])
    report = "\n".join(env.report())
    assert SENTINEL not in report
    assert "HF_TOKEN=***  [user]" in report and "NCCL_DEBUG=INFO" in report


def test_redactor_masks_known_values_everywhere():
    r = Redactor([SENTINEL, "short"])
    assert r.text(f"curl -H 'Authorization: Bearer {SENTINEL}'") == "curl -H 'Authorization: Bearer ***'"
    assert r.env({"HF_TOKEN": "x" * 8, "PATH": f"/a:{SENTINEL}"}) == {"HF_TOKEN": "***", "PATH": "/a:***"}
    register_secret(SENTINEL)
    assert SENTINEL not in redact(f"error: bad token {SENTINEL}")
