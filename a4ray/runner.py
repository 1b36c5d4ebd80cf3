"""Run a job: connect, create its run directory, place the gang, launch, and return the typed result.

The `python -m a4ray.<workload>` modules, the `a4ray` CLI and the notebook API all call this.
"""

from __future__ import annotations

import time
from pathlib import Path

from a4ray.core.console import say
from a4ray.observe import metrics
from a4ray.core.rundir import RunDir
from a4ray.runtime.connect import connect
from a4ray.runtime.gang import Gang
from a4ray.runtime.restart import should_retry
from a4ray.runtime.signals import sigterm_as_interrupt
from a4ray.spec.job import JobSpec
from a4ray.workloads.workload import Workload, WorkloadResult, registered


def workload_for(spec: JobSpec) -> Workload:
    known = registered()
    try:
        return known[spec.kind](spec)
    except KeyError:
        raise KeyError(f"no workload runs job kind {spec.kind!r} (known: {', '.join(sorted(known))})") from None


def run(spec: JobSpec, *, address: str | None = None, local_nodes: int | None = None,
        dashboard: bool = False, run_dir: str | Path | None = None) -> WorkloadResult:
    """Run `spec` to completion: `Workload.run_job`, by default gang launches restarted per `spec.restart`.
    A failed launch returns a result with `ok=False` (and the gang's failure); errors before anything ran
    (spec, cluster, placement, gIB) and cancellation raise. `run_dir`: an existing run directory to use
    (a submitted run's), instead of a new one under the workspace."""
    work = workload_for(spec)
    work.check()
    with connect(address, cluster=spec.cluster, local_nodes=local_nodes, dashboard=dashboard) as conn:
        run_dir = RunDir.existing(run_dir) if run_dir else RunDir.create(
            conn.workspace(spec.storage.workspace, spec.storage.local_workspace), spec.name)
        say(f"run directory: {run_dir.root}")
        run_dir.write("spec.yaml", spec.to_yaml())
        run_dir.write("plan.json", work.plan())
        result = work.run_job(conn, run_dir)
        run_dir.write("result.json", result)
        say(f"logs: {run_dir.logs} (one file per node and per rank)")
    return result


def run_attempts(spec: JobSpec, work: Workload, run_dir: RunDir, *,
                 log_dir: Path | None = None) -> WorkloadResult:
    """Execute on a gang, and again on a fresh gang (a lost node replaced by a free one) while the
    restart policy allows. Each attempt gets `spec.timeout_s`. Also a pipeline's train step (its logs
    under `log_dir`, default the run directory's `logs/`)."""
    attempt = 0
    while True:
        metrics.record_attempt(spec.name, run_dir.id, attempt)
        if attempt:
            note = work.resume_note()
            say(f"attempt {attempt}/{spec.restart.max_restarts}: relaunching on a new gang"
                + (f"; {note}" if note else ""))
        with Gang(spec, log_dir=str(log_dir or run_dir.logs), run_dir=str(run_dir.root), attempt=attempt) as gang, \
                sigterm_as_interrupt():
            result = work.execute(gang)
        if result.gang is None:
            return result
        retry, why = should_retry(result.gang, spec.restart, attempt)
        if not retry:
            if spec.restart.max_restarts or attempt:
                say(f"not restarting: {why}")
            return result
        attempt += 1
        say(f"restarting in {spec.restart.backoff_s:g}s: {why}")
        time.sleep(spec.restart.backoff_s)
