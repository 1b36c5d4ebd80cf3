"""Run a job: connect, create its run directory, place the gang, launch, and return the typed result.

The `python -m a4ray.<workload>` modules, the `a4ray` CLI and the notebook API all call this.
"""

from __future__ import annotations

from a4ray.console import say
from a4ray.rundir import RunDir
from a4ray.runtime.connect import connect
from a4ray.spec.job import JobSpec
from a4ray.workloads import WORKLOADS
from a4ray.workloads.base import Workload, WorkloadResult


def workload_for(spec: JobSpec) -> Workload:
    try:
        return WORKLOADS[spec.kind](spec)
    except KeyError:
        raise KeyError(f"no workload runs job kind {spec.kind!r} (known: {', '.join(sorted(WORKLOADS))})") from None


def run(spec: JobSpec, *, address: str | None = None, local_nodes: int | None = None,
        dashboard: bool = False) -> WorkloadResult:
    """Run `spec` to completion (`Workload.execute`: by default one gang launch). A failed launch returns
    a result with `ok=False` (and the gang's failure); errors before anything ran (spec, cluster,
    placement, gIB) raise."""
    work = workload_for(spec)
    work.check()
    with connect(address, cluster=spec.cluster, local_nodes=local_nodes, dashboard=dashboard) as conn:
        run_dir = RunDir.create(conn.workspace(spec.storage.workspace, spec.storage.local_workspace), spec.name)
        say(f"run directory: {run_dir.root}")
        run_dir.write("spec.yaml", spec.to_yaml())
        run_dir.write("plan.json", work.plan())
        result = work.execute(conn, run_dir)
        run_dir.write("result.json", result)
        say(f"logs: {run_dir.logs} (one file per node and per rank)")
    return result
