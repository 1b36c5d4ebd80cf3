"""Render a job spec as KubeRay objects (ray.io/v1 RayCluster or RayJob, plus its storage PV/PVCs) for GKE A4.

Manifests are built as plain dicts from the spec, checked against what GKE, KubeRay and Kueue accept
before anything is printed or applied, and validated against the KubeRay CRD schema in strict mode.

The shape of an A4 worker, and why:
  - one Ray worker pod per node, taking all 8 GPUs; required anti-affinity keeps a second Ray worker
    off the node (with hostNetwork two Ray pods on a node would fight over Ray's fixed ports);
  - RDMA: hostNetwork (+ ClusterFirstWithHostNet DNS, privileged) by default, or GKE multi-network
    annotations attaching gvnic-1 and rdma-0..7;
  - the gIB plugin at /usr/local/gib (copied by an init container from the pinned installer image, or
    the node's hostPath), GKE's NVIDIA libraries at /usr/local/nvidia, a memory-backed /dev/shm;
  - the container runs the a4ray pod launcher (launchers/ray-node.sh), which sources the gIB env, puts
    gIB's lib64 first on LD_LIBRARY_PATH (a pod-spec value would replace the image's instead of
    prepending), reads the node's physical topology and starts Ray with KubeRay's generated command
    plus topology labels. The annotation `ray.io/overwrite-container-cmd` tells KubeRay to run the
    launcher as is; KubeRay still hands it the generated `ray start` command in KUBERAY_GEN_RAY_START_CMD.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

import yaml

from a4ray.core.errors import SpecError
from a4ray.core.redact import has_url_credentials, is_secret_value, redact_urls, secret_in_spec
from a4ray.k8s import storage as st
from a4ray.k8s.validate import (
    GROUP,
    KUEUE_QUEUE_LABEL,
    MAX_RAYCLUSTER_NAME,
    MAX_RAYJOB_NAME,
    VERSION,
    check_manifest,
)
from a4ray.observe import grafana
from a4ray.runtime.rayenv import HEAD_ENV, RAY_ENV
from a4ray.spec.job import JobSpec

# GKE machine types a4ray renders for: the accelerator label of their node pools, and GPUs per node.
MACHINES = {"a4-highgpu-8g": ("nvidia-b200", 8)}
ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
OVERWRITE_CMD = "ray.io/overwrite-container-cmd"
AUTH_TOKEN_KEY = "auth_token"  # the key KubeRay (and a4ray) keep a Ray token under in its Secret
RAY_CONTAINER = {"head": "ray-head", "worker": "ray-worker"}
HEAD_PORTS = [("gcs-server", 6379), ("dashboard", 8265), ("client", 10001)]
DASHBOARD_PORT = 8265
GRAFANA_NAMESPACE = "prometheus-system"  # where KubeRay's Prometheus/Grafana guide installs the stack
GRAFANA_JSON = "a4ray_grafana_dashboard.json"
GIB_MOUNT = "/usr/local/gib"
NVIDIA_MOUNT = "/usr/local/nvidia"
GPU_TOLERATIONS = [
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "cloud.google.com/impending-node-termination", "operator": "Exists"},
    {"key": "user-workload", "operator": "Exists", "effect": "NoSchedule"},  # Cluster Toolkit A4 pools
]
@dataclass(frozen=True)
class OperatorCaps:
    """What the KubeRay installed on the target cluster supports (default: the bundled v1.7.0 CRDs)."""

    auth_options: bool = True  # RayCluster.spec.authOptions, KubeRay >= 1.5.1
    cluster_schema: dict | None = field(default=None, compare=False)  # installed CRDs' v1 schemas
    job_schema: dict | None = field(default=None, compare=False)


BUNDLED = OperatorCaps()


@dataclass
class Rendered:
    objects: list[dict]
    warnings: list[str] = field(default_factory=list)

    @property
    def main(self) -> dict:
        """The RayCluster or RayJob."""
        return next(o for o in self.objects if o["apiVersion"] == f"{GROUP}/{VERSION}")

    def to_yaml(self) -> str:
        return to_yaml(self.objects)


class _Dumper(yaml.SafeDumper):
    """Manifests as people write them: no anchors/aliases for shared values, scripts as `|` blocks."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def to_yaml(objects: list[dict]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


@dataclass
class _Auth:
    via: str | None  # None: disabled
    secret: str = ""


# ------------------------------------------------------------------------------------ spec checks


def _resolve_auth(spec: JobSpec, name: str, caps: OperatorCaps, problems: list[str]) -> _Auth:
    auth = spec.kuberay.auth
    if auth.mode == "disabled":
        return _Auth(None)
    via = auth.via
    if via == "auto":
        via = "operator" if caps.auth_options else "env"
    if via == "operator" and not caps.auth_options:
        problems.append("kuberay.auth.via: operator, but the installed KubeRay has no RayCluster authOptions "
                        "(KubeRay >= 1.5.1); use auto or env")
    return _Auth(via, auth.secret or (f"{name}-ray-token" if via == "env" else ""))


def _spec_problems(spec: JobSpec, name: str, *, job: bool, cluster: str | None, entrypoint: list[str]) -> list[str]:
    k, c = spec.kuberay, spec.cluster
    problems = []
    if not k.image:
        problems.append("kuberay.image: required: the image built from docker/ (docker/README.md), "
                        "e.g. --set kuberay.image=us-docker.pkg.dev/PROJECT/REPO/a4ray:25.12-ray2.60.0")
    machine = MACHINES.get(c.machine_type)
    if machine is None:
        problems.append(f"cluster.machine_type: KubeRay rendering knows {', '.join(MACHINES)}, "
                        f"got {c.machine_type!r}")
    elif c.gpus_per_node != machine[1]:
        problems.append(f"cluster.gpus_per_node: an {c.machine_type} node has {machine[1]} GPUs and a Ray worker "
                        f"takes the whole node; got {c.gpus_per_node} (fewer GPUs are for local rehearsals)")
    limit, what = (MAX_RAYJOB_NAME, "RayJob") if job else (MAX_RAYCLUSTER_NAME, "RayCluster")
    if len(name) > limit:
        problems.append(f"name: {name!r} is {len(name)} characters; a KubeRay {what} name has at most {limit}")
    if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", name):
        problems.append(f"name: {name!r} is not a DNS-1035 label (lowercase letters, digits and '-', starting "
                        "with a letter), as KubeRay requires")
    # A secret in the spec's env is refused when the spec loads (the one policy: core.redact.secret_in_spec); the
    # command line is the RayJob's own text, so the same rule is applied to it here.
    for arg in entrypoint:
        key, eq, value = arg.partition("=")
        if eq and is_secret_value(key.rsplit(".", 1)[-1], value):
            problems.append(secret_in_spec(f"entrypoint: {key}=..."))
        elif has_url_credentials(arg):
            problems.append(f"entrypoint: {redact_urls(arg)} puts a URL's credentials in the RayJob; give the "
                            "nodes the credential instead (kuberay.secrets, staging.token_file)")
    if k.kueue.queue and cluster:
        problems.append("kuberay.kueue.queue: Kueue cannot admit a RayJob that runs on an existing cluster "
                        f"(--cluster {cluster}); drop --cluster or unset the queue")
    if cluster:
        if k.job.submission_mode == "SidecarMode":
            problems.append("kuberay.job.submission_mode: SidecarMode needs its own cluster; not with --cluster")
        if k.job.backoff_limit:
            problems.append("kuberay.job.backoff_limit: retries create new clusters; not with --cluster")
    return problems


def _raise(spec: JobSpec, problems: list[str]) -> None:
    if problems:
        raise SpecError(spec.source, problems, hint="fix the spec or override with --set a.b=value")


# ---------------------------------------------------------------------------------------- pieces


def _env(items: dict[str, str]) -> list[dict]:
    return [{"name": k, "value": v} for k, v in items.items()]


def _secret_env(name: str, secret: str, key: str, optional: bool = False) -> dict:
    ref = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def _auth_env(auth: _Auth) -> list[dict]:
    """With auth via env, every Ray container (and the submitter) authenticates with the Secret's token."""
    if auth.via != "env":
        return []
    return [{"name": "RAY_AUTH_MODE", "value": "token"}, _secret_env("RAY_AUTH_TOKEN", auth.secret, AUTH_TOKEN_KEY)]


def _container_env(spec: JobSpec, auth: _Auth) -> list[dict]:
    net = spec.network
    launcher = {
        "A4RAY_GIB": net.gib,
        "A4RAY_GIB_SCRIPT": net.gib_script,
        # The Ray node label keys the gang orders ranks by; the launcher sets them from the node's topology.
        "A4RAY_TOPOLOGY_KEYS": ",".join(spec.cluster.topology.label_keys),
    }
    secrets = [_secret_env(s.env, s.secret, s.key, s.optional) for s in spec.kuberay.secrets]
    return _env(launcher) + _env(RAY_ENV) + secrets + _auth_env(auth)


def _topology_key(spec: JobSpec) -> str:
    level = spec.kuberay.kueue.level
    if level == "hostname":
        return "kubernetes.io/hostname"
    topo = spec.cluster.topology
    return {"block": topo.block_label, "subblock": topo.subblock_label, "host": topo.host_label}[level]


def _interfaces_annotation(networks: list[str]) -> str:
    import json

    return json.dumps([{"interfaceName": f"eth{i}", "network": n} for i, n in enumerate(networks)])


def _gib_volumes(spec: JobSpec) -> tuple[list[dict], list[dict]]:
    """(volumes, init containers) that put gIB at /usr/local/gib and GKE's NVIDIA libs at /usr/local/nvidia."""
    gib = spec.kuberay.gib
    volumes = [{"name": "nvidia", "hostPath": {"path": gib.nvidia_host_path, "type": "Directory"}}]
    if gib.source == "hostpath":
        return [{"name": "gib", "hostPath": {"path": gib.host_path, "type": "Directory"}}] + volumes, []
    installer = {
        "name": "gib-installer",
        "image": gib.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["/bin/sh", "-c"],
        "args": ["set -ex\n/scripts/container_entry.sh install --install-nccl\n"
                 "cp -R /var/lib/gib/. /target/usr/local/gib\n"],
        "volumeMounts": [{"name": "gib", "mountPath": "/target/usr/local/gib"}],
    }
    return [{"name": "gib", "emptyDir": {}}] + volumes, [installer]


def _monitoring_env(spec: JobSpec) -> dict[str, str]:
    """The head's dashboard charts from Prometheus and embeds Grafana's panels (Ray reads these at its start)."""
    m = spec.kuberay.monitoring
    if not m.enabled:
        return {}
    return {"RAY_PROMETHEUS_HOST": m.prometheus_host, "RAY_GRAFANA_HOST": m.grafana_host,
            "RAY_GRAFANA_IFRAME_HOST": m.grafana_iframe_host}


def grafana_dashboard_configmap(namespace: str = GRAFANA_NAMESPACE) -> dict:
    """a4ray's Grafana dashboard as a ConfigMap that Grafana's dashboard sidecar loads (the label
    `grafana_dashboard: "1"`, in the monitoring namespace), as KubeRay's install/prometheus/install.sh loads
    Ray's own dashboards."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "a4ray-grafana-dashboard", "namespace": namespace,
                         "labels": {"grafana_dashboard": "1"}},
            "data": {GRAFANA_JSON: grafana.dashboard_json()}}


def _head_group(spec: JobSpec, name: str, env: list[dict]) -> dict:
    k = spec.kuberay
    pod_storage = st.pod_storage(k.storage, name, gpu_node=False)
    container = {
        "name": RAY_CONTAINER["head"],
        "image": k.image,
        "imagePullPolicy": k.image_pull_policy,
        "command": ["/bin/bash", k.launcher],
        "ports": [{"name": n, "containerPort": p} for n, p in HEAD_PORTS],
        "resources": {"requests": {"cpu": k.head.cpu, "memory": k.head.memory},
                      "limits": {"cpu": k.head.cpu, "memory": k.head.memory}},
        "env": env + _env(HEAD_ENV) + _env(_monitoring_env(spec)),
    }
    if pod_storage.mounts:
        container["volumeMounts"] = pod_storage.mounts
    pod_spec: dict = {"containers": [container]}
    if k.head.node_selector:
        pod_spec["nodeSelector"] = dict(k.head.node_selector)
    if k.service_account:
        pod_spec["serviceAccountName"] = k.service_account
    if pod_storage.volumes:
        pod_spec["volumes"] = pod_storage.volumes
    return {
        # Inside the cluster only: `a4ray submit/logs` reach the dashboard through a port-forward.
        "serviceType": "ClusterIP",
        # No Ray work on the head (it has no GPUs and hosts GCS and the drivers); dashboard on all interfaces.
        "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
        "template": {
            "metadata": {"labels": {st.RELEASE_LABEL: name},
                         "annotations": {OVERWRITE_CMD: "true", **pod_storage.annotations}},
            "spec": pod_spec,
        },
    }


def _worker_group(spec: JobSpec, name: str, env: list[dict]) -> dict:
    k, c = spec.kuberay, spec.cluster
    accelerator, _ = MACHINES[c.machine_type]
    pod_storage = st.pod_storage(k.storage, name, gpu_node=True)
    gib_volumes, init_containers = _gib_volumes(spec)
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": k.worker.shm_size}}
    resources = {"cpu": k.worker.cpu, "memory": k.worker.memory, "nvidia.com/gpu": c.gpus_per_node}
    if k.worker.ephemeral_storage:
        resources["ephemeral-storage"] = k.worker.ephemeral_storage
    container: dict = {
        "name": RAY_CONTAINER["worker"],
        "image": k.image,
        "imagePullPolicy": k.image_pull_policy,
        "command": ["/bin/bash", k.launcher],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "env": env,
        "volumeMounts": [{"name": "gib", "mountPath": GIB_MOUNT}, {"name": "nvidia", "mountPath": NVIDIA_MOUNT},
                         {"name": "dshm", "mountPath": "/dev/shm"}, *pod_storage.mounts],
        # A pod's deletion (GKE maintenance, preemption): the ranks save first, then Ray gets its SIGTERM.
        "lifecycle": {"preStop": {"exec": {"command": [
            "python", "-m", "a4ray.runtime.notice", "--grace-s", f"{c.notice_grace_s:g}"]}}},
    }
    annotations = {OVERWRITE_CMD: "true", **pod_storage.annotations}
    # The preStop hook's wait, and Ray's own stop after it.
    pod_spec: dict = {"terminationGracePeriodSeconds": int(c.notice_grace_s) + 30}
    if k.rdma.mode == "hostnetwork":
        pod_spec.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
        # RDMA verbs on the host's NICs (memory registration, device files) need a privileged container.
        container["securityContext"] = {"privileged": True}
    else:
        annotations["networking.gke.io/default-interface"] = "eth0"
        annotations["networking.gke.io/interfaces"] = _interfaces_annotation(k.rdma.networks)
    if k.kueue.queue and k.kueue.topology != "none":
        annotations[f"kueue.x-k8s.io/podset-{k.kueue.topology}-topology"] = _topology_key(spec)
    pod_spec.update(
        nodeSelector={ACCELERATOR_LABEL: accelerator, **k.worker.node_selector},
        tolerations=[*GPU_TOLERATIONS, *k.worker.tolerations],
        affinity={"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {"ray.io/node-type": "worker"}},
            "topologyKey": "kubernetes.io/hostname",
        }]}},
    )
    if k.service_account:
        pod_spec["serviceAccountName"] = k.service_account
    if init_containers:
        pod_spec["initContainers"] = init_containers
    pod_spec["containers"] = [container]
    pod_spec["volumes"] = [*gib_volumes, shm, *pod_storage.volumes]
    return {
        "groupName": k.worker.group,
        "replicas": c.placed_nodes,  # the gang's nodes and its spares
        "minReplicas": c.placed_nodes,
        "maxReplicas": c.placed_nodes,
        "rayStartParams": {},
        # One `<machine type>` Ray resource per node: the gang's placement group asks for exactly this.
        "resources": {c.node_resource: "1"},
        "template": {
            "metadata": {"labels": {st.RELEASE_LABEL: name}, "annotations": annotations},
            "spec": pod_spec,
        },
    }


def _cluster_spec(spec: JobSpec, name: str, auth: _Auth) -> dict:
    env = _container_env(spec, auth)
    cluster: dict = {
        "rayVersion": spec.kuberay.ray_version,
        # A gang of whole nodes is fixed-size; Kueue also requires autoscaling off.
        "enableInTreeAutoscaling": False,
    }
    if auth.via == "operator":
        cluster["authOptions"] = {"mode": "token", **({"secretName": auth.secret} if auth.secret else {})}
    cluster["headGroupSpec"] = _head_group(spec, name, env)
    cluster["workerGroupSpecs"] = [_worker_group(spec, name, env)]
    return cluster


def _metadata(spec: JobSpec, name: str) -> dict:
    labels = {**st.MANAGED_BY, st.RELEASE_LABEL: name}
    if spec.kuberay.kueue.queue:
        labels[KUEUE_QUEUE_LABEL] = spec.kuberay.kueue.queue
        if spec.kuberay.kueue.priority_class:
            labels[KUEUE_PRIORITY_LABEL] = spec.kuberay.kueue.priority_class
    return {"name": name, "namespace": spec.kuberay.namespace, "labels": labels}


def _warnings(spec: JobSpec) -> list[str]:
    if st.covers(spec.kuberay.storage, spec.storage.workspace):
        return []
    return [f"storage.workspace={spec.storage.workspace} is on no shared volume of kuberay.storage: each pod "
            "writes its run directory (logs, results) to its own disk; add a Filestore, Lustre or GCS volume there"]


# ------------------------------------------------------------------------------------------ public


def release_name(spec: JobSpec, name: str | None = None) -> str:
    return name or spec.name


def render_cluster(spec: JobSpec, *, name: str | None = None, caps: OperatorCaps = BUNDLED) -> Rendered:
    """The RayCluster (and its storage objects) of `spec`."""
    name = release_name(spec, name)
    problems = _spec_problems(spec, name, job=False, cluster=None, entrypoint=[])
    auth = _resolve_auth(spec, name, caps, problems)
    _raise(spec, problems)
    raycluster = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RayCluster", "metadata": _metadata(spec, name),
                  "spec": _cluster_spec(spec, name, auth)}
    check_manifest(raycluster, caps.cluster_schema, source=spec.source)
    objects = st.storage_objects(spec.kuberay.storage, name, spec.kuberay.namespace) + [raycluster]
    return Rendered(objects, _warnings(spec))


def default_entrypoint(spec: JobSpec, config: str | None, sets: list[str]) -> list[str]:
    """`python -m a4ray.<kind> --config FILE --set ...`: the job as rendered, run by the RayJob's driver."""
    if spec.kind == "cluster":
        raise SpecError(spec.source, ["kind: a cluster spec has no workload; give the command after `--`, "
                                      "e.g. -- python -m a4ray.ddp_test --config jobs/ddp_test.yaml"])
    argv = ["python", "-m", spec.entry_module or f"a4ray.{spec.kind}"]
    if config:
        argv += ["--config", config]
    for item in sets:
        if not item.startswith("kuberay."):  # how the cluster is built is no concern of the job's driver
            argv += ["--set", item]
    return argv


def job_name(spec: JobSpec, entrypoint: list[str], name: str | None = None) -> str:
    """--name, else the spec's name, else (for a cluster spec) the a4ray module the entrypoint runs."""
    if name:
        return name
    if spec.kind == "cluster" and "-m" in entrypoint[:-1]:
        module = entrypoint[entrypoint.index("-m") + 1]
        if module.startswith("a4ray."):
            return module.removeprefix("a4ray.").replace("_", "-").replace(".", "-")
    return spec.name


def render_job(spec: JobSpec, entrypoint: list[str], *, name: str | None = None, cluster: str | None = None,
               caps: OperatorCaps = BUNDLED) -> Rendered:
    """A RayJob running `entrypoint`: on its own cluster (deleted when the job ends), or on RayCluster `cluster`."""
    name = job_name(spec, entrypoint, name)
    k = spec.kuberay
    problems = _spec_problems(spec, name, job=True, cluster=cluster, entrypoint=entrypoint)
    auth = _resolve_auth(spec, cluster or name, caps, problems)
    if auth.via == "env":
        problems.append("kuberay.auth.via: env cannot protect a RayJob: the KubeRay operator polls the job through "
                        "the dashboard without the token; upgrade KubeRay (>= 1.5.1, authOptions), or use "
                        "`a4ray up` + `a4ray submit --cluster`")
    _raise(spec, problems)
    job_spec: dict = {"entrypoint": shlex.join(entrypoint), "submissionMode": k.job.submission_mode}
    if cluster:
        job_spec["clusterSelector"] = {"ray.io/cluster": cluster}
    else:
        job_spec["shutdownAfterJobFinishes"] = True
        job_spec["ttlSecondsAfterFinished"] = k.job.ttl_s
        if k.kueue.queue:
            job_spec["suspend"] = True  # Kueue admits (unsuspends) the whole gang at once
        if k.job.backoff_limit:
            job_spec["backoffLimit"] = k.job.backoff_limit
    if k.job.active_deadline_s:
        job_spec["activeDeadlineSeconds"] = k.job.active_deadline_s
    if k.job.pre_running_deadline_s:
        job_spec["preRunningDeadlineSeconds"] = k.job.pre_running_deadline_s
    if not cluster:
        job_spec["rayClusterSpec"] = _cluster_spec(spec, name, auth)
    rayjob = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RayJob", "metadata": _metadata(spec, name),
              "spec": job_spec}
    check_manifest(rayjob, caps.job_schema, source=spec.source)
    objects = [] if cluster else st.storage_objects(k.storage, name, k.namespace)
    return Rendered(objects + [rayjob], [] if cluster else _warnings(spec))
