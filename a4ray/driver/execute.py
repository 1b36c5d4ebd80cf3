"""Running one job, the one way every front end does (the CLI, `python -m a4ray.<job>`, the Python API):
connect, make the run directory, run the job its kind names, record how it ended.

    result = run(spec)                      # a typed result; the record is <workspace>/runs/<job>-<time>-<id>/
    result = run(spec, job=Doctor(spec))    # another job on the same spec's gang (`a4ray doctor`)

Errors before anything ran (spec, cluster, placement) raise `A4RayError`; Ctrl-C and `ray job stop`
(SIGTERM) raise KeyboardInterrupt after every node's process tree is stopped. Either way a run directory
that exists records how the run ended.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from a4ray.core.console import say
from a4ray.core.errors import A4RayError, Cancelled, SpecError
from a4ray.core.redact import redact
from a4ray.core.results import Result
from a4ray.core.rundir import RunDir
from a4ray.driver import session
from a4ray.driver.handle import submit
from a4ray.driver.kinds import Job, job_for
from a4ray.runtime.connect import Connection, connect
from a4ray.runtime.signals import sigterm_as_interrupt
from a4ray.spec.job import JobSpec


def plan(spec: JobSpec, job: Job | None = None) -> BaseModel | str:
    """What running `spec` would do, from the spec alone: every node's command and env, or each step of a
    pipeline. It refuses what a run would."""
    job = job or job_for(spec)
    job.check()
    return job.plan()


def render(plan: BaseModel | str) -> str:
    """The plan as text, secrets (credentials in URLs, ...) masked: what --dry-run prints."""
    return redact(plan if isinstance(plan, str) else plan.render())


def run(spec: JobSpec, *, job: Job | None = None, address: str | None = None, dashboard: bool = False,
        run_dir: str | Path | None = None, conn: Connection | None = None) -> Result:
    """Run `spec` (or `job`, built from it) to completion and return its typed result. It connects like
    every entry point: this process's cluster first. Through Ray Client the run goes to the cluster as a
    Ray job and this call follows it. `run_dir`: an existing run directory (a submitted run's); `conn`: a
    connection the caller opened for this run (closed here)."""
    job = job or job_for(spec)
    job.check()
    cluster = session.current()
    if cluster is not None and cluster.conn.client:
        return submit(spec, cluster.conn).follow()
    record = RunDir.existing(run_dir) if run_dir else None
    try:
        with conn or connect(address, cluster=spec.cluster, dashboard=dashboard) as conn, sigterm_as_interrupt():
            workspace = conn.workspace(spec.storage)
            # Every path it writes by name, and its record, stay in the workspace: checked before anything runs.
            try:
                spec.check_writes(workspace, [("run directory", record.root if record else "runs")])
            except SpecError:
                record = None  # nothing is written where it would lead
                raise
            record = record or RunDir.create(workspace, spec.name)
            record.write_driver()
            say(f"run directory: {record.root}")
            record.write_spec(spec)
            record.write_plan(job.plan(str(workspace)))
            result = job.run(conn, record)
            record.write_result(result)
            say(f"logs: {record.logs} (one file per node and per rank); result: {record.root / 'result.json'}")
        return result
    except (KeyboardInterrupt, Cancelled):
        if record is not None:
            record.write_outcome(spec.kind, "CANCELLED (Ctrl-C or `ray job stop`)")
        raise KeyboardInterrupt from None
    except A4RayError as error:
        if record is not None:
            record.write_outcome(spec.kind, f"ERROR: {error}")
        raise
