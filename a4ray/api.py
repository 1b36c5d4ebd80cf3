"""The Python API: a4ray from a notebook. Every call goes through the same job driver as the CLI and the
`python -m a4ray.<job>` modules (`a4ray.driver`).

    import a4ray

    cluster = a4ray.connect()                    # RAY_ADDRESS, ray://..., a local Ray cluster, or an embedded one
    spec = a4ray.load("jobs/nccl_test.yaml").set("nccl.max_bytes", "64M")
    result = a4ray.run(spec)                     # runs here; every rank's lines stream into the cell
    run = a4ray.submit(spec)                     # runs as a Ray job on the cluster; a handle
    run.status(); run.logs(); run.result(); run.cancel()
    a4ray.runs(); a4ray.get_run(run.id)          # the same run again, after a kernel restart
    a4ray.nodes(); a4ray.forget_node("host")     # the workspace's node history (lost, hang culprit, straggler)
    a4ray.sweep(spec, {"network.env.NCCL_IB_QPS_PER_CONNECTION": [1, 2, 4]})
    g = a4ray.goodput(result); g.line(); g.plot()  # where the run's time went: buckets, incidents, a time line
    a4ray.project_ettr(u0_s=60, w_s=10, interval_s=600)  # Meta's ETTR at 16-1024 nodes (g.projection(): the run's own)

Results are typed (`a4ray.core.results.Result`: `.to_pandas()`, `.plot()`, an HTML view in Jupyter). A
run's record is its run directory on the workspace (`<workspace>/runs/<id>/`: spec, plan, logs, result),
so it outlives the process, the Ray session and the cluster. Bad input raises `a4ray.core.errors.A4RayError`
(`SpecError` names the field).
"""

from __future__ import annotations

from pathlib import Path

from a4ray.core.errors import A4RayError
from a4ray.core.node_history import NodeEvent, NodeHistory
from a4ray.core.results import Result
from a4ray.driver import execute, session
from a4ray.driver.handle import Run, RunList, find_run, find_runs
from a4ray.driver.handle import submit as submit_run
from a4ray.driver.session import Cluster, connect, current
from a4ray.observe.goodput import Goodput, find, project_ettr  # project_ettr: Meta's ETTR model, as it is
from a4ray.spec.job import JobSpec
from a4ray.spec.loader import load_job

__all__ = ["Cluster", "connect", "current", "forget_node", "get_run", "goodput", "load", "nodes", "plan", "project_ettr",
           "run", "runs", "submit"]


def load(path: str | Path | None = None, *sets: str, kind: str | None = None) -> JobSpec:
    """A job spec from YAML (or `kind`'s defaults), with Helm-style `a.b.c=value` overrides.
    Tweak it with `.set("nccl.sizes", ...)`, which returns a validated copy."""
    return load_job(path, list(sets), kind=kind)


def plan(spec: JobSpec) -> str:
    """What running `spec` would do, from the spec alone (nothing runs, no cluster): every node's command
    and environment; for a recipe, each step. What `--dry-run` prints; it refuses what a run would."""
    return execute.render(execute.plan(spec))


def run(spec: JobSpec, *, address: str | None = None, local_nodes: int | None = None, dashboard: bool = False,
        run_dir: str | Path | None = None) -> Result:
    """Run `spec` to completion from this process and return its typed result: a pipeline for recipes,
    staging for `stage` specs, else a gang launch of the workload. It connects like every entry point
    (this process's cluster first); `local_nodes` sets `cluster.nodes`. Through Ray Client the run goes to
    the cluster as a Ray job and this call follows it. Errors before anything ran raise `A4RayError`;
    Ctrl-C / `ray job stop` raise KeyboardInterrupt. The outcome is recorded in the run directory."""
    if local_nodes is not None:
        spec = spec.set("cluster.nodes", local_nodes)
    return execute.run(spec, address=address, dashboard=dashboard, run_dir=run_dir)


def submit(spec: JobSpec, *, runtime_env: dict | None = None) -> Run:
    """Start `spec` as a Ray job on this process's cluster and return its handle at once (see
    `a4ray.driver.handle.submit`)."""
    cluster = current()
    if cluster is None:
        raise A4RayError("not connected to a Ray cluster", hint="a4ray.connect() first (an embedded cluster "
                         "of simulated A4 nodes if there is no other)")
    return submit_run(spec, cluster.conn, runtime_env=runtime_env)


def runs(workspace: str | Path | None = None, *, job: str | None = None) -> RunList:
    """The runs recorded in the workspace (default: this cluster's), newest first; `job` filters by name."""
    return find_runs(session.workspace(workspace), job=job)


def get_run(run_id: str, workspace: str | Path | None = None) -> Run:
    """The run `run_id` (its run directory's name, or the Ray submission id of the `ray job submit` that ran it),
    e.g. after a kernel restart."""
    runs = session.workspace(workspace) / "runs"
    run = find_run(runs.parent, run_id)
    if run is None:
        raise A4RayError(f"no run {run_id!r} in {runs}", hint="a4ray.runs() lists the runs there")
    return run


def nodes(workspace: str | Path | None = None) -> dict[str, list[NodeEvent]]:
    """The workspace's node history (default: this cluster's): host -> its events, oldest first (lost, hang
    culprit, straggler, doctor failure; each with its run and date). A restart keeps the gang off a host whose
    failure it attributes; the history is what the doctor and `a4ray nodes` show."""
    return NodeHistory(session.workspace(workspace)).hosts()


def forget_node(host: str, workspace: str | Path | None = None) -> int:
    """Clear `host`'s history (after the node was repaired); returns how many events it held."""
    return NodeHistory(session.workspace(workspace)).forget(host)


def goodput(run: Result | Run | str | Path) -> Goodput:
    """Where a run's wall time went (its `result.json`'s `goodput`; a pipeline's is its train step's): the buckets
    (`.buckets`, `.to_pandas()`), the goodput line (`.line()`), each incident (`.incident_rows()`), the time line,
    one bar per attempt (`.plot()`), and Meta's ETTR projection from the run's own figures (`.projection()`).
    `run`: a result, a run handle, or a run's id or directory."""
    if isinstance(run, (str, Path)):
        run = get_run(str(run)) if not Path(run).is_dir() else Run.at(run)
    if isinstance(run, Run):
        run = run.result()
    found = find(run.model_dump(mode="json"))
    if found is None:
        raise A4RayError(f"the {run.kind} result has no goodput record", hint="only gang runs (training, tests) "
                         "account for their time; a run that ended before its first launch has none")
    return found

