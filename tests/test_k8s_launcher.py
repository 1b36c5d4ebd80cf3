"""The pod launcher (launchers/ray-node.sh), run under bash as KubeRay would run it.

No GCE metadata server and no KubeRay here: a fake metadata server on 127.0.0.1 answers
`instance/attributes/physical_host` (or hangs, or is absent), a fake `ray` on PATH records the argv and
env it is started with, and KUBERAY_GEN_RAY_START_CMD is built from the rendered manifest the way
KubeRay v1.7.0 builds it (`ray-operator/controllers/ray/common/pod.go`).
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest
from ray._private.label_utils import parse_node_labels_string

from a4ray.k8s.render import render_cluster
from a4ray.runtime.topology import NodeFacts, rank_order
from a4ray.spec import load_job

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "launchers" / "ray-node.sh"
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def _int_quantity(value) -> int:
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", str(value))
    return int(match.group(1)) * _UNITS.get(match.group(2), 1)


def kuberay_start_command(group: dict, *, head: bool, cluster: str, namespace: str) -> str:
    """KUBERAY_GEN_RAY_START_CMD as KubeRay builds it from a group (params sorted, ` --k=v ` each)."""
    params = dict(group["rayStartParams"])
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    if group.get("labels"):
        params["labels"] = ",".join(f"{k}={v}" for k, v in sorted(group["labels"].items()))
    if group.get("resources"):
        custom = {k: _int_quantity(v) for k, v in group["resources"].items()}
        params["resources"] = "'" + json.dumps(custom, separators=(",", ":")) + "'"
    if head:
        params.setdefault("dashboard-host", "0.0.0.0")
    else:
        params.setdefault("address", f"{cluster}-head-svc.{namespace}.svc.cluster.local:6379")
    params.setdefault("metrics-export-port", "8080")
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", "52365")
    params.setdefault("num-cpus", str(_int_quantity(limits["cpu"])))
    params.setdefault("memory", str(_int_quantity(limits["memory"])))
    if "nvidia.com/gpu" in limits:
        params.setdefault("num-gpus", str(limits["nvidia.com/gpu"]))
    flags = "".join(f" --{k} " if v == "true" else f" --{k}={v} " for k, v in sorted(params.items()))
    return ("ray start --head " if head else "ray start ") + flags


class _Metadata(http.server.BaseHTTPRequestHandler):
    physical_host = "/blk-a/sub-1/host-7"

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.headers.get("Metadata-Flavor") != "Google":
            self.send_error(403, "missing Metadata-Flavor: Google")
        elif self.path == "/computeMetadata/v1/instance/attributes/physical_host":
            body = self.physical_host.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def metadata():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/computeMetadata/v1/instance/attributes/physical_host"
    server.shutdown()


@pytest.fixture(scope="module")
def rendered():
    spec = load_job(REPO / "jobs/cluster-a4.yaml", ["cluster.nodes=3"])
    return spec, render_cluster(spec).main


@pytest.fixture
def node(tmp_path):
    """A pod's filesystem: a fake gIB install, a fake `ray` that records how it was started."""
    gib = tmp_path / "gib"
    (gib / "scripts").mkdir(parents=True)
    (gib / "lib64").mkdir()
    # Like the real one: exports NCCL settings, and reads a variable that may be unset.
    (gib / "scripts/set_nccl_env.sh").write_text(
        'export NCCL_NET=gIB NCCL_CROSS_NIC=0\nif [ -n "$SOME_UNSET_VAR" ]; then export X=1; fi\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text('#!/bin/bash\nprintf "%s\\0" "$(basename "$0")" "$@" > "$FAKE_RAY_OUT.argv"\n'
                                 'env -0 > "$FAKE_RAY_OUT.env"\n')
    (bin_dir / "ray").chmod(0o755)
    return tmp_path


def launch(node: Path, start_cmd: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str], dict]:
    out = node / "ray-start"
    for suffix in (".argv", ".env"):
        Path(f"{out}{suffix}").unlink(missing_ok=True)
    full = {"PATH": f"{node / 'bin'}:{os.environ['PATH']}", "HOME": str(node),
            "KUBERAY_GEN_RAY_START_CMD": start_cmd, "FAKE_RAY_OUT": str(out),
            "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64:/opt/image/lib",
            "A4RAY_GIB_SCRIPT": str(node / "gib/scripts/set_nccl_env.sh"), "A4RAY_METADATA_TIMEOUT_S": "1", **env}
    proc = subprocess.run(["bash", str(LAUNCHER)], env=full, capture_output=True, text=True, timeout=60)
    if not Path(f"{out}.argv").exists():
        return proc, [], {}
    argv = Path(f"{out}.argv").read_text().split("\0")[:-1]
    ray_env = dict(item.split("=", 1) for item in Path(f"{out}.env").read_text().split("\0") if "=" in item)
    return proc, argv, ray_env


def flag(argv: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")), None)


def test_launcher_is_shellcheck_clean():
    assert shutil.which("shellcheck"), "shellcheck is installed by `make system-deps`"
    proc = subprocess.run(["shellcheck", "--severity=style", str(LAUNCHER)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_worker_starts_ray_with_the_gangs_labels_and_resource(node, metadata, rendered):
    """Three A4 workers: what reaches `ray start` is what the gang ranks and places by."""
    spec, cluster = rendered
    group = cluster["spec"]["workerGroupSpecs"][0]
    env = {e["name"]: e["value"] for e in group["template"]["spec"]["containers"][0]["env"] if "value" in e}
    start = kuberay_start_command(group, head=False, cluster="a4", namespace="default")
    facts = []
    for i, location in enumerate(["/blk-b/sub-0/host-2", "/blk-a/sub-1/host-9", "/blk-a/sub-1/host-3"]):
        _Metadata.physical_host = location
        proc, argv, ray_env = launch(node, start, A4RAY_METADATA_URL=metadata,
                                     A4RAY_TOPOLOGY_KEYS=env["A4RAY_TOPOLOGY_KEYS"], A4RAY_GIB=env["A4RAY_GIB"])
        assert proc.returncode == 0, proc.stderr
        assert argv[:2] == ["ray", "start"] and "--block" in argv and "--head" not in argv
        assert flag(argv, "address") == "a4-head-svc.default.svc.cluster.local:6379"
        assert flag(argv, "num-gpus") == "8"
        assert json.loads(flag(argv, "resources")) == {spec.cluster.node_resource: 1}
        labels = parse_node_labels_string(flag(argv, "labels"))  # Ray's own parser accepts them
        block, subblock, host = location.strip("/").split("/")
        assert labels == dict(zip(spec.cluster.topology.label_keys, (block, subblock, host)))
        # gIB env sourced before Ray, so the raylet and its workers inherit it; gIB's lib64 first.
        assert ray_env["NCCL_NET"] == "gIB"
        assert ray_env["LD_LIBRARY_PATH"] == f"{node}/gib/lib64:/usr/local/nvidia/lib64:/opt/image/lib"
        assert f"topology: {location}" in proc.stderr
        facts.append(NodeFacts(node_id=f"n{i}", ip=f"10.0.0.{9 - i}", hostname=f"pod-{i}", labels=labels))
    ordered = rank_order(facts, spec.cluster.topology)
    assert [f.labels[spec.cluster.topology.host_label] for f in ordered] == ["host-3", "host-9", "host-2"]


def test_head_and_the_no_topology_paths(node, metadata, rendered):
    _, cluster = rendered
    head_cmd = kuberay_start_command(cluster["spec"]["headGroupSpec"], head=True, cluster="a4", namespace="default")
    # The head's CPU VM has no physical_host attribute (404): no labels, a clear note, Ray starts.
    proc, argv, _ = launch(node, head_cmd, A4RAY_METADATA_URL=metadata.replace("physical_host", "absent"))
    assert proc.returncode == 0, proc.stderr
    assert "--head" in argv and flag(argv, "num-cpus") == "0" and flag(argv, "labels") is None
    assert "no physical_host" in proc.stderr and "ranks after labelled nodes" in proc.stderr

    worker_cmd = kuberay_start_command(cluster["spec"]["workerGroupSpecs"][0], head=False, cluster="a4",
                                       namespace="default")
    # Nothing listening (connection refused), and a server that never answers (the timeout).
    with socket.create_server(("127.0.0.1", 0)) as refused:
        port = refused.getsockname()[1]
    hanging = socket.create_server(("127.0.0.1", 0))
    try:
        for url in (f"http://127.0.0.1:{port}/x", f"http://127.0.0.1:{hanging.getsockname()[1]}/x"):
            proc, argv, _ = launch(node, worker_cmd, A4RAY_METADATA_URL=url)
            assert proc.returncode == 0, proc.stderr
            assert argv[:2] == ["ray", "start"] and flag(argv, "labels") is None
            assert f"no physical_host from {url}" in proc.stderr
    finally:
        hanging.close()
    assert "timed out" in proc.stderr.lower()

    # A group label set through KubeRay is kept next to the topology labels.
    proc, argv, _ = launch(node, worker_cmd.replace(" --block ", " --block  --labels=team=llm "),
                           A4RAY_PHYSICAL_HOST="/b/s/h")
    labels = parse_node_labels_string(flag(argv, "labels"))
    assert labels["team"] == "llm" and labels["cloud.google.com/gce-topology-host"] == "h"
    # A value that is not /<block>/<subblock>/<host> of label-safe names gives no labels, not a bad `ray start`.
    proc, argv, _ = launch(node, worker_cmd, A4RAY_PHYSICAL_HOST="/only-two/parts")
    assert proc.returncode == 0 and flag(argv, "labels") is None and "not /<block>/<subblock>/<host>" in proc.stderr


def test_gib_modes(node, rendered):
    _, cluster = rendered
    cmd = kuberay_start_command(cluster["spec"]["workerGroupSpecs"][0], head=False, cluster="a4", namespace="d")
    missing = str(node / "nowhere/scripts/set_nccl_env.sh")
    proc, argv, _ = launch(node, cmd, A4RAY_GIB="on", A4RAY_GIB_SCRIPT=missing, A4RAY_PHYSICAL_HOST="/b/s/h")
    assert proc.returncode == 1 and argv == [] and f"A4RAY_GIB=on but {missing} does not exist" in proc.stderr
    proc, argv, ray_env = launch(node, cmd, A4RAY_GIB_SCRIPT=missing, A4RAY_PHYSICAL_HOST="/b/s/h")
    assert proc.returncode == 0 and "NCCL_NET" not in ray_env and "not found" in proc.stderr
    assert ray_env["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64:/opt/image/lib"
    proc, argv, ray_env = launch(node, cmd, A4RAY_GIB="off", A4RAY_PHYSICAL_HOST="/b/s/h")
    assert proc.returncode == 0 and "NCCL_NET" not in ray_env
    proc, argv, _ = launch(node, "", A4RAY_PHYSICAL_HOST="/b/s/h")
    assert proc.returncode == 1 and "KUBERAY_GEN_RAY_START_CMD is not set" in proc.stderr
