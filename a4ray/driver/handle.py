"""A run as a handle: its run directory on the workspace and, when submitted, the Ray job that runs it.
`submit` starts a run as a Ray job and returns its handle.

Nothing in a handle lives in this process: `run.json` in the run directory names the job and the job
API that runs it, so `a4ray.get_run(id)` rebuilds the same handle after a kernel restart, and a handle
keeps working across `ray.shutdown()` / `ray.init()` (the job API is plain HTTP). While the job API knows
the job, status and logs come from it; afterwards (the cluster gone) from the run directory.
"""

from __future__ import annotations

import asyncio
import html
import json
import os
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ray.job_submission import JobSubmissionClient

from a4ray.core.console import say
from a4ray.core.errors import A4RayError
from a4ray.core.redact import has_url_credentials
from a4ray.core.results import Result, dataframe, load_result
from a4ray.core.rundir import RunDir
from a4ray.driver import kinds  # noqa: F401 - defines every job's result class, so load_result reads it
from a4ray.runtime import auth
from a4ray.runtime.connect import Connection, submit_job
from a4ray.spec.job import JobSpec
from a4ray.spec.loader import load_job
from a4ray.spec.recipes import RecipeJob

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
RECORD = "run.json"


class Run:
    def __init__(self, root: str | Path, *, job_api: str | None = None):
        self.root = Path(root)
        self.job_api = job_api

    @classmethod
    def at(cls, root: str | Path) -> Run:
        """The handle of the run recorded in `root`."""
        record = Path(root) / RECORD
        job_api = json.loads(record.read_text()).get("job_api") if record.is_file() else None
        return cls(root, job_api=job_api)

    @property
    def id(self) -> str:
        """The run directory's name; also the Ray job's submission id."""
        return self.root.name

    @property
    def submitted(self) -> bool:
        return self.job_api is not None

    # ------------------------------------------------------------------------------------------ job
    def _client(self) -> JobSubmissionClient:
        # As Ray documents (RAY_AUTH_MODE=token, the token from ~/.ray/auth_token), for a job API on this machine
        # only; the client takes its headers when made, so this process offers the token no longer than that.
        undo = auth.use_token_for(self.job_api)
        try:
            return JobSubmissionClient(self.job_api)
        finally:
            undo()

    def start(self, entrypoint: str, *, runtime_env: dict | None = None,
              metadata: dict[str, str] | None = None) -> None:
        """Submit the Ray job that runs this run (`a4ray.submit` calls this once). `metadata`: shown with the job
        (its `job_name` in the Name column of the dashboard's Jobs page)."""
        (self.root / RECORD).write_text(json.dumps({"id": self.id, "job_api": self.job_api,
                                                    "entrypoint": entrypoint, "submitted_at": time.time()}))
        submit_job(self._client(), entrypoint=entrypoint, submission_id=self.id, runtime_env=runtime_env,
                   metadata={**(metadata or {}), "a4ray_run_dir": str(self.root)})

    def _job_status(self) -> str | None:
        """The Ray job's status, or None where no job API knows the job (not submitted, cluster gone)."""
        if not self.submitted:
            return None
        try:
            return str(self._client().get_job_status(self.id).value)
        except Exception:  # noqa: BLE001 - unreachable API or an unknown job: the run directory speaks instead
            return None

    # ------------------------------------------------------------------------------------- state
    def status(self) -> str:
        """PENDING | RUNNING | SUCCEEDED | FAILED | STOPPED while the job API knows the run; afterwards
        SUCCEEDED | FAILED | STOPPED from its recorded result, or INCOMPLETE where none was recorded and this
        process cannot tell whether its driver still runs. A run whose driver is gone without a result (the
        Ray job ended without one, or its process no longer exists) is recorded as lost: FAILED, its result's
        verdict "DRIVER LOST: ..."."""
        status = self._job_status()
        self._record_if_lost(status)
        if status is not None:
            return status
        recorded = self._recorded()
        if recorded is None:
            return "INCOMPLETE"
        if recorded.get("ok"):
            return "SUCCEEDED"
        return "STOPPED" if recorded.get("cancelled") or str(recorded.get("verdict", "")).startswith("CANCELLED") \
            else "FAILED"

    def done(self) -> bool:
        return self.status() in TERMINAL + ("INCOMPLETE",)

    def wait(self, timeout_s: float | None = None, poll_s: float = 1.0) -> str:
        """Block until the run has ended; returns its final status."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (status := self.status()) not in TERMINAL + ("INCOMPLETE",):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {self.id} still {status} after {timeout_s:g}s")
            time.sleep(poll_s)
        return status

    def result(self, timeout_s: float | None = None) -> Result:
        """The typed result, once the run has ended (waits for it)."""
        status = self.wait(timeout_s)
        recorded = self._recorded()
        if recorded is None:
            tail = "\n".join(self.logs().splitlines()[-15:])
            raise A4RayError(f"run {self.id} ended {status} without a result in {self.root}",
                             hint=f"its driver died before it could record one; last lines:\n{tail}")
        return load_result(recorded)

    def follow(self) -> Result:
        """Print the job's output as it comes (like `ray job submit`), then return the result."""
        async def tail() -> None:
            async for chunk in self._client().tail_job_logs(self.id):
                print(chunk, end="", flush=True)

        # Its own thread and event loop: Jupyter's kernel already runs one in this thread.
        follower = threading.Thread(target=asyncio.run, args=(tail(),), daemon=True)
        follower.start()
        follower.join()
        return self.result()

    def cancel(self, timeout_s: float = 120) -> str:
        """Stop the run: the job's driver gets SIGTERM and ends the gang (every node's process tree).
        Returns the final status."""
        if not self.submitted:
            raise A4RayError(f"run {self.id} was not submitted: it runs in the process that started it",
                             hint="interrupt that process (Ctrl-C)")
        if self.status() not in TERMINAL:
            self._client().stop_job(self.id)
        return self.wait(timeout_s)

    # ------------------------------------------------------------------------------------ records
    def spec(self) -> JobSpec:
        return load_job(self.root / "spec.yaml")

    def logs(self) -> str:
        """The job's output (the driver: every rank's lines, prefixed) while the job API has it; else the
        per-node logs kept in the run directory."""
        if self.submitted:
            try:
                return self._client().get_job_logs(self.id)
            except Exception:  # noqa: BLE001 - the cluster is gone: the run directory keeps the node logs
                pass
        parts = [f"==> {log.relative_to(self.root)} <==\n{log.read_text(errors='replace')}"
                 for log in sorted(self.root.glob("logs/**/node-*.log"))]
        return "\n".join(parts)

    def _record_if_lost(self, job_status: str | None) -> None:
        if (self.root / "result.json").exists() or job_status in ("PENDING", "RUNNING"):
            return
        record = RunDir(self.root)
        lost = (f"the Ray job {self.id} ended {job_status} and its driver recorded no result: the driver was lost"
                if job_status is not None else record.driver_lost())
        if lost:
            record.write_outcome(self._kind(), f"DRIVER LOST: {lost}")

    def _kind(self) -> str:
        try:
            return str(load_job(self.root / "spec.yaml").kind)
        except A4RayError:
            return ""

    def _recorded(self) -> dict[str, Any] | None:
        path = self.root / "result.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def __repr__(self) -> str:
        return f"<a4ray.Run {self.id} {self.status()}>"

    def _repr_html_(self) -> str:
        return f"<p><b>run</b> {html.escape(self.id)}: {html.escape(self.status())} ({html.escape(str(self.root))})</p>"


class RunList(list):
    """Runs, newest first, as a table in Jupyter."""

    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for run in self:
            recorded = run._recorded() or {}
            rows.append({"id": run.id, "kind": recorded.get("kind", ""), "status": run.status(),
                         "verdict": recorded.get("verdict", ""), "dir": str(run.root)})
        return rows

    def to_pandas(self):
        return dataframe(self.rows())

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{c}</th>" for c in ("id", "kind", "status", "verdict"))
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in ("id", "kind", "status", "verdict"))
                       + "</tr>" for r in self.rows())
        return f"<table><tr>{head}</tr>{body}</table>"


def find_run(workspace: Path, run_id: str) -> Run | None:
    """The run `run_id` in the workspace: its run directory's name (also the Ray submission id of a run
    `a4ray.submit` started), or the Ray submission id of a `ray job submit` whose driver ran it."""
    root = workspace / "runs" / run_id
    if (root / "logs").is_dir():
        return Run.at(root)
    for driver in (workspace / "runs").glob("*/driver.json"):
        if RunDir(driver.parent).driver().get("ray_submission_id") == run_id:
            return Run.at(driver.parent)
    return None


def job_metadata(spec: JobSpec, run_id: str) -> dict[str, str]:
    """The Ray job's metadata: a readable `job_name` (the Name column of the dashboard's Jobs page; its Submission
    ID is the run id) and what ties the job to its a4ray run."""
    recipe = spec.kind if isinstance(spec, RecipeJob) else ""
    return {"job_name": f"{spec.name} ({spec.kind}{' recipe' if recipe else ''})",
            "a4ray_run_id": run_id, "a4ray_kind": spec.kind, "a4ray_recipe": recipe, "a4ray_spec": spec.name}


def find_runs(workspace: Path, *, job: str | None = None) -> RunList:
    roots = [p for p in (workspace / "runs").glob("*") if (p / "logs").is_dir()]
    if job:
        roots = [p for p in roots if p.name.rsplit("-", 3)[0] == job]
    roots.sort(key=lambda p: p.name.rsplit("-", 3)[1:], reverse=True)  # <job>-<date>-<time>-<random>
    return RunList(Run.at(p) for p in roots)


def submit(spec: JobSpec, conn: Connection, *, runtime_env: dict | None = None) -> Run:
    """Start `spec` as a Ray job on the connected cluster and return its handle at once.

    The run directory is made here, before the job starts, so the handle (and `get_run`) finds the run
    from its first second; the job's driver runs `a4ray run --run-dir` on the cluster and fills it. This
    process must see the workspace (true on an embedded or `a4ray local up` cluster, and on a notebook pod
    that mounts the cluster's shared storage)."""
    if not conn.dashboard_url:
        raise A4RayError(f"the cluster at {conn.address} has no dashboard, so no job API to submit to",
                         hint="start it with its dashboard (a4ray.connect(dashboard=True), `ray start --head "
                         "--include-dashboard=true`), or run here with a4ray.run(spec)")
    if spec.kind == "stage":
        raise A4RayError("a stage spec runs as Ray tasks from this process", hint="a4ray.run(spec)")
    if has_url_credentials(spec.to_yaml()):
        # The job's driver reads the spec from the run directory, which is a record: redacted, never a credential.
        raise A4RayError("the spec holds a URL with credentials (a password or signature), and a submitted run "
                         "reads its spec from its run directory, which never records one",
                         hint="run it from this process (a4ray.run(spec)), or give the nodes the credential "
                         "(staging.token_file, kuberay.secrets) instead of the URL")
    workspace = conn.workspace(spec.storage)
    if conn.simulated:  # the driver finds the local workspace where this process does, wherever it runs
        spec = spec.set("storage.local_workspace", str(workspace))
    try:
        run_dir = RunDir.create(workspace, spec.name)
    except OSError as e:
        raise A4RayError(f"cannot create a run directory under {workspace} from here: {e}",
                         hint="mount the cluster's workspace here, or run from a process on the cluster") from None
    spec_file = run_dir.write_spec(spec)
    python = sys.executable if conn.simulated else "python"
    entrypoint = shlex.join([python, "-m", "a4ray.cli", "run", "--config", str(spec_file),
                             "--run-dir", str(run_dir.root)])
    if conn.simulated:  # this machine: the driver runs here, relative paths in the spec mean what they do here
        entrypoint = f"cd {shlex.quote(os.getcwd())} && {entrypoint}"
    handle = Run(run_dir.root, job_api=conn.dashboard_url)
    handle.start(entrypoint, runtime_env=runtime_env, metadata=job_metadata(spec, handle.id))
    say(f"submitted {spec.kind} run {handle.id} as a Ray job (dashboard: {conn.dashboard_url})")
    return handle
