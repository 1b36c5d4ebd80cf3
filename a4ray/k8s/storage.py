"""Storage for Ray pods: the volumes, mounts, pod annotations and PV/PVC objects of `kuberay.storage`.

Objects a4ray creates are named after the release (the RayCluster or RayJob) and, for cluster-scoped
PersistentVolumes, its namespace too, so two releases never claim the same PV (the seeds hard-coded
`nfs-pv` / `lustre-pv` in `default`). Static PVs are `Retain`: deleting them never deletes data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from a4ray.spec.kuberay import FilestoreVolume, GcsVolume, LocalSsdVolume, LustreVolume

RELEASE_LABEL = "a4ray.io/release"
NAMESPACE_LABEL = "a4ray.io/namespace"
MANAGED_BY = {"app.kubernetes.io/managed-by": "a4ray"}


@dataclass
class PodStorage:
    """What one pod template gets from the storage list."""

    volumes: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)


def volume_name(vol) -> str:
    return f"storage-{vol.name}"


def pv_name(release: str, namespace: str, vol) -> str:
    return f"{namespace}-{release}-{vol.name}"


def pvc_name(release: str, vol) -> str:
    return f"{release}-{vol.name}"


def _needs_claim(vol) -> bool:
    return isinstance(vol, LustreVolume) or (isinstance(vol, FilestoreVolume) and vol.claim == "pvc")


def pod_storage(volumes: list, release: str, *, gpu_node: bool) -> PodStorage:
    """Volumes and mounts of a Ray pod. Local SSD exists only on the GPU nodes' pods."""
    out = PodStorage()
    for vol in volumes:
        if isinstance(vol, LocalSsdVolume) and not gpu_node:
            continue
        name = volume_name(vol)
        if _needs_claim(vol):
            source = {"persistentVolumeClaim": {"claimName": pvc_name(release, vol)}}
        elif isinstance(vol, FilestoreVolume):
            source = {"nfs": {"server": vol.server, "path": f"/{vol.share.strip('/')}", "readOnly": vol.read_only}}
        elif isinstance(vol, GcsVolume):
            attributes = {"bucketName": vol.bucket}
            if vol.mount_options:
                attributes["mountOptions"] = ",".join(vol.mount_options)
            source = {"csi": {"driver": "gcsfuse.csi.storage.gke.io", "readOnly": vol.read_only,
                              "volumeAttributes": attributes}}
            # The GCS FUSE sidecar is injected only into pods that ask for it; its limits are per pod.
            out.annotations.update({
                "gke-gcsfuse/volumes": "true",
                "gke-gcsfuse/cpu-limit": vol.sidecar_cpu,
                "gke-gcsfuse/memory-limit": vol.sidecar_memory,
                "gke-gcsfuse/ephemeral-storage-limit": vol.sidecar_ephemeral_storage,
            })
        else:  # local SSD
            source = {"hostPath": {"path": vol.host_path, "type": "Directory"}}
        out.volumes.append({"name": name, **source})
        mount = {"name": name, "mountPath": vol.mount_path}
        if vol.read_only:
            mount["readOnly"] = True
        out.mounts.append(mount)
    return out


def _labels(release: str, namespace: str) -> dict[str, str]:
    return {**MANAGED_BY, RELEASE_LABEL: release, NAMESPACE_LABEL: namespace}


def storage_objects(volumes: list, release: str, namespace: str) -> list[dict]:
    """The static PersistentVolume + PersistentVolumeClaim pair of every claimed volume, PVs first."""
    pvs, pvcs = [], []
    for vol in volumes:
        if not _needs_claim(vol):
            continue
        access = "ReadOnlyMany" if vol.read_only else "ReadWriteMany"
        if isinstance(vol, LustreVolume):
            source = {"csi": {"driver": "lustre.csi.storage.gke.io",
                              "volumeHandle": f"{vol.project}/{vol.location}/{vol.instance}",
                              "volumeAttributes": {"ip": vol.ip, "filesystem": vol.filesystem}}}
            options: list[str] = []
        else:
            source = {"nfs": {"server": vol.server, "path": f"/{vol.share.strip('/')}"}}
            options = list(vol.mount_options)
        pv_spec = {
            "capacity": {"storage": vol.capacity},
            "accessModes": [access],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            # Bound to this release's claim only, so no other claim in the cluster can take it.
            "claimRef": {"namespace": namespace, "name": pvc_name(release, vol)},
            **source,
        }
        if options:
            pv_spec["mountOptions"] = options
        pvs.append({"apiVersion": "v1", "kind": "PersistentVolume",
                    "metadata": {"name": pv_name(release, namespace, vol), "labels": _labels(release, namespace)},
                    "spec": pv_spec})
        pvcs.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                     "metadata": {"name": pvc_name(release, vol), "namespace": namespace,
                                  "labels": _labels(release, namespace)},
                     "spec": {"accessModes": [access], "storageClassName": "",
                              "volumeName": pv_name(release, namespace, vol),
                              "resources": {"requests": {"storage": vol.capacity}}}})
    return pvs + pvcs


def covers(volumes: list, path: str) -> bool:
    """Whether `path` lies on one of the shared (non-local) volumes."""
    return any(not isinstance(v, LocalSsdVolume) and (path == v.mount_path or path.startswith(v.mount_path + "/")
                                                      or v.mount_path == "/") for v in volumes)
