"""`a4ray up/down/status/submit/logs` below the Kubernetes API call.

No Kubernetes API server can run here, so the commands run against a recording fake of the kubernetes
client's API objects (same method names and keyword arguments), and the tests check the exact calls:
group, version, plural, namespace and body. The dashboard side is real: a Ray head with token
authentication (`RAY_AUTH_MODE=token`) on this machine, reached through a4ray's port-forward and Ray's
JobSubmissionClient, as `a4ray submit --cluster` reaches a head pod.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from a4ray.cli import main as cli
from a4ray.commands import kube as commands
from a4ray.core.errors import KubeError
from a4ray.core.redact import redact
from a4ray.k8s import client as kc
from a4ray.k8s.render import render_cluster, render_job
from a4ray.k8s.validate import bundled_schema
from a4ray.spec import load_job
from conftest import free_port

REPO = Path(__file__).resolve().parents[1]
IMAGE = "kuberay.image=us-docker.pkg.dev/p/r/a4ray:25.12-ray2.60.0"
LUSTRE = ["kuberay.storage[0].type=lustre", "kuberay.storage[0].name=lustre", "kuberay.storage[0].mount_path=/mnt",
          "kuberay.storage[0].project=p", "kuberay.storage[0].location=z", "kuberay.storage[0].instance=i",
          "kuberay.storage[0].ip=10.0.0.2"]


class FakeApi:
    """Records every call; answers from `responses` (a value, an exception, or a function of the kwargs)."""

    def __init__(self, **responses):
        self.calls: list[tuple[str, dict]] = []
        self.responses = responses

    def __getattr__(self, method):
        def call(**kwargs):
            self.calls.append((method, kwargs))
            answer = self.responses.get(method)
            if isinstance(answer, Exception):
                raise answer
            return answer(**kwargs) if callable(answer) else answer

        return call


def crd(kind: str, *, auth_options: bool = True) -> dict:
    schema = bundled_schema(kind)
    if not auth_options:  # as the CRD of a KubeRay older than 1.5.1
        spec = schema["properties"]["spec"]["properties"]
        del (spec if kind == "RayCluster" else spec["rayClusterSpec"]["properties"])["authOptions"]
    return {"metadata": {"name": kind}, "spec": {"versions": [{"name": "v1", "schema": {"openAPIV3Schema": schema}}]}}


def ready_pod(name="a4-head-x"):
    return {"items": [{"metadata": {"name": name}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}]}


def fake_kube(*, exists: bool = False, auth_options: bool = True, status: dict | None = None):
    created: dict[str, dict] = {}

    def get(name, plural, **_):
        if plural in created or exists:
            body = created.get(plural) or {"metadata": {"name": name}, "spec": {"workerGroupSpecs": []}}
            return {**body, "status": status if status is not None else {
                "state": "ready", "readyWorkerReplicas": 2, "desiredWorkerReplicas": 2,
                "conditions": [{"type": "HeadPodReady", "status": "True"}]}}
        raise ApiException(status=404, reason="Not Found")

    def create(plural, body, **_):
        created[plural] = body
        return body

    custom = FakeApi(get_namespaced_custom_object=get, create_namespaced_custom_object=create)
    core = FakeApi(list_namespaced_pod=ready_pod())
    ext = FakeApi(read_custom_resource_definition=lambda name, **_: crd(
        "RayCluster" if name.startswith("rayclusters") else "RayJob", auth_options=auth_options))
    return kc.Kube(custom, core, ext)


@pytest.fixture
def kube(monkeypatch):
    made = {}

    def connect(args, **kw):
        return made.setdefault("kube", fake_kube(**made.get("options", {})))

    monkeypatch.setattr(commands, "_connect", connect)
    return made


def test_up_creates_storage_then_the_raycluster_and_waits(kube, capsys):
    argv = ["up", "-f", "jobs/cluster-a4.yaml", *(f"--set={s}" for s in LUSTRE), "--set", "cluster.nodes=4"]
    assert cli(argv) == 0
    k = kube["kube"]
    spec = load_job(REPO / "jobs/cluster-a4.yaml", [*LUSTRE, "cluster.nodes=4"])
    pv, pvc, raycluster = render_cluster(spec).objects
    assert [m for m, _ in k.ext.calls] == ["read_custom_resource_definition"] * 2
    assert k.core.calls[0] == ("create_persistent_volume", {"body": pv})
    assert k.core.calls[1] == ("create_namespaced_persistent_volume_claim", {"namespace": "default", "body": pvc})
    creates = [c for c in k.custom.calls if c[0] == "create_namespaced_custom_object"]
    assert creates == [("create_namespaced_custom_object", {"group": "ray.io", "version": "v1",
                                                            "namespace": "default", "plural": "rayclusters",
                                                            "body": raycluster})]
    assert k.core.calls[-1] == ("list_namespaced_pod", {"namespace": "default",
                                                        "label_selector": "ray.io/cluster=a4,ray.io/node-type=head"})
    assert "RayCluster default/a4 is ready" in capsys.readouterr().out


def test_up_on_an_operator_without_auth_options_puts_the_token_in_a_secret(kube, capsys):
    kube["options"] = {"auth_options": False}
    assert cli(["up", "-f", "jobs/cluster-a4.yaml", "--no-wait"]) == 0
    k = kube["kube"]
    method, kwargs = k.core.calls[0]
    assert method == "create_namespaced_secret" and kwargs["body"]["metadata"]["name"] == "a4-ray-token"
    token = kwargs["body"]["stringData"]["auth_token"]
    body = next(kw["body"] for m, kw in k.custom.calls if m == "create_namespaced_custom_object")
    assert "authOptions" not in body["spec"]
    for group in (body["spec"]["headGroupSpec"], body["spec"]["workerGroupSpecs"][0]):
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "a4-ray-token", "key": "auth_token"}
    out = capsys.readouterr()
    assert token not in out.out + out.err


def test_up_refuses_an_existing_cluster_and_dry_run_touches_nothing(kube, monkeypatch, capsys):
    kube["options"] = {"exists": True}
    assert cli(["up", "-f", "jobs/cluster-a4.yaml"]) == 2
    assert "RayCluster default/a4 already exists" in capsys.readouterr().err
    assert not [c for c in kube["kube"].custom.calls if c[0].startswith("create")]

    monkeypatch.setattr(commands, "_connect", lambda args: pytest.fail("--dry-run must not connect"))
    assert cli(["up", "-f", "jobs/cluster-a4.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert ("would call custom.create_namespaced_custom_object(group=ray.io, version=v1, namespace=default, "
            "plural=rayclusters) <- RayCluster a4") in out
    assert list(yaml.safe_load_all(out.split("\n", 1)[1]))[0]["kind"] == "RayCluster"
    assert cli(["down", "a4", "--dry-run"]) == 0
    assert "delete_namespaced_custom_object(group=ray.io, version=v1, namespace=default, plural=rayclusters, " \
           "name=a4)" in capsys.readouterr().out
    assert cli(["submit", "-f", "jobs/ddp_test.yaml", "--set", IMAGE, "--dry-run"]) == 0
    assert "plural=rayjobs) <- RayJob ddp-test" in capsys.readouterr().out


def test_down_deletes_the_object_and_what_a4ray_created_for_it(kube):
    assert cli(["down", "exp1", "--job", "-n", "team-a"]) == 0
    selector = "a4ray.io/release=exp1,a4ray.io/namespace=team-a"
    assert kube["kube"].custom.calls == [("delete_namespaced_custom_object", {
        "group": "ray.io", "version": "v1", "namespace": "team-a", "plural": "rayjobs", "name": "exp1"})]
    assert kube["kube"].core.calls == [
        ("delete_collection_namespaced_persistent_volume_claim", {"namespace": "team-a", "label_selector": selector}),
        ("delete_collection_persistent_volume", {"label_selector": selector}),
        ("delete_collection_namespaced_secret", {"namespace": "team-a", "label_selector": selector}),
    ]


def test_submit_creates_a_rayjob_validated_against_the_installed_crd(kube, capsys):
    assert cli(["submit", "-f", "jobs/ddp_test.yaml", "--set", IMAGE, "--no-follow"]) == 0
    spec = load_job(REPO / "jobs/ddp_test.yaml", [IMAGE])
    expected = render_job(spec, ["python", "-m", "a4ray.ddp_test", "--config", "jobs/ddp_test.yaml"]).main
    creates = [kw for m, kw in kube["kube"].custom.calls if m == "create_namespaced_custom_object"]
    assert creates == [{"group": "ray.io", "version": "v1", "namespace": "default", "plural": "rayjobs",
                        "body": expected}]
    assert "RayJob default/ddp-test created" in capsys.readouterr().out


def test_waiting_for_a_cluster_reports_and_times_out(capsys):
    pending = {"state": "", "readyWorkerReplicas": 1, "desiredWorkerReplicas": 4}
    kube = fake_kube(exists=True, status=pending)
    now = [0.0]
    with pytest.raises(KubeError, match=r"not ready after 60s: pending; head not ready; workers 1/4 ready"):
        kube.wait_ready("a4", "default", 60, poll_s=10, clock=lambda: now[0],
                        sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert capsys.readouterr().out.count("workers 1/4 ready") == 1  # said once, not every poll
    failed = fake_kube(exists=True, status={"state": "failed", "reason": "PodsFailed"})
    with pytest.raises(KubeError, match="failed: PodsFailed"):
        failed.wait_ready("a4", "default", 60)


def test_the_token_comes_from_the_clusters_secret_and_is_redacted():
    token = "tok-" + "x" * 40
    secret = {"data": {"auth_token": base64.b64encode(token.encode()).decode()}}
    kube = kc.Kube(FakeApi(), FakeApi(read_namespaced_secret=secret))
    cluster = {"metadata": {"name": "a4", "namespace": "ns"}, "spec": {"authOptions": {"mode": "token"}}}
    assert kube.auth_token(cluster) == token
    assert kube.core.calls == [("read_namespaced_secret", {"name": "a4", "namespace": "ns"})]
    assert redact(f"header Bearer {token}") == "header Bearer ***"
    named = {"metadata": {"name": "a4", "namespace": "ns"},
             "spec": {"authOptions": {"mode": "token", "secretName": "mine"}}}
    kube.auth_token(named)
    assert kube.core.calls[-1][1]["name"] == "mine"
    off = {"metadata": {"name": "a4", "namespace": "ns"},
           "spec": {"headGroupSpec": {"template": {"spec": {"containers": [{"name": "ray-head"}]}}}}}
    assert kube.auth_token(off) is None


# ------------------------------------------------------------------ a real Ray head with token auth


@pytest.fixture(scope="module")
def authed_head():
    """`ray start --head` with RAY_AUTH_MODE=token, as KubeRay starts a head with authOptions."""
    token = "a4ray-test-" + os.urandom(12).hex()
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="rk", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # TMPDIR too: its dashboard's forkserver, killed with the head, leaves its socket directory there.
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_TMPDIR=tmp, TMPDIR=tmp, HOME=tmp)
    proc = subprocess.Popen(
        ["ray", "start", "--head", "--block", "--port=0", f"--dashboard-port={port}", "--dashboard-host=127.0.0.1",
         "--num-cpus=1", "--num-gpus=0", f"--temp-dir={tmp}", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                probe = urllib.request.Request(f"http://127.0.0.1:{port}/api/version",
                                               headers={"Authorization": f"Bearer {token}"})
                urllib.request.urlopen(probe, timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the Ray head did not start") from None
                time.sleep(1)
        yield port, token
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_submit_and_logs_through_the_port_forward_with_the_token(authed_head, capsys):
    port, token = authed_head
    opened = []

    def open_stream():  # what pod_stream does with a Kubernetes port-forward websocket
        opened.append(1)
        return socket.create_connection(("127.0.0.1", port))

    with kc.PortForward(open_stream) as forward:
        client = kc.job_client(forward.url, token)
        job_id = commands.submit_to_cluster(client, ["python", "-c", "print('hello from the A4 gang')"],
                                            name="hello")
        assert job_id.startswith("hello-")
        final = kc.follow_logs(client, job_id, lambda text: print(text, end=""))
        assert final == "SUCCEEDED"
        assert "hello from the A4 gang" in capsys.readouterr().out
        assert client.get_job_info(job_id).metadata["a4ray.job"] == "hello"
        with pytest.raises(Exception, match="(?i)authenticat|forbidden|401|403"):
            kc.job_client(forward.url, "wrong-token").list_jobs()
        # Ctrl-C while following a job (`a4ray submit`, `a4ray logs --follow`) ends the following, not the job, and
        # without a traceback: follow_logs says so by returning no final status; the command then says how to follow
        # it again and how to stop it, and exits 130. A real SIGINT, in Ray's own log tail.
        waiting = commands.submit_to_cluster(client, ["python", "-c", "import time; print('waiting', flush=True); "
                                                      "time.sleep(600)"], name="waits")

        def interrupt_once_it_runs(text: str) -> None:
            if "waiting" in text:
                signal.raise_signal(signal.SIGINT)

        assert kc.follow_logs(client, waiting, interrupt_once_it_runs) is None
        assert client.get_job_status(waiting).value == "RUNNING"
        assert commands._detached(waiting, f"a4ray logs a4 --job-id {waiting} --follow", f"ray job stop {waiting}") == 130
        assert "it goes on" in capsys.readouterr().out
        client.stop_job(waiting)
    assert len(opened) >= 2  # one stream per connection, as kubectl port-forward



def test_a_submission_waits_for_a_head_whose_job_agent_is_not_up_yet(capsys):
    """A head's dashboard answers before its job agent is up: Ray's job API then says "No available agent to submit
    job, please try again later" (a clean-clone CI run lost this module's submission to it). a4ray tries again
    for a bounded time, and says so once; any other error is the user's at once.

    Ray's own JobSubmissionClient against a local endpoint that answers as Ray 2.60's job head does while its
    agent is not up (dashboard/modules/job/job_head.py, `submit_job`: HTTP 500 with that text; /api/version as the
    client checks it first): no Ray head can be held in that state on purpose."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import ray
    from ray.job_submission import JobSubmissionClient

    from a4ray.runtime.connect import submit_job

    answers: list[tuple[int, str]] = []  # what the next POST /api/jobs/ gets; then 200
    posts: list[dict] = []

    class Head(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, status: int, body: str, kind: str = "application/json"):
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body.encode())))
            self.end_headers()
            self.wfile.write(body.encode())

        def do_GET(self):
            self._reply(200, json.dumps({"version": "4", "ray_version": ray.__version__, "ray_commit": "x"}))

        def do_POST(self):
            posts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            if answers:
                self._reply(*answers.pop(0), kind="text/plain")
            else:
                sid = posts[-1]["submission_id"]
                self._reply(200, json.dumps({"job_id": sid, "submission_id": sid}))

    server = ThreadingHTTPServer(("127.0.0.1", 0), Head)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    not_up = (500, "No available agent to submit job, please try again later.")
    try:
        client = JobSubmissionClient(f"http://127.0.0.1:{server.server_port}")
        answers[:] = [not_up, not_up]
        assert submit_job(client, entrypoint="python x.py", submission_id="hello-1") == "hello-1" and len(posts) == 3
        assert capsys.readouterr().out.count("the head's job agent is not up yet; trying again for up to 60 s") == 1
        posts.clear()
        answers[:] = [not_up] * 99
        with pytest.raises(RuntimeError, match="No available agent"):
            submit_job(client, wait_s=1.5, entrypoint="python x.py", submission_id="hello-2")
        assert 2 <= len(posts) <= 4
        posts.clear()
        answers[:] = [(400, "Job with submission_id hello-3 already exists. Please use a different submission_id.")]
        with pytest.raises(RuntimeError, match="already exists"):
            submit_job(client, entrypoint="python x.py", submission_id="hello-3")
        assert len(posts) == 1
    finally:
        server.shutdown()


def test_status_lists_clusters_and_jobs(kube, capsys):
    listing = {"rayclusters": [{"metadata": {"name": "a4", "creationTimestamp": "2026-01-01T00:00:00Z"},
                                "spec": {"workerGroupSpecs": [{"replicas": 4}]},
                                "status": {"state": "ready", "readyWorkerReplicas": 3, "desiredWorkerReplicas": 4}}],
               "rayjobs": [{"metadata": {"name": "qwen3-next"}, "spec": {},
                            "status": {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING",
                                       "rayClusterName": "qwen3-next-x7k2"}}]}
    kube["kube"] = kc.Kube(FakeApi(list_namespaced_custom_object=lambda plural, **_: {"items": listing[plural]}),
                           FakeApi())
    assert cli(["status", "-n", "team-a"]) == 0
    out = capsys.readouterr().out
    assert "ready; head not ready; workers 3/4 ready" in out
    assert "Running; job RUNNING; cluster qwen3-next-x7k2" in out
    assert kube["kube"].custom.calls[0] == ("list_namespaced_custom_object", {
        "group": "ray.io", "version": "v1", "namespace": "team-a", "plural": "rayclusters",
        "label_selector": "app.kubernetes.io/managed-by=a4ray"})
    assert cli(["status", "nothing-here"]) == 1

