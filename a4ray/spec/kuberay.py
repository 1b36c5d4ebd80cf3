"""The `kuberay:` section every job spec carries: how a4ray renders it as a KubeRay RayCluster / RayJob on GKE.

The defaults give a sensible A4 cluster: one 8-GPU Ray worker pod per node on hostNetwork, the gIB plugin
from its pinned installer image, a 250Gi memory-backed /dev/shm, Ray token authentication, the dashboard
reachable only inside the cluster. Everything here is a name or a reference: secrets are Kubernetes
Secret references, never values.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator

from a4ray.spec.fields import MAX_SECONDS, Integer, PathStr, Spec

# Kubernetes resource quantity (e.g. 250Gi, 500m, 200).
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
_DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


def _quantity(value: str) -> str:
    if not _QUANTITY.match(value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 250Gi, 500m, 8)")
    return value


def _absolute(path: str) -> str:
    if not path.startswith("/"):
        raise ValueError("must be an absolute path")
    return path.rstrip("/") or "/"


def _pinned_image(image: str) -> str:
    """An image reference that names a version: a digest, or a tag other than `latest`."""
    if "@sha256:" in image:
        return image
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag or tag in ("", "latest"):
        raise ValueError(f"{image!r} is not pinned: give a version tag (not latest) or a digest")
    return image


Quantity = Annotated[str, AfterValidator(_quantity)]
AbsPath = Annotated[PathStr, AfterValidator(_absolute)]
PinnedImage = Annotated[str, AfterValidator(_pinned_image)]
DnsLabel = Annotated[str, Field(pattern=_DNS_LABEL, max_length=63)]


class GibSpec(Spec):
    """Where the gIB NCCL plugin comes from; it is mounted at /usr/local/gib either way."""

    source: Literal["initcontainer", "hostpath"] = Field(
        "initcontainer", description="initcontainer: copy it from `image` into the pod (pins the version per "
        "job); hostpath: the node's copy installed by GKE's nccl-rdma-installer DaemonSet")
    image: PinnedImage = Field("us-docker.pkg.dev/gce-ai-infra/gpudirect-gib/nccl-plugin-gib:v1.1.1",
                               description="initcontainer: the pinned image the plugin is copied from")
    host_path: AbsPath = Field("/home/kubernetes/bin/gib", description="hostpath: where the node keeps the plugin")
    nvidia_host_path: AbsPath = Field("/home/kubernetes/bin/nvidia", description="GKE's NVIDIA driver libraries")


def _default_networks() -> list[str]:
    return ["default", "gvnic-1", *(f"rdma-{i}" for i in range(8))]


class RdmaSpec(Spec):
    """How a worker pod reaches the node's 8 RDMA NICs."""

    mode: Literal["hostnetwork", "multinetwork"] = Field(
        "hostnetwork", description="hostnetwork: the pod shares the node's network (privileged); multinetwork: "
        "GKE multi-network annotations attach the NICs to the pod's own namespace")
    networks: list[DnsLabel] = Field(
        default_factory=_default_networks,
        description="multinetwork: GKE Network objects attached as eth0, eth1, ... in this order")


class HeadSpec(Spec):
    """The Ray head: a CPU pod (no GPUs, no Ray work) hosting GCS, the dashboard and the job drivers."""

    cpu: Quantity = Field("8", description="the head pod's CPU (request and limit)")
    memory: Quantity = Field("32Gi", description="the head pod's memory (request and limit)")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="e.g. {cloud.google.com/gke-nodepool: default-pool}; GPU nodes are "
        "tainted, so the head lands on a CPU pool without it")


class WorkerSpec(Spec):
    """The A4 worker group: one Ray worker pod per node, taking the whole machine."""

    group: DnsLabel = Field("a4", description="the worker group's name (groupName)")
    cpu: Quantity = Field("200", description="a4-highgpu-8g has 224 vCPUs; leave room for system pods")
    memory: Quantity = Field("1800Gi", description="includes the memory-backed /dev/shm")
    ephemeral_storage: Quantity | None = None
    shm_size: Quantity = Field("250Gi", description="size of the memory-backed /dev/shm")
    node_selector: dict[str, str] = Field(default_factory=dict, description="added to the accelerator selector")
    tolerations: list[dict] = Field(default_factory=list, description="added to the GPU-pool tolerations")


class KueueSpec(Spec):
    """Kueue admission: the whole gang is admitted at once, placed by physical topology."""

    queue: str = Field("", pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$",
                       description="LocalQueue name; empty: Kueue is not used")
    priority_class: str = Field("", description="WorkloadPriorityClass name (optional)")
    topology: Literal["preferred", "required", "none"] = Field(
        "preferred", description="preferred or required: the gang's pods should or must share one `level` domain "
        "(Kueue's podset topology request); none: no request")
    level: Literal["block", "subblock", "host", "hostname"] = Field(
        "block", description="the topology domain the gang's pods should (preferred) or must (required) share")


class SecretEnv(Spec):
    """An environment variable taken from a Kubernetes Secret (`secretKeyRef`): the value never leaves it."""

    env: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="the variable's name in the Ray containers")
    secret: str = Field(pattern=_DNS_SUBDOMAIN, max_length=253, description="the Secret's name")
    key: str = Field(pattern=r"^[-._a-zA-Z0-9]+$", description="the key of the value in the Secret")
    optional: bool = Field(False, description="start the pod without the variable if the Secret is missing")


def _default_secrets() -> list[SecretEnv]:
    return [SecretEnv(env="HF_TOKEN", secret="hf-token", key="token", optional=True)]


class AuthSpec(Spec):
    """Ray token authentication (Ray >= 2.52) of the dashboard, job API and GCS."""

    mode: Literal["token", "disabled"] = Field("token", description="token: every request needs the Ray token; "
                                               "disabled: none does")
    via: Literal["auto", "operator", "env"] = Field(
        "auto", description="operator: KubeRay's authOptions (KubeRay >= 1.5.1); env: RAY_AUTH_MODE and the "
        "token from `secret` on every Ray container; auto: operator where the installed KubeRay has it")
    secret: str = Field("", pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$", description=(
        "Secret holding the token under key `auth_token`; empty: the operator's own (operator) or "
        "`<name>-ray-token`, created by `a4ray up` (env)"))


class RayJobOptions(Spec):
    """RayJob-only settings (`a4ray render job`, `a4ray submit`)."""

    submission_mode: Literal["K8sJobMode", "HTTPMode", "SidecarMode"] = Field(
        "K8sJobMode", description="KubeRay's submissionMode: how the job's driver is started")
    ttl_s: Integer = Field(600, ge=0, le=MAX_SECONDS, description="keep the finished cluster this long (logs) before deleting it")
    active_deadline_s: Integer | None = Field(None, gt=0, le=MAX_SECONDS, description="fail the RayJob after this long")
    pre_running_deadline_s: Integer | None = Field(
        None, gt=0, le=MAX_SECONDS, description="fail the RayJob if it is not running after this long (e.g. nodes never came)")
    backoff_limit: Integer = Field(0, ge=0, le=1000, description="retries of the whole RayJob, each on a new cluster")


class MonitoringSpec(Spec):
    """Where the Ray dashboard's Metrics page finds Prometheus and Grafana (the head's RAY_PROMETHEUS_HOST,
    RAY_GRAFANA_HOST, RAY_GRAFANA_IFRAME_HOST). Defaults: the kube-prometheus-stack as KubeRay's Prometheus and
    Grafana guide installs it (release `prometheus` in namespace `prometheus-system`), Grafana port-forwarded to
    127.0.0.1:3000 for the browser. kuberay/a4ray-grafana-dashboard.yaml adds a4ray's charts to that Grafana."""

    prometheus_host: str = "http://prometheus-kube-prometheus-prometheus.prometheus-system.svc:9090"
    grafana_host: str = Field("http://prometheus-grafana.prometheus-system.svc:80",
                              description="what the head reaches Grafana at")
    grafana_iframe_host: str = Field("http://127.0.0.1:3000", description="what the browser reaches Grafana at")
    enabled: bool = Field(True, description="false: no metrics settings on the head (the Metrics page stays empty)")


class KubeRaySpec(Spec):
    namespace: DnsLabel = Field("default", description="the Kubernetes namespace of every object")
    image: str = Field("", description="the image built from docker/ (Ray, a4ray, launchers inside)")
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field(
        "IfNotPresent", description="the Ray containers' imagePullPolicy")
    ray_version: str = Field("2.60.0", pattern=r"^\d+\.\d+\.\d+$", description="the Ray version in the image")
    launcher: AbsPath = Field("/opt/a4ray/launchers/ray-node.sh", description="pod entry script in the image")
    service_account: str = Field("", description="Kubernetes service account (Workload Identity for GCS)")
    head: HeadSpec = HeadSpec()
    worker: WorkerSpec = WorkerSpec()
    rdma: RdmaSpec = RdmaSpec()
    gib: GibSpec = GibSpec()
    storage: list[StorageVolume] = Field(default_factory=list, description="volumes every Ray pod mounts")
    kueue: KueueSpec = KueueSpec()
    secrets: list[SecretEnv] = Field(default_factory=_default_secrets)
    auth: AuthSpec = AuthSpec()
    job: RayJobOptions = RayJobOptions()
    monitoring: MonitoringSpec = MonitoringSpec()

    @field_validator("image")
    @classmethod
    def _image_pinned(cls, image: str) -> str:
        return _pinned_image(image) if image else image


# ----------------------------------------------------------------------------------------- storage


class _Volume(Spec):
    name: str = Field(pattern=_DNS_LABEL, max_length=24, description="short name; objects are named after it")
    mount_path: AbsPath = Field(description="where every Ray pod mounts it")
    read_only: bool = Field(False, description="mount it read-only")


class FilestoreVolume(_Volume):
    """A Filestore (NFS) share: a static PV/PVC pair (default), or an inline `nfs:` volume."""

    type: Literal["filestore"] = "filestore"
    server: str = Field(description="the Filestore instance IP")
    share: str = Field(pattern=r"^[A-Za-z0-9_./-]+$", description="file share name, e.g. vol1")
    capacity: Quantity = "1Ti"
    claim: Literal["pvc", "inline"] = "pvc"
    mount_options: list[str] = Field(
        default_factory=lambda: ["nfsvers=4.1", "rsize=1048576", "wsize=1048576", "hard", "timeo=600",
                                 "retrans=2", "noresvport"],
        description="PV mount options (pvc only)")


class LustreVolume(_Volume):
    """A Google Cloud Managed Lustre instance through its CSI driver (static PV/PVC)."""

    type: Literal["lustre"] = "lustre"
    project: str
    location: str = Field(description="zone of the instance")
    instance: str
    ip: str = Field(description="the instance's mount point IP")
    filesystem: str = "lustrefs"
    capacity: Quantity = "9000Gi"


class GcsVolume(_Volume):
    """A GCS bucket through the GCS FUSE CSI driver (the pod needs Workload Identity access to it)."""

    type: Literal["gcs"] = "gcs"
    bucket: str = Field(pattern=r"^[a-z0-9][-a-z0-9_.]{1,220}[a-z0-9]$")
    mount_options: list[str] = Field(default_factory=lambda: ["implicit-dirs"])
    sidecar_cpu: Quantity = Field("0", description="gcsfuse sidecar limit; 0: unlimited")
    sidecar_memory: Quantity = "0"
    sidecar_ephemeral_storage: Quantity = "0"


class LocalSsdVolume(_Volume):
    """The node's local SSD (GKE ephemeral storage on local SSD), on the GPU workers only."""

    type: Literal["local_ssd"] = "local_ssd"
    mount_path: AbsPath = "/ssd"
    host_path: AbsPath = "/mnt/stateful_partition/kube-ephemeral-ssd"


StorageVolume = Annotated[FilestoreVolume | LustreVolume | GcsVolume | LocalSsdVolume, Field(discriminator="type")]
KubeRaySpec.model_rebuild()

