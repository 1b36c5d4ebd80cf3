"""The staging service: one detached, named Ray actor per cluster that owns every staging in flight.

Exactly once: a request for a target that is being staged joins the staging in flight (one task, one
download) and gets its outcome, from whichever driver and Ray job it comes. Two drivers racing to create
the service both get the same actor (`get_if_exists`, decided by Ray's GCS). The service keeps no state
that matters on disk: if it dies, its tasks die with it (Ray ties a task's fate to its owner), the
drivers see that, create a new service and ask again, and the new tasks resume from the partial
directories. The flock in `layout.locked` keeps a second writer out even across Ray clusters.

Cancelling: when every requester of a staging has gone (Ctrl-C, `ray job stop`), its task is cancelled;
what it downloaded stays in the partial directory for the next run.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from pathlib import Path

import ray

from a4ray.core.errors import A4RayError
from a4ray.observe import stream
from a4ray.runtime.connect import NAMESPACE
from a4ray.staging.display import Progress
from a4ray.staging.task import ArtifactOutcome, StageRequest, run_stage


def _code_version() -> str:
    """A digest of the staging code: a detached service runs the code of the job that started it, so each
    version of the code gets its own service (the on-disk lock still serializes them on a target)."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), root.parent / "spec" / "artifacts.py"]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


SERVICE_NAME = f"a4ray-staging-{_code_version()}"


def _stage_task(request: StageRequest, service) -> ArtifactOutcome:
    def sink(progress: Progress) -> None:
        service.report.remote(progress)

    if request.log:
        return stream.captured(request.log, run_stage, request, sink=sink)
    return run_stage(request, sink=sink)


def task_options(request: StageRequest) -> dict:
    options = request.options
    placement: dict = {"num_cpus": options.cpus, "max_retries": options.retries, "retry_exceptions": False,
                       "name": f"a4ray-stage:{request.artifact.name}"}
    if options.node_labels:
        placement["label_selector"] = dict(options.node_labels)
    return placement


@dataclass
class _Flight:
    fingerprint: str
    job: str
    source: str
    ref: ray.ObjectRef
    future: asyncio.Future
    waiters: int = 0


class StagingService:
    def __init__(self) -> None:
        self.flights: dict[str, _Flight] = {}
        self.progress: dict[str, Progress] = {}
        self.shared_checked: set[tuple[str, frozenset[str]]] = set()
        self._task = ray.remote(_stage_task)

    def __repr__(self) -> str:
        """What the dashboard's Actors page shows for it (Ray takes the repr once, when the actor starts): a
        service that outlives the jobs on purpose, not a leftover of one."""
        return ("StagingService(a4ray's staging service of this cluster, shared by every job and kept between "
                "them: it joins requests for one target to one download; idle, it holds no CPU)")

    async def stage(self, request: StageRequest) -> ArtifactOutcome:
        key = request.target
        fingerprint = request.artifact.fingerprint()
        flight = self.flights.get(key)
        joined = flight is not None
        if flight is not None and flight.fingerprint != fingerprint:
            return _failed(request, f"{key} is being staged right now from {flight.source} (for job "
                           f"{flight.job or '?'}); one target holds one artifact: give this one another target")
        if flight is None:
            me = ray.get_runtime_context().current_actor
            ref = self._task.options(**task_options(request)).remote(request, me)
            flight = _Flight(fingerprint, request.job, request.artifact.source, ref,
                             asyncio.ensure_future(self._settle(key, request, ref)))
            self.flights[key] = flight
            self.progress[key] = Progress(artifact=request.artifact.name, target=key)
        flight.waiters += 1
        try:
            outcome = await asyncio.shield(flight.future)
        except asyncio.CancelledError:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.future.done():
                ray.cancel(flight.ref, force=True)
            raise
        if joined and outcome.status == "ran":
            return outcome.model_copy(update={"status": "joined", "name": request.artifact.name})
        return outcome

    async def _settle(self, key: str, request: StageRequest, ref: ray.ObjectRef) -> ArtifactOutcome:
        try:
            return await ref
        except ray.exceptions.TaskCancelledError:
            return _failed(request, "cancelled (every requester went away); what was downloaded is kept in "
                           "the partial directory and the next run resumes it")
        except ray.exceptions.RayTaskError as e:
            cause = e.cause
            if isinstance(cause, A4RayError):
                return _failed(request, str(cause))
            return _failed(request, f"the staging task failed: {type(cause).__name__}: {cause}")
        except ray.exceptions.RayError as e:
            return _failed(request, f"the staging task died ({type(e).__name__}: a killed worker or a lost node) "
                           f"after {request.options.retries} retries; what was downloaded is kept and the next "
                           "run resumes it")
        finally:
            self.flights.pop(key, None)
            self.progress.pop(key, None)

    async def report(self, progress: Progress) -> None:
        if progress.target in self.flights:
            self.progress[progress.target] = progress

    async def snapshot(self, keys: list[str]) -> list[Progress]:
        return [self.progress[k] for k in keys if k in self.progress and k in self.flights]

    async def shared_ok(self, workspace: str, nodes: list[str]) -> bool:
        return (workspace, frozenset(nodes)) in self.shared_checked

    async def mark_shared(self, workspace: str, nodes: list[str]) -> None:
        self.shared_checked.add((workspace, frozenset(nodes)))


def _failed(request: StageRequest, message: str) -> ArtifactOutcome:
    prefix = f"artifact {request.artifact.name!r}: "
    return ArtifactOutcome(name=request.artifact.name, source=request.artifact.source, target=request.target,
                           status="failed", error=message if message.startswith(prefix) else prefix + message)


def get_service():
    """The cluster's staging service, created by whichever driver asks first. It lives on the head node, the one
    node that lasts as long as the cluster (as Ray Train's state actor does): on a worker node it would go with that
    node, and with it every staging in flight."""
    return ray.remote(StagingService).options(
        name=SERVICE_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, resources={"node:__internal_head__": 0.001}, scheduling_strategy="DEFAULT",
        max_concurrency=1000, max_restarts=0,
    ).remote()
