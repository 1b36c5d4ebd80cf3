"""The thin layer between a4ray and a real GKE cluster: Kubernetes API calls, a dashboard port-forward,
and Ray's JobSubmissionClient with the cluster's auth token.

Every change a command makes is first planned as a list of `ApiCall`s, so `--dry-run` prints exactly
the calls it would make and tests check them against a recording fake API; only `Kube.run` talks to
Kubernetes. The token is read from its Secret into memory, registered with the redactor, and sent
only as an HTTP header.
"""

from __future__ import annotations

import base64
import json
import secrets as _secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import yaml

from a4ray.core.console import say
from a4ray.core.errors import KubeError
from a4ray.core.redact import register_secret
from a4ray.k8s import storage as st
from a4ray.k8s.render import AUTH_TOKEN_KEY, DASHBOARD_PORT, OperatorCaps, to_yaml
from a4ray.k8s.validate import GROUP, PLURALS, VERSION, schema_from_crd


@dataclass
class ApiCall:
    """One Kubernetes API call: `api` is the client attribute (custom, core), `method` its method."""

    api: str
    method: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    quiet_if: tuple[int, ...] = ()  # HTTP statuses that mean "already so" (409 on create, 404 on delete)

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.kwargs.items() if k != "body" and not k.startswith("_"))
        body = self.kwargs.get("body")
        what = f" <- {body['kind']} {body['metadata']['name']}" if isinstance(body, dict) and "kind" in body else ""
        return f"{self.api}.{self.method}({args}){what}"


def create_calls(objects: list[dict]) -> list[ApiCall]:
    """Create storage objects (existing ones are kept: same release, same names) then the Ray object."""
    calls = []
    for obj in objects:
        kind, meta = obj["kind"], obj["metadata"]
        if kind == "PersistentVolume":
            calls.append(ApiCall("core", "create_persistent_volume", {"body": obj}, quiet_if=(409,)))
        elif kind == "PersistentVolumeClaim":
            calls.append(ApiCall("core", "create_namespaced_persistent_volume_claim",
                                 {"namespace": meta["namespace"], "body": obj}, quiet_if=(409,)))
        elif kind == "Secret":
            calls.append(ApiCall("core", "create_namespaced_secret", {"namespace": meta["namespace"], "body": obj},
                                 quiet_if=(409,)))
        elif kind in PLURALS:
            calls.append(ApiCall("custom", "create_namespaced_custom_object",
                                 {"group": GROUP, "version": VERSION, "namespace": meta["namespace"],
                                  "plural": PLURALS[kind], "body": obj}))
        else:
            raise ValueError(f"a4ray does not create {kind} objects")
    return calls


def delete_calls(kind: str, name: str, namespace: str, *, keep_storage: bool = False) -> list[ApiCall]:
    """Delete the Ray object, then (unless kept) the PVCs and PVs a4ray created for it (data is retained)."""
    calls = [ApiCall("custom", "delete_namespaced_custom_object",
                     {"group": GROUP, "version": VERSION, "namespace": namespace, "plural": PLURALS[kind],
                      "name": name}, quiet_if=(404,))]
    if not keep_storage:
        selector = f"{st.RELEASE_LABEL}={name},{st.NAMESPACE_LABEL}={namespace}"
        calls += [
            ApiCall("core", "delete_collection_namespaced_persistent_volume_claim",
                    {"namespace": namespace, "label_selector": selector}),
            ApiCall("core", "delete_collection_persistent_volume", {"label_selector": selector}),
        ]
    # The Ray token Secret a4ray generated for this release (a Secret the user named is theirs to keep).
    calls.append(ApiCall("core", "delete_collection_namespaced_secret",
                         {"namespace": namespace, "label_selector": f"{st.RELEASE_LABEL}={name},"
                          f"{st.NAMESPACE_LABEL}={namespace}"}))
    return calls


def list_call(kind: str, namespace: str) -> ApiCall:
    """The RayClusters / RayJobs a4ray made in `namespace`."""
    return ApiCall("custom", "list_namespaced_custom_object",
                   {"group": GROUP, "version": VERSION, "namespace": namespace, "plural": PLURALS[kind],
                    "label_selector": "app.kubernetes.io/managed-by=a4ray"})


def token_secret(name: str, namespace: str, release: str) -> dict:
    """A Secret with a fresh random Ray token (auth via env, where KubeRay lacks authOptions)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {**st.MANAGED_BY, st.RELEASE_LABEL: release, st.NAMESPACE_LABEL: namespace}},
            "stringData": {AUTH_TOKEN_KEY: _secrets.token_urlsafe(32)}}


def print_plan(calls: list[ApiCall]) -> None:
    """What --dry-run shows: each call, and the manifest of each create (a Secret's data masked)."""
    for call in calls:
        say(f"would call {call.describe()}")
        body = call.kwargs.get("body")
        if isinstance(body, dict):
            if body.get("kind") == "Secret":
                body = {**body, "stringData": {k: "<generated>" for k in body.get("stringData", {})}}
            print(to_yaml([body]), end="", flush=True)


def _to_dict(obj: Any) -> Any:
    return obj.to_dict() if hasattr(obj, "to_dict") else obj


class Kube:
    """The Kubernetes APIs a4ray uses. Construct with real clients (`Kube.connect()`) or fakes (tests)."""

    def __init__(self, custom: Any, core: Any, ext: Any = None):
        self.custom, self.core, self.ext = custom, core, ext

    @classmethod
    def connect(cls, context: str | None = None) -> Kube:
        from kubernetes import client, config

        try:
            config.load_kube_config(context=context)
        except Exception as kube_config_error:  # noqa: BLE001 - try the in-cluster service account next
            try:
                config.load_incluster_config()
            except config.ConfigException:
                raise KubeError(f"no Kubernetes cluster configured ({kube_config_error})",
                                hint="run `gcloud container clusters get-credentials CLUSTER --location LOC` "
                                "(or pass --context)") from None
        return cls(client.CustomObjectsApi(), client.CoreV1Api(), client.ApiextensionsV1Api())

    def run(self, call: ApiCall) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return getattr(getattr(self, call.api), call.method)(**call.kwargs)
        except ApiException as e:
            if e.status in call.quiet_if:
                return None
            raise KubeError(f"{call.describe()} failed: HTTP {e.status} {e.reason}: {_api_message(e)}",
                            hint=_hint(e.status)) from None

    def run_all(self, calls: list[ApiCall]) -> None:
        for call in calls:
            result = self.run(call)
            say(f"{'exists' if result is None and call.quiet_if == (409,) else 'done'}: {call.describe()}")

    def get(self, kind: str, name: str, namespace: str) -> dict | None:
        call = ApiCall("custom", "get_namespaced_custom_object",
                       {"group": GROUP, "version": VERSION, "namespace": namespace, "plural": PLURALS[kind],
                        "name": name}, quiet_if=(404,))
        return self.run(call)

    def list(self, kind: str, namespace: str) -> list[dict]:
        return self.run(list_call(kind, namespace)).get("items", [])

    def caps(self) -> OperatorCaps:
        """What the installed KubeRay supports, and its CRD schemas (manifests are validated against them)."""
        schemas = {}
        for kind, plural in PLURALS.items():
            # Raw JSON: the typed client model of a CRD does not round-trip its schema's x-kubernetes keys.
            crd = self.run(ApiCall("ext", "read_custom_resource_definition",
                                   {"name": f"{plural}.{GROUP}", "_preload_content": False}, quiet_if=(404,)))
            if crd is None:
                raise KubeError(f"the cluster has no {plural}.{GROUP} CRD: KubeRay is not installed",
                                hint="enable the GKE Ray Operator add-on (--addons=RayOperator) or install the "
                                "kuberay-operator Helm chart")
            schemas[kind] = schema_from_crd(crd if isinstance(crd, dict) else json.loads(crd.data))
        has_auth = "authOptions" in schemas["RayCluster"].get("properties", {}).get("spec", {}).get("properties", {})
        return OperatorCaps(auth_options=has_auth, cluster_schema=schemas["RayCluster"],
                            job_schema=schemas["RayJob"])

    def head_pod(self, cluster: str, namespace: str) -> dict | None:
        pods = self.run(ApiCall("core", "list_namespaced_pod", {
            "namespace": namespace, "label_selector": f"ray.io/cluster={cluster},ray.io/node-type=head"}))
        items = _to_dict(pods).get("items") or []
        return items[0] if items else None

    def watch(self, kind: str, name: str, namespace: str, *, summary: Callable[[dict], str],
              done: Callable[[dict], bool], until: str, timeout_s: float, hint: str, poll_s: float = 5.0,
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> dict:
        """Poll an object until `done(obj)`, saying each new `summary` line; an error if it is gone, or not
        `until` ("ready", "running") within `timeout_s` (with `hint`)."""
        deadline, last = clock() + timeout_s, ""
        while True:
            obj = self.get(kind, name, namespace)
            if obj is None:
                raise KubeError(f"{kind} {namespace}/{name} does not exist (deleted while waiting?)")
            line = summary(obj)
            if line != last:
                say(f"{name}: {line}")
                last = line
            if done(obj):
                return obj
            if clock() >= deadline:
                raise KubeError(f"{kind} {namespace}/{name} not {until} after {timeout_s:g}s: {line}", hint=hint)
            sleep(poll_s)

    def wait_ready(self, cluster: str, namespace: str, timeout_s: float, poll_s: float = 5.0,
                   clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> dict:
        """Until the RayCluster is provisioned and its head pod is Ready (NeMo-Run's readiness rule)."""

        def ready(obj: dict) -> bool:
            if (obj.get("status") or {}).get("state") == "failed":
                raise KubeError(f"RayCluster {namespace}/{cluster} failed: {obj['status'].get('reason', '?')}",
                                hint=f"kubectl describe raycluster {cluster} -n {namespace}")
            return cluster_ready(obj) and pod_ready(self.head_pod(cluster, namespace))

        return self.watch("RayCluster", cluster, namespace, summary=cluster_summary, done=ready, until="ready",
                          timeout_s=timeout_s, poll_s=poll_s, clock=clock, sleep=sleep,
                          hint=f"kubectl get pods -l ray.io/cluster={cluster} -n {namespace}; nodes may still be "
                          "provisioning (or Kueue has not admitted the cluster)")

    def wait_submitted(self, job: str, namespace: str, timeout_s: float, poll_s: float = 5.0) -> dict:
        """Until the RayJob's job was submitted (it has a job id and a cluster), or it ended."""

        def submitted(obj: dict) -> bool:
            status = obj.get("status") or {}
            state = status.get("jobDeploymentStatus")
            return state in ("Complete", "Failed", "ValidationFailed") or bool(
                status.get("jobId") and status.get("rayClusterName") and state == "Running")

        return self.watch("RayJob", job, namespace, summary=job_summary, done=submitted, until="running",
                          timeout_s=timeout_s, poll_s=poll_s,
                          hint="Kueue may not have admitted it yet, or nodes are still coming: a4ray status")

    def auth_token(self, cluster_obj: dict) -> str | None:
        """The Ray token of a RayCluster (from its Secret), or None if it has no token auth."""
        spec = cluster_obj.get("spec") or {}
        meta = cluster_obj["metadata"]
        secret = None
        auth = spec.get("authOptions") or {}
        if auth.get("mode") == "token":
            secret = auth.get("secretName") or meta["name"]  # KubeRay names its generated Secret after the cluster
        else:
            for env in spec["headGroupSpec"]["template"]["spec"]["containers"][0].get("env") or []:
                if env["name"] == "RAY_AUTH_TOKEN":
                    secret = env["valueFrom"]["secretKeyRef"]["name"]
        if secret is None:
            return None
        data = _to_dict(self.run(ApiCall("core", "read_namespaced_secret",
                                         {"name": secret, "namespace": meta["namespace"]}))).get("data") or {}
        if AUTH_TOKEN_KEY not in data:
            raise KubeError(f"Secret {meta['namespace']}/{secret} has no key {AUTH_TOKEN_KEY}",
                            hint="the Ray token Secret must hold the token under auth_token")
        token = base64.b64decode(data[AUTH_TOKEN_KEY]).decode().strip()
        register_secret(token)
        return token


def _api_message(error: Any) -> str:
    try:
        return yaml.safe_load(error.body).get("message", "")
    except Exception:  # noqa: BLE001 - the body is not always JSON
        return str(error.body or "")[:300]


def _hint(status: int) -> str | None:
    return {
        401: "your credentials expired: gcloud container clusters get-credentials ...",
        403: "your account lacks RBAC permission for this; ask the cluster admin",
        404: "the object or its CRD does not exist (is KubeRay installed? right namespace?)",
        409: "it already exists: `a4ray down NAME` first, or pick another name (--name)",
        422: "the API server refused the manifest: see the message",
    }.get(status)


# --------------------------------------------------------------------------------------- status


def _condition(obj: dict, kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


def cluster_ready(obj: dict) -> bool:
    status = obj.get("status") or {}
    return status.get("state") == "ready" or (_condition(obj, "RayClusterProvisioned")
                                              and _condition(obj, "HeadPodReady"))


def pod_ready(pod: dict | None) -> bool:
    if not pod:
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def cluster_summary(obj: dict) -> str:
    status = obj.get("status") or {}
    ready = status.get("readyWorkerReplicas", 0)
    desired = status.get("desiredWorkerReplicas",
                         sum(g.get("replicas", 0) for g in obj["spec"].get("workerGroupSpecs", [])))
    state = status.get("state") or ("suspended" if obj["spec"].get("suspend") else "pending")
    head = "head ready" if _condition(obj, "HeadPodReady") else "head not ready"
    reason = f" ({status['reason']})" if status.get("reason") else ""
    return f"{state}{reason}; {head}; workers {ready}/{desired} ready"


def job_summary(obj: dict) -> str:
    status = obj.get("status") or {}
    parts = [status.get("jobDeploymentStatus") or ("Suspended" if obj["spec"].get("suspend") else "Pending")]
    if status.get("jobStatus"):
        parts.append(f"job {status['jobStatus']}")
    if status.get("rayClusterName"):
        parts.append(f"cluster {status['rayClusterName']}")
    if status.get("reason"):
        parts.append(f"reason {status['reason']}")
    if status.get("message"):
        parts.append(status["message"][:120])
    return "; ".join(parts)


# ------------------------------------------------------------------------------------ dashboard


class PortForward:
    """A local TCP port whose connections are piped to a stream `open_stream()` returns.

    For a pod: `open_stream` opens a Kubernetes port-forward websocket to the head's dashboard port; in
    tests, a plain socket to a local Ray dashboard. One stream per connection, as kubectl does.
    """

    def __init__(self, open_stream: Callable[[], Any], host: str = "127.0.0.1"):
        self._open = open_stream
        self._server = socket.create_server((host, 0))
        self.port = self._server.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="a4ray-port-forward", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                local, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(local,), daemon=True).start()

    def _serve(self, local: socket.socket) -> None:
        try:
            remote = self._open()
        except Exception:  # noqa: BLE001 - the client sees a closed connection and retries or fails
            local.close()
            return
        threading.Thread(target=_pump, args=(remote, local), daemon=True).start()
        _pump(local, remote)

    def close(self) -> None:
        self._closed.set()
        self._server.close()

    def __enter__(self) -> PortForward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pump(source: Any, sink: Any) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            try:
                end.close()
            except OSError:
                pass


def pod_stream(kube: Kube, pod: str, namespace: str, port: int) -> Callable[[], Any]:
    """Opens a Kubernetes port-forward to `pod`:`port` (one websocket per call)."""
    from kubernetes.stream import portforward

    def open_stream():
        forward = portforward(kube.core.connect_get_namespaced_pod_portforward, pod, namespace, ports=str(port))
        return forward.socket(port)

    return open_stream


def job_client(address: str, token: str | None):
    """Ray's JobSubmissionClient for `address`, sending the cluster's token as a bearer header."""
    from ray.job_submission import JobSubmissionClient

    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        return JobSubmissionClient(address, headers=headers)
    except (ConnectionError, RuntimeError) as e:
        raise KubeError(f"cannot reach the Ray dashboard at {address}: {e}",
                        hint="is the head pod Ready? `a4ray status`") from None


@contextmanager
def dashboard(kube: Kube, cluster: str, namespace: str) -> Iterator[tuple[Any, PortForward]]:
    """A JobSubmissionClient for RayCluster `cluster`, through a port-forward to its head pod."""
    obj = kube.get("RayCluster", cluster, namespace)
    if obj is None:
        raise KubeError(f"RayCluster {namespace}/{cluster} does not exist", hint="`a4ray status` lists clusters")
    pod = kube.head_pod(cluster, namespace)
    if not pod_ready(pod):
        raise KubeError(f"RayCluster {namespace}/{cluster}: the head pod is not Ready ({cluster_summary(obj)})",
                        hint="wait for it: `a4ray up` waits until it is")
    token = kube.auth_token(obj)
    with PortForward(pod_stream(kube, pod["metadata"]["name"], namespace, DASHBOARD_PORT)) as forward:
        yield job_client(forward.url, token), forward


def follow_logs(client: Any, job_id: str, out: Callable[[str], None]) -> str | None:
    """Print the job's logs as they come, until it ends; returns its final status, or None where Ctrl-C stopped the
    following (the job goes on, as after `ray job submit`'s Ctrl-C)."""
    import asyncio

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            out(chunk)

    try:
        asyncio.run(tail())
    except KeyboardInterrupt:
        return None
    return str(client.get_job_status(job_id).value)
