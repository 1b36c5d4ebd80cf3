"""This process's cluster, as a notebook holds it: `connect()` once, then every run and submit uses it.

A job's driver (`python -m a4ray.<job>`) does not need this: `execute.run` connects for the job and closes
what it opened. A notebook connects first, and its runs find that cluster here.
"""

from __future__ import annotations

import html
from pathlib import Path

import ray

from a4ray.core.errors import A4RayError
from a4ray.runtime.connect import Connection
from a4ray.runtime.connect import connect as open_connection
from a4ray.runtime.simulated import local_root
from a4ray.spec.cluster import ClusterSpec, StorageSpec
from a4ray.spec.job import JobSpec

_current: Cluster | None = None


class Cluster:
    """A connected Ray cluster (`a4ray.connect`). It is this process's cluster until `close()`."""

    def __init__(self, conn: Connection):
        self.conn = conn

    @property
    def address(self) -> str:
        return self.conn.address

    @property
    def dashboard_url(self) -> str | None:
        """The Ray dashboard (logs, metrics) and its job API, where `submit` sends runs."""
        return self.conn.dashboard_url

    @property
    def simulated(self) -> bool:
        return self.conn.simulated

    def workspace(self, spec: JobSpec | None = None) -> Path:
        """Where run directories go: the spec's shared workspace, or its local one on simulated nodes."""
        return self.conn.workspace(spec.storage if spec is not None else StorageSpec())

    def nodes(self) -> list[dict]:
        """The alive nodes: address, resources and labels (the simulated topology on an embedded cluster)."""
        return [{"ip": n["NodeManagerAddress"], "resources": n["Resources"], "labels": n.get("Labels", {})}
                for n in ray.nodes() if n.get("Alive")]

    def close(self) -> None:
        """Disconnect; an embedded cluster is shut down."""
        global _current
        self.conn.close()
        if _current is self:
            _current = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<a4ray.Cluster {self.conn.mode} {self.address} dashboard={self.dashboard_url}>"

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{html.escape(n['ip'])}</td><td>{int(n['resources'].get('GPU', 0))}</td>"
                       f"<td>{html.escape(', '.join(f'{k}={v}' for k, v in sorted(n['labels'].items())))}</td></tr>"
                       for n in self.nodes())
        dash = (f'<a href="{self.dashboard_url}" target="_blank">{self.dashboard_url}</a>'
                if self.dashboard_url else "no dashboard")
        return (f"<p><b>Ray cluster</b> {html.escape(self.address)} ({self.conn.mode}); dashboard: {dash}</p>"
                f"<table><tr><th>node</th><th>GPUs</th><th>labels</th></tr>{rows}</table>")


def connect(address: str | None = None, *, local_nodes: int = 2, gpus_per_node: int = 8,
            dashboard: bool = True) -> Cluster:
    """Connect this process to a Ray cluster: `address` (also `ray://host:10001` for Ray Client), else
    RAY_ADDRESS, else a Ray cluster running on this machine, else an embedded local cluster of
    `local_nodes` simulated A4 nodes with `gpus_per_node` logical GPUs (and, with `dashboard`, the Ray
    dashboard and job API, which `submit` needs). Connected already: that cluster."""
    global _current
    if _current is not None and ray.is_initialized():
        if address and address != _current.address:
            raise A4RayError(f"this process is connected to {_current.address}, not {address}",
                             hint="a4ray.connect().close() first, then connect to the other cluster")
        return _current
    _current = Cluster(open_connection(address, cluster=ClusterSpec(nodes=local_nodes, gpus_per_node=gpus_per_node),
                                       dashboard=dashboard))
    return _current


def current() -> Cluster | None:
    """The cluster `connect` connected this process to (None if not connected)."""
    return _current if _current is not None and ray.is_initialized() else None


def workspace(given: str | Path | None = None) -> Path:
    """Where runs are recorded: `given`, else this process's cluster's workspace, else the default local one
    (where `a4ray local up` or an embedded cluster started, or here)."""
    if given is not None:
        return Path(given)
    cluster = current()
    if cluster is not None:
        return cluster.workspace()
    return (local_root() / StorageSpec().local_workspace).resolve()
