"""Which Ray cluster a job runs on.

In order: a Ray session this process already has (a notebook); `--address`; `RAY_ADDRESS` (set for
`ray job submit` drivers); a Ray cluster already running on this machine; else an embedded local
cluster of simulated A4 nodes, shut down when the job ends (also on Ctrl-C). The choice is printed.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import ray

from a4ray.core.console import say, warn
from a4ray.core.errors import ConnectError
from a4ray.observe import metrics
from a4ray.runtime import auth
from a4ray.runtime.simulated import LOCAL_ROOT_ENV, SIMULATED_LABEL, SimulatedCluster
from a4ray.spec.cluster import ClusterSpec, StorageSpec

NAMESPACE = "a4ray"  # named actors (staging owners, ...) are found across jobs in this namespace
# Ray Client's proxy starts one server process per client; now and then that process dies at once (on a
# head without a4ray's HEAD_ENV: ray-project/ray#63202), and the proxy answers with one of these. The
# next try gets a new one.
_CLIENT_SERVER_FAILED = ("Starting Ray client server failed", "in start_specific_server")
_CLIENT_TRIES = 3


@dataclass
class Connection:
    address: str
    mode: Literal["attached", "address", "running", "embedded"]
    local: SimulatedCluster | None = None
    dashboard_url: str | None = None  # http://host:port of the dashboard and its job API, if it has one
    _owns_ray: bool = False
    _undo: auth.Undo | None = None  # what this connection set for Ray's token auth, undone on close

    @property
    def client(self) -> bool:
        """True when connected through Ray Client (`ray://`): jobs then run on the cluster as Ray jobs."""
        return self.address.startswith("ray://")

    @property
    def simulated(self) -> bool:
        """True when the nodes are simulated A4 nodes (embedded or `a4ray local up`)."""
        if self.local is not None:
            return True
        return any(n.get("Labels", {}).get(SIMULATED_LABEL) == "true" for n in ray.nodes() if n.get("Alive"))

    def workspace(self, storage: StorageSpec) -> Path:
        """The workspace root: shared storage on a real cluster, a local directory when simulated. A relative
        one is under the directory the simulated cluster started in where that is known (an embedded
        cluster; a Ray job's driver, whose own directory is a temporary copy), else this directory."""
        if not self.simulated:
            return Path(storage.workspace)
        root = os.environ.get(LOCAL_ROOT_ENV) or (self.local.root if self.local else None) or os.getcwd()
        return (Path(root) / storage.local_workspace).resolve()

    def close(self, *, settle: bool = True) -> None:
        """Disconnect (and shut down what this connection started). `settle`: first wait for Ray to export this
        process's last metric values where the cluster outlives it; not when leaving on a cancel or an error,
        whose record must be written before `ray job stop` kills the driver (its grace is a few seconds)."""
        if self._owns_ray and ray.is_initialized():
            if settle and self.local is None:  # the cluster (its dashboard, Prometheus) outlives this process
                metrics.wait_exported()
            ray.shutdown()
        if self._undo is not None:  # before the embedded cluster's own: undone in the reverse order of setting
            self._undo()
            self._undo = None
        if self.local is not None:
            self.local.shutdown()
            self.local = None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(settle=exc_type is None)


def _init(address: str) -> tuple[str | None, auth.Undo]:
    """Connect this process; returns the dashboard's URL (None without a dashboard) and what undoes the token
    settings made for it."""
    undo = auth.use_token_for(address)  # a local cluster of a4ray's wants this user's token; no other host gets it
    try:
        if address.startswith("ray://"):  # Ray Client takes the namespace; the rest is the server's business
            context = _init_client(address)
        else:
            with metrics.exporting_often():
                context = ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING,
                                   log_to_driver=True, configure_logging=True)
    except BaseException:
        undo()
        raise
    return _http(context.dashboard_url), undo


def _init_client(address: str):
    for attempt in range(1, _CLIENT_TRIES + 1):
        try:
            return ray.init(address=address, namespace=NAMESPACE)
        except ConnectionError as e:
            if not any(sign in str(e) for sign in _CLIENT_SERVER_FAILED) or attempt == _CLIENT_TRIES:
                raise
            ray.shutdown()
            warn(f"the Ray Client proxy at {address} failed to start a server for this client (a transient Ray "
                 f"Client failure); trying again ({attempt + 1}/{_CLIENT_TRIES})")


def _http(url: str | None) -> str | None:
    return (url if "://" in url else f"http://{url}") if url else None


def _attached_dashboard() -> str | None:
    if ray.util.client.ray.is_connected():
        return _http(ray.util.client.ray._get_dashboard_url())
    try:
        return _http(ray._private.worker.get_dashboard_url())
    except Exception:  # noqa: BLE001 - no dashboard (or no way to ask): jobs cannot be submitted, runs still can
        return None


def _running_local_address() -> str | None:
    """The address of a Ray cluster started on this machine, if one is up (its GCS port answers)."""
    try:
        from ray._common.utils import get_ray_address_file  # where `ray start` records the address
    except ImportError:  # pragma: no cover - older Ray
        return None
    path = Path(get_ray_address_file(None))
    if not path.is_file():
        return None
    address = path.read_text().strip()
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
    except (OSError, ValueError):
        return None
    return address


def _summary() -> str:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    gpus = sum(int(n["Resources"].get("GPU", 0)) for n in nodes)
    return f"{len(nodes)} node(s), {gpus} GPU(s)"


def will_embed(address: str | None = None) -> bool:
    """Whether `connect(address)` would start an embedded local cluster: no Ray session in this process, no
    --address, no RAY_ADDRESS, and no Ray cluster running on this machine."""
    return not (ray.is_initialized() or address or os.environ.get("RAY_ADDRESS") or _running_local_address())


def attached() -> Connection:
    """The Ray session this process already has (a driver connected it), as a Connection it does not own."""
    if not ray.is_initialized():
        raise ConnectError("not connected to a Ray cluster",
                           hint="a4ray.connect() first, or run the job with a4ray.run(spec) / its command")
    if ray.util.client.ray.is_connected():
        address = f"ray://{ray.util.client.ray.client_worker._conn_str}"
    else:
        address = ray.get_runtime_context().gcs_address
    return Connection(address=address, mode="attached", dashboard_url=_attached_dashboard())


def connect(address: str | None = None, *, cluster: ClusterSpec | None = None, dashboard: bool = False) -> Connection:
    """Connect this process for one job (see the module's docstring for the order); an embedded cluster has
    `cluster`'s shape (its nodes, GPUs per node, machine type and topology)."""
    cluster = cluster or ClusterSpec()
    if ray.is_initialized():
        conn = attached()
        say(f"cluster: the Ray session this process already has ({conn.address}; {_summary()})")
        return conn
    source = "--address" if address else "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else None
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            dashboard_url, undo = _init(address)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConnectError(f"cannot reach the Ray cluster at {address} (from {source}): {e}",
                               hint="check the address and that the head is up, or unset it to use an "
                               "embedded local cluster") from None
        say(f"cluster: Ray cluster at {address} (from {source}; {_summary()})")
        return Connection(address=address, mode="address", dashboard_url=dashboard_url, _owns_ray=True, _undo=undo)
    running = _running_local_address()
    if running:
        dashboard_url, undo = _init(running)
        say(f"cluster: the Ray cluster already running on this machine at {running} ({_summary()})")
        return Connection(address=running, mode="running", dashboard_url=dashboard_url, _owns_ray=True, _undo=undo)
    local = SimulatedCluster(cluster.placed_nodes, cluster.gpus_per_node,
                             machine_type=cluster.machine_type, topology=cluster.topology,
                             dashboard=dashboard)
    try:
        local.start()
        dashboard_url, undo = _init(local.address)
    except BaseException:
        local.shutdown()
        raise
    say(f"cluster: {local.describe()}")
    return Connection(address=local.address, mode="embedded", local=local, dashboard_url=dashboard_url,
                      _owns_ray=True, _undo=undo)


AGENT_WAIT_S = 60.0  # how long a submission waits for a head whose job agent is not up yet


def submit_job(client, *, wait_s: float = AGENT_WAIT_S, **job) -> str:
    """`client.submit_job(**job)` (a Ray JobSubmissionClient), tried again for up to `wait_s` while the head answers
    "No available agent to submit job, please try again later": its dashboard is up, its job agent not yet (a head
    just started, a loaded machine). Said once; any other error, or the same after `wait_s`, is raised."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            return client.submit_job(**job)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() >= deadline:
                raise
            if not said:
                say(f"the head's job agent is not up yet; trying again for up to {wait_s:.0f} s")
                said = True
            time.sleep(1.0)
