"""Where a job runs: the cluster (nodes, GPUs, machine type, topology), network (gIB) and storage."""

from __future__ import annotations

import getpass
import os
import re
from pathlib import PurePosixPath
from typing import Literal

from pydantic import Field, field_validator

from a4ray.spec.fields import (
    MAX_CPUS_PER_NODE,
    MAX_GPUS_PER_NODE,
    MAX_NODES,
    EnvVars,
    Integer,
    Number,
    PathStr,
    Seconds,
    Spec,
    on_nodes,
    workspace_problem,
)

# GKE's node labels for the physical topology of A4 nodes (block > subblock > host). The pod launcher
# copies the node's GCE `physical_host` into Ray node labels under these same keys.
GKE_BLOCK_LABEL = "cloud.google.com/gce-topology-block"
GKE_SUBBLOCK_LABEL = "cloud.google.com/gce-topology-subblock"
GKE_HOST_LABEL = "cloud.google.com/gce-topology-host"


class TopologySpec(Spec):
    """How node ranks are ordered: by physical topology labels (falling back to IP), or by IP only."""

    order: Literal["physical", "ip"] = Field(
        "physical", description="physical: by block, subblock and host (the labels below), nodes without them by IP; "
        "ip: by IP only")
    block_label: str = Field(GKE_BLOCK_LABEL, description="the Ray node label naming a node's block")
    subblock_label: str = Field(GKE_SUBBLOCK_LABEL, description="the Ray node label naming a node's subblock")
    host_label: str = Field(GKE_HOST_LABEL, description="the Ray node label naming a node's physical host")

    @property
    def label_keys(self) -> tuple[str, str, str]:
        return (self.block_label, self.subblock_label, self.host_label)


class ClusterSpec(Spec):
    """The gang: `nodes` whole machines of `machine_type`, each with `gpus_per_node` GPUs."""

    nodes: Integer = Field(2, gt=0, le=MAX_NODES, description="whole machines that run the job (spares apart)")
    gpus_per_node: Integer = Field(8, gt=0, le=MAX_GPUS_PER_NODE, description="GPUs of each node: one rank each")
    machine_type: str = Field("a4-highgpu-8g", pattern=r"^[a-z0-9][a-z0-9-]*$", max_length=63, description="the "
                              "GCE machine type; also the Ray resource each such node advertises (1 per node), "
                              "which the gang's placement asks for")
    cpus_per_node: Number = Field(1, gt=0, le=MAX_CPUS_PER_NODE,
                                  description="Ray CPUs the node actor reserves per node")
    spare_nodes: Integer = Field(
        0, ge=0, le=MAX_NODES, description="nodes placed with the gang that run nothing and stand by, their ranks "
        "warm, to take the place of a lost node (or one a restart keeps off) at once: no new placement, no cold start. "
        "Needs restart.max_restarts >= 1")
    keep_off_blamed: bool = Field(
        True, description="place the gang off the hosts the workspace's node history blames (lost, a hang's culprit) "
        "where the cluster has other nodes that fit, or can add them; else on the nodes there are, saying so. "
        "`a4ray nodes forget HOST` once a host is repaired")
    start_timeout_s: Seconds = Field(120, description="how long to wait for the gang to be placed")
    stop_grace_s: Seconds = Field(10, description="SIGTERM to SIGKILL grace when stopping a node")
    notice_grace_s: Seconds = Field(
        300, description="a cancel (Ctrl-C, `ray job stop`, SIGTERM to the driver) of a trainer that saves on notice: "
        "how long its ranks have to save at the iteration they reached and end before they are stopped; on A4 also "
        "the worker pods' preStop wait for the same on a pod's deletion (terminationGracePeriodSeconds: this + 30). "
        "Keep it above a synchronous save's time (a run's goodput records checkpoint_save_s)")
    launcher: Literal["a4ray", "torchrun"] = Field(
        "a4ray", description="what starts a node's ranks of a torchrun workload: a4ray's rank launcher "
        "(torchrun's env contract, no elastic agent: the gang already placed, ranked and supervises the "
        "nodes) or torchrun itself")
    topology: TopologySpec = TopologySpec()

    @property
    def node_resource(self) -> str:
        """The Ray custom resource every node of this machine type advertises (1 per node)."""
        return self.machine_type

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def placed_nodes(self) -> int:
        """The nodes the gang holds: those that train and the spares."""
        return self.nodes + self.spare_nodes


A4_NCCL_OVERRIDES = {
    # The A4 recipes override these after sourcing set_nccl_env.sh (hostNetwork: eth0/eth1 are the
    # gVNICs; the tuner config is A4's, not A3U's).
    "NCCL_SOCKET_IFNAME": "eth0,eth1",
    "NCCL_TUNER_CONFIG_PATH": "/usr/local/gib/configs/tuner_config_a4.txtpb",
    # Beside them 27 of the 29 A4 training recipes of gpu-recipes pin gloo (Megatron's and torch's CPU
    # groups) to eth0; unset, gloo picks the interface the hostname resolves to.
    "GLOO_SOCKET_IFNAME": "eth0",
}


class NetworkSpec(Spec):
    """NCCL networking. `gib: auto` sources the gIB script where a node has it and says where not."""

    gib: Literal["on", "off", "auto"] = Field(
        "auto", description="on: source gib_script on every node, failing where a node lacks it; auto: where a node "
        "has it; off: never")
    gib_script: PathStr = Field("/usr/local/gib/scripts/set_nccl_env.sh",
                                description="the gIB plugin's script that sets NCCL's environment, on the nodes")
    gib_overrides: EnvVars = Field(
        default_factory=lambda: dict(A4_NCCL_OVERRIDES),
        description="applied after the gIB script, only on nodes where gIB is used",
    )
    env: EnvVars = Field(default_factory=dict, description="extra NCCL/env vars; they win over all else")

    @field_validator("gib_script")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError("must be an absolute path on the nodes")
        return path

    @property
    def gib_lib_dir(self) -> str:
        """`<gib root>/lib64`, where libnccl and the net/tuner plugins live (script is <root>/scripts/...)."""
        root = self.gib_script.rsplit("/", 2)[0]
        return f"{root}/lib64"


def inductors_own(variable: str, value: str) -> bool:
    """Whether `value` of `variable` is what torch gives it itself, which is no one's choice, so the compile cache's
    default still applies: importing megatron-core sets TORCHINDUCTOR_CACHE_DIR to inductor's default
    (`<that process's tmp>/torchinductor_<user>`) in the importing process, so a driver that imported it before
    starting its embedded cluster handed that to every node as if the image had set it."""
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    return variable == "TORCHINDUCTOR_CACHE_DIR" and os.path.basename(value.rstrip("/")) == f"torchinductor_{user}"


class StorageSpec(Spec):
    """Shared storage every node mounts. Run directories (resolved spec, logs, results) live there."""

    workspace: PathStr = Field("/mnt", description="shared workspace root on every node")
    local_workspace: PathStr = Field(
        ".a4ray", description="workspace used instead on the embedded local cluster (relative to cwd)"
    )
    local_checkpoints: PathStr = Field(
        "", description="node-local storage for local checkpoints (train.local_save_interval), on every node: '' is "
        "each node's RAM disk, /dev/shm/a4ray-local-checkpoints (a simulated node's own directory)")
    compile_cache: PathStr = Field(
        "cache/compile", description="where torch.compile (inductor) and Triton keep their on-disk caches, relative "
        "to the workspace (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, where the image or the user sets neither): "
        "shared by every node, attempt and run, so that a restart, a replacement node and the next run load the "
        "kernels compiled before instead of compiling them again; '' leaves each process its own default in its /tmp")

    def compile_cache_env(self, workspace: str) -> dict[str, str]:
        """The launch env that keeps the compile caches in `compile_cache` under `workspace` (none for '')."""
        if not self.compile_cache:
            return {}
        root = PurePosixPath(on_nodes(workspace, self.compile_cache))
        return {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TRITON_CACHE_DIR": str(root / "triton")}

    @field_validator("workspace")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError("must be an absolute path (the mount point on every node)")
        return path.rstrip("/") or "/"

    @field_validator("workspace", "local_workspace")
    @classmethod
    def _a_directory_of_its_own(cls, path: str) -> str:
        problem = workspace_problem(path) if path.strip() else "must name a directory"
        if problem:
            raise ValueError(problem)
        return path
