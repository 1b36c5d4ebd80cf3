"""The Python API: a4ray from a notebook, and the layer every entry point (`a4ray run`, `python -m a4ray.*`)
stands on.

    import a4ray

    cluster = a4ray.connect()                    # RAY_ADDRESS, ray://..., a local Ray cluster, or an embedded one
    spec = a4ray.load("jobs/nccl_test.yaml").set("nccl.max_bytes", "64M")
    result = a4ray.run(spec)                     # runs here; every rank's lines stream into the cell
    run = a4ray.submit(spec)                     # runs as a Ray job on the cluster; a handle
    run.status(); run.logs(); run.result(); run.cancel()
    a4ray.runs(); a4ray.get_run(run.id)          # the same run again, after a kernel restart
    a4ray.sweep(spec, {"network.env.NCCL_IB_QPS_PER_CONNECTION": [1, 2, 4]})

Results are typed (`a4ray.core.results.Result`: `.to_pandas()`, `.plot()`, an HTML view in Jupyter). A run's
record is its run directory on the workspace (`<workspace>/runs/<id>/`: spec, plan, logs, result), so it
outlives the process, the Ray session and the cluster.
"""

from __future__ import annotations

import html
import os
import shlex
import sys
from pathlib import Path

import ray

from a4ray.core.console import say
from a4ray.core.errors import A4RayError, Cancelled
from a4ray.driver.handle import Run, RunList, find_runs, record_outcome
from a4ray.core.results import Result
from a4ray.core.rundir import RunDir
from a4ray.runtime.connect import Connection
from a4ray.runtime.simulated import LOCAL_ROOT_ENV
from a4ray.spec import JobSpec, RecipeJob, StageJob, StorageSpec, load_job

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
        storage = spec.storage if spec is not None else StorageSpec()
        return self.conn.workspace(storage.workspace, storage.local_workspace)

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
    from a4ray.runtime.connect import connect as open_connection
    from a4ray.spec import ClusterSpec

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


def load(path: str | Path | None = None, *sets: str, kind: str | None = None) -> JobSpec:
    """A job spec from YAML (or `kind`'s defaults), with Helm-style `a.b.c=value` overrides.
    Tweak it with `.set("nccl.sizes", ...)`, which returns a validated copy."""
    return load_job(path, list(sets), kind=kind)


def plan(spec: JobSpec) -> str:
    """What running `spec` would do, from the spec alone (nothing runs, no cluster): every node's command
    and environment; for a recipe, each step. What `--dry-run` prints; it refuses what a run would."""
    if isinstance(spec, RecipeJob):
        from a4ray.pipeline import plan as pipeline_plan

        return pipeline_plan(spec)
    from a4ray.runner import workload_for

    work = workload_for(spec)
    work.check()
    return work.plan().render()


def run(spec: JobSpec, *, address: str | None = None, local_nodes: int | None = None, dashboard: bool = False,
        run_dir: str | Path | None = None) -> Result:
    """Run `spec` to completion from this process and return its typed result: a pipeline for recipes,
    staging for `stage` specs, else a gang launch of the workload. It connects like every entry point
    (this process's cluster first). Through Ray Client the run goes to the cluster as a Ray job and this
    call follows it. Errors before anything ran raise `A4RayError`; Ctrl-C / `ray job stop` raise
    KeyboardInterrupt. With `run_dir` (a submitted run's), the outcome is recorded there either way."""
    cluster = current()
    if cluster is not None and cluster.conn.client:
        return submit(spec).follow()
    try:
        if isinstance(spec, RecipeJob):
            from a4ray.pipeline import run as run_pipeline

            return run_pipeline(spec, address=address, local_nodes=local_nodes, dashboard=dashboard, run_dir=run_dir)
        if isinstance(spec, StageJob):
            from a4ray.staging import stage

            return stage(spec, address=address, local_nodes=local_nodes)
        from a4ray.runner import run as run_workload

        return run_workload(spec, address=address, local_nodes=local_nodes, dashboard=dashboard, run_dir=run_dir)
    except (KeyboardInterrupt, Cancelled):
        record_outcome(run_dir, spec, "CANCELLED (Ctrl-C or `ray job stop`)")
        raise
    except A4RayError as error:
        record_outcome(run_dir, spec, f"ERROR: {error}")
        raise


def submit(spec: JobSpec, *, runtime_env: dict | None = None) -> Run:
    """Start `spec` as a Ray job on this process's cluster and return its handle at once.

    The run directory is made here, before the job starts, so the handle (and `get_run`) finds the run
    from its first second; the job's driver runs `a4ray run` on the cluster and fills it. This process
    must see the workspace (true on an embedded or `a4ray local up` cluster, and on a notebook pod that
    mounts the cluster's shared storage)."""
    cluster = current()
    if cluster is None:
        raise A4RayError("not connected to a Ray cluster", hint="a4ray.connect() first (an embedded cluster "
                         "of simulated A4 nodes if there is no other)")
    if not cluster.dashboard_url:
        raise A4RayError(f"the cluster at {cluster.address} has no dashboard, so no job API to submit to",
                         hint="start it with its dashboard (a4ray.connect(dashboard=True), `ray start --head "
                         "--include-dashboard=true`), or run here with a4ray.run(spec)")
    if isinstance(spec, StageJob):
        raise A4RayError("a stage spec runs as Ray tasks from this process", hint="a4ray.run(spec)")
    workspace = cluster.workspace(spec)
    if cluster.simulated:  # the driver finds the local workspace where this process does, wherever it runs
        spec = spec.set("storage.local_workspace", str(workspace))
    try:
        run_dir = RunDir.create(workspace, spec.name)
    except OSError as e:
        raise A4RayError(f"cannot create a run directory under {workspace} from here: {e}",
                         hint="mount the cluster's workspace here, or run from a process on the cluster") from None
    spec_file = run_dir.write("spec.yaml", spec.to_yaml())
    python = sys.executable if cluster.simulated else "python"
    entrypoint = shlex.join([python, "-m", "a4ray.cli", "run", "--config", str(spec_file),
                             "--run-dir", str(run_dir.root)])
    if cluster.simulated:  # this machine: the driver runs here, relative paths in the spec mean what they do here
        entrypoint = f"cd {shlex.quote(os.getcwd())} && {entrypoint}"
    handle = Run(run_dir.root, job_api=cluster.dashboard_url)
    handle.start(entrypoint, runtime_env=runtime_env)
    say(f"submitted {spec.kind} run {handle.id} as a Ray job (dashboard: {cluster.dashboard_url})")
    return handle


def runs(workspace: str | Path | None = None, *, job: str | None = None) -> RunList:
    """The runs recorded in the workspace (default: this cluster's), newest first; `job` filters by name."""
    return find_runs(_workspace(workspace), job=job)


def get_run(run_id: str, workspace: str | Path | None = None) -> Run:
    """The run `run_id` (its run directory's name), e.g. after a kernel restart."""
    root = _workspace(workspace) / "runs" / run_id
    if not root.is_dir():
        raise A4RayError(f"no run {run_id!r} in {root.parent}", hint="a4ray.runs() lists the runs there")
    return Run.at(root)


def _workspace(workspace: str | Path | None) -> Path:
    if workspace is not None:
        return Path(workspace)
    cluster = current()
    if cluster is not None:
        return cluster.workspace()
    return (Path(os.environ.get(LOCAL_ROOT_ENV) or os.getcwd()) / StorageSpec().local_workspace).resolve()
