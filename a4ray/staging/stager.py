"""`stage(spec)`: stage a job's artifacts on the connected cluster and report, per artifact, ran | cached | joined.

The `Staging` job (`kind: stage`, and `a4ray stage -f` of any spec that lists artifacts) and the pipelines'
stage step call it. Each artifact becomes one request to the cluster's staging service (one Ray task per
artifact, exactly once per target); the driver shows their progress until all are done, then returns a
`StageResult` or raises `StagingFailed` with it.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import ray

from a4ray.core.console import say, table
from a4ray.core.errors import SpecError, StagingError, StagingFailed
from a4ray.core.results import Result
from a4ray.core.rundir import RunDir
from a4ray.observe import stream
from a4ray.runtime.connect import Connection, attached
from a4ray.runtime.deaths import ACTOR_GONE, why_died
from a4ray.runtime.simulated import local_root
from a4ray.spec.artifacts import ArtifactSpec, Staged, StagingOptions
from a4ray.spec.cluster import ClusterSpec, StorageSpec
from a4ray.spec.fields import escapes_workspace, workspace_problem
from a4ray.spec.job import JobSpec
from a4ray.staging.display import Display, human_bytes
from a4ray.staging.service import get_service
from a4ray.staging.sources import source_for
from a4ray.staging.standins import make_all
from a4ray.staging.task import ArtifactOutcome, StageRequest

_SERVICE_RETRIES = 3  # new staging services to try when one dies under us (each resumes the partial downloads)


class StageResult(Result):
    kind: str = "stage"
    workspace: str
    duration_s: float
    artifacts: list[ArtifactOutcome]

    @classmethod
    def of(cls, workspace: str, duration_s: float, artifacts: list[ArtifactOutcome]) -> StageResult:
        ok = all(a.status != "failed" for a in artifacts)
        counts = {s: sum(a.status == s for a in artifacts) for s in ("ran", "joined", "cached", "failed")}
        summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        verdict = f"{'OK' if ok else 'FAILED'}: {len(artifacts)} artifact(s) ({summary}) in {duration_s:.1f}s"
        return cls(ok=ok, verdict=verdict, workspace=workspace, duration_s=duration_s, artifacts=artifacts)

    def table(self) -> str:
        rows = [[a.name, a.status, human_bytes(a.bytes) if a.status != "failed" else "-",
                 human_bytes(a.fetched_bytes) if a.status == "ran" else "-", f"{a.duration_s:.2f}s",
                 a.target] for a in self.artifacts]
        return table("staged artifacts", ["artifact", "status", "size", "fetched", "time", "target"], rows)


def resolve_target(workspace: Path, target: str) -> Path:
    path = Path(target)
    return path if path.is_absolute() else workspace / path


def _absolute_source(artifact: ArtifactSpec) -> ArtifactSpec:
    """Plain relative paths are relative to the local root (the directory a simulated cluster started in, else
    the driver's); the nodes need them absolute. Not the driver's own directory: a submitted job's driver runs
    in a temporary copy of its working_dir, and the same source must fingerprint the same however the job is
    started (or its target would look staged from elsewhere)."""
    ref = artifact.ref
    if ref.scheme == "file" and "://" not in artifact.source and not os.path.isabs(artifact.source):
        return artifact.model_copy(update={"source": os.path.normpath(local_root() / artifact.source)})
    return artifact


def make_standins(spec: JobSpec) -> str | None:
    """A local rehearsal's spec (`standins:`) stages tiny stand-ins: make them first (kept if current).
    Returns what was done, in a few words (None: the spec has no stand-ins)."""
    out = getattr(spec, "standins", None)
    if not out:
        return None
    t0 = time.monotonic()
    made = make_all(out)
    note = f"stand-ins in {(local_root() / out).resolve()} ({time.monotonic() - t0:.1f}s)"
    say(f"stage: {note}: {', '.join(made)}")
    return note


def _check_targets(spec: JobSpec | Sequence[ArtifactSpec], artifacts: list[ArtifactSpec], root: Path) -> None:
    """Every target resolves inside the workspace `root`, symlinks followed, or nothing is staged."""
    every = list(spec.artifacts if isinstance(spec, JobSpec) else spec)
    problems = [f"artifacts[{every.index(a)}].target: {a.target!r} resolves to {real}, outside the workspace {root}"
                for a in artifacts if (real := escapes_workspace(root, a.target)) is not None]
    if problems:
        raise SpecError(spec.source if isinstance(spec, JobSpec) else "<artifacts>", problems,
                        hint="stage into a directory inside the workspace (a symlink there leads out)")


class Staging:
    """The staging job: every artifact of a spec that lists them (`kind: stage`, or a recipe's stage step
    run alone with `a4ray stage -f`), or only the ones named, into the workspace or `workspace`."""

    cancel_note = " (partial downloads are kept and resumed by the next run)"

    def __init__(self, spec: JobSpec, *, only: Sequence[str] = (), workspace: str | None = None):
        self.spec, self.only, self.workspace = spec, list(only), workspace

    def check(self) -> None:
        spec = self.spec
        if not isinstance(spec, Staged):
            raise SpecError(spec.source, [f"kind: a {spec.kind!r} job stages nothing (no artifacts: section)"],
                            hint="pass a stage spec or a recipe, e.g. jobs/qwen3_next.yaml")
        if not spec.artifacts:
            raise SpecError(spec.source, ["artifacts: nothing to stage"],
                            hint="pass -f with a stage spec that lists artifacts, e.g. jobs/qwen3_next_local.yaml")
        _chosen(spec.artifacts, self.only)
        if self.workspace and (problem := workspace_problem(str(Path(self.workspace).absolute()))):
            raise SpecError("--workspace", [problem])

    def plan(self, workspace: str | None = None) -> str:
        return plan(self.spec)

    def run(self, conn: Connection, run_dir: RunDir) -> StageResult:
        make_standins(self.spec)  # as the pipeline's stage step does: a local spec stages on a fresh checkout
        return stage(self.spec, workspace=self.workspace, only=self.only, conn=conn, log_dir=run_dir.logs)


def _chosen(artifacts: Sequence[ArtifactSpec], only: Sequence[str]) -> list[ArtifactSpec]:
    unknown = set(only) - {a.name for a in artifacts}
    if unknown:
        raise StagingError(", ".join(sorted(unknown)), "no such artifact in the spec (known: "
                           + ", ".join(a.name for a in artifacts) + ")")
    return [a for a in artifacts if not only or a.name in only]


def stage(spec: JobSpec | Sequence[ArtifactSpec], *, workspace: str | Path | None = None,
          options: StagingOptions | None = None, only: Sequence[str] = (),
          display: Display | None = None, conn: Connection | None = None,
          log_dir: Path | None = None) -> StageResult:
    """Stage the artifacts of `spec` (any job that includes `Staged`) or a list of artifacts, on the cluster
    `conn` (default: the one this process is connected to: a job's driver, a notebook after `a4ray.connect()`).
    What the staging tasks print goes to `log_dir` (a run's logs), and to the stream by its rules.

    `workspace` overrides where targets are resolved (default: the spec's shared workspace on a real
    cluster, its local workspace on a simulated one). Raises `StagingFailed` (with `.result`) if any
    artifact failed.
    """
    if isinstance(spec, JobSpec):
        if not isinstance(spec, Staged):
            raise TypeError(f"job kind {spec.kind!r} has no artifacts to stage")
        artifacts, options = list(spec.artifacts), options or spec.staging
        cluster, storage, job = spec.cluster, spec.storage, spec.name
        timeout_s = spec.timeout_s
    else:
        artifacts, options = list(spec), options or StagingOptions()
        cluster, storage, job, timeout_s = ClusterSpec(nodes=1), StorageSpec(), "stage", None
    artifacts = _chosen(artifacts, only)
    started = time.monotonic()
    if not artifacts:
        return StageResult.of(str(workspace or ""), 0.0, [])
    conn = conn or attached()
    root = Path(workspace).resolve() if workspace else conn.workspace(storage)
    if conn.simulated:  # every simulated node shares this machine's disk: the workspace is ours to create
        root.mkdir(parents=True, exist_ok=True)
    _check_targets(spec, artifacts, root)
    logs = [stream.TaskLog.open(log_dir, f"stage {a.name}") for a in artifacts] if log_dir else []
    requests = [StageRequest(artifact=_absolute_source(a), options=options, workspace=str(root), job=job,
                             target=str(resolve_target(root, a.target)), log=str(logs[i].path) if logs else "")
                for i, a in enumerate(artifacts)]
    if cluster.nodes > 1:
        check_shared(root, options, job_nodes=cluster.nodes)
    try:
        outcomes = run_requests(requests, display or Display(), timeout_s=timeout_s)
    finally:
        stream.relay(logs)
    result = StageResult.of(str(root), time.monotonic() - started, outcomes)
    if not result.ok:
        failures = [o for o in outcomes if o.status == "failed"]
        raise StagingFailed("\n".join(o.error or f"artifact {o.name!r} failed" for o in failures), result=result)
    return result


def run_requests(requests: list[StageRequest], display: Display, *, timeout_s: float | None = None,
                 poll_s: float = 1.0) -> list[ArtifactOutcome]:
    """Send every request to the staging service and wait for all, showing progress. Outcomes in order."""
    outcomes: dict[int, ArtifactOutcome] = {}
    deadline = time.monotonic() + timeout_s if timeout_s else None
    pending = dict(enumerate(requests))
    for attempt in range(_SERVICE_RETRIES + 1):
        service = get_service()
        calls = {service.stage.remote(req): i for i, req in pending.items()}
        try:
            lost = _wait(service, calls, pending, outcomes, display, deadline, poll_s)
        except KeyboardInterrupt:
            for ref in calls:
                ray.cancel(ref)  # the service cancels a staging once nobody waits for it
            raise
        finally:
            display.close()
        if not lost:
            break
        next_step = "asking a new one" if attempt < _SERVICE_RETRIES else "giving up"
        say(f"the staging service was lost (Ray: {lost}); {next_step} "
            f"({len(pending)} artifact(s) resume from their partial downloads)")
    for i, req in pending.items():
        outcomes[i] = ArtifactOutcome(name=req.artifact.name, source=req.artifact.source, target=req.target,
                                      status="failed", error=f"artifact {req.artifact.name!r}: the staging "
                                      f"service died {_SERVICE_RETRIES + 1} times; what was downloaded is kept")
    return [outcomes[i] for i in range(len(requests))]


def _wait(service, calls: dict, pending: dict, outcomes: dict, display: Display, deadline: float | None,
          poll_s: float) -> str | None:
    """Collect outcomes until all calls are answered; Ray's word on why, if the service died first."""
    while calls:
        ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=poll_s)
        for ref in ready:
            i = calls.pop(ref)
            try:
                outcomes[i] = ray.get(ref)
            except ACTOR_GONE as e:
                return why_died(e)
            pending.pop(i)
        if calls:
            try:
                targets = [pending[i].target for i in calls.values()]
                display.show(ray.get(service.snapshot.remote(targets), timeout=30))
            except ACTOR_GONE as e:
                return why_died(e)
            except ray.exceptions.GetTimeoutError:
                pass
        if deadline is not None and time.monotonic() > deadline and calls:
            for ref in calls:
                ray.cancel(ref)
            names = ", ".join(pending[i].artifact.name for i in calls.values())
            raise StagingError(names, "staging ran past the job's timeout_s; the partial downloads are kept",
                               hint="raise timeout_s, or run again to resume")
    return None


# ------------------------------------------------------------------------------ shared storage


@ray.remote(num_cpus=0)
def _probe(path: str, token: str, mode: str) -> tuple[str, bool]:
    import socket

    probe = Path(path)
    if mode == "write":
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
        return socket.gethostname(), True
    if mode == "remove":
        probe.unlink(missing_ok=True)
        return socket.gethostname(), True
    try:
        return socket.gethostname(), probe.read_text() == token
    except OSError:
        return socket.gethostname(), False


def storage_nodes(options: StagingOptions) -> list[dict]:
    """Alive nodes that can run staging tasks (CPUs, and the label selector if one is set)."""
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0]
    wanted = options.node_labels
    return [n for n in nodes if all(n.get("Labels", {}).get(k) == v for k, v in wanted.items())]


def unshared_error(workspace: Path, writer: str, seen: list[tuple[str, bool]], job_nodes: int) -> StagingError | None:
    """The error to raise when nodes do not see a file another node wrote in the workspace, else None."""
    blind = [host for host, ok in seen if not ok]
    if not blind:
        return None
    return StagingError(
        "", f"the workspace {workspace} is not shared storage: a file written there on {writer} is not visible "
        f"on {', '.join(blind)}, and the job spans {job_nodes} nodes",
        hint="set storage.workspace to the mount every node shares (Filestore NFS, Managed Lustre, GCS FUSE), "
        "or run on one node (cluster.nodes=1)")


def check_shared(workspace: Path, options: StagingOptions, *, job_nodes: int) -> None:
    """Refuse to stage where the job's other nodes could not read it (once per workspace and node set)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = storage_nodes(options)
    ids = sorted(n["NodeID"] for n in nodes)
    if len(nodes) < 2 or _remembered(lambda service: service.shared_ok.remote(str(workspace), ids)):
        return
    token = uuid.uuid4().hex
    path = str(workspace / ".a4ray" / f"shared-probe-{token}")

    def on(node: dict):
        return _probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))

    def answer(ref):  # None: the node left the cluster after it was listed (Ray had not yet declared it dead)
        try:
            return ray.get(ref, timeout=120)
        except ray.exceptions.TaskUnschedulableError:
            return None

    for first, node in enumerate(nodes):
        wrote = answer(on(node).remote(path, token, "write"))
        if wrote is not None:
            break
    else:
        return  # no node left to ask
    writer, others = wrote[0], nodes[first + 1:]
    try:
        answers = [answer(ref) for ref in [on(n).remote(path, token, "read") for n in others]]
    finally:
        answer(on(node).remote(path, token, "remove"))
    error = unshared_error(workspace, writer, [a for a in answers if a is not None], job_nodes)
    if error:
        raise error
    if all(a is not None for a in answers) and first == 0:  # every listed node answered: this node set is checked
        _remembered(lambda service: service.mark_shared.remote(str(workspace), ids))


def _remembered(call):
    """Ask the staging service's memory of checked workspaces; a service that died meanwhile remembers nothing
    (the check is then made again), it does not fail the staging."""
    try:
        return ray.get(call(get_service()))
    except ACTOR_GONE:
        return None


# ------------------------------------------------------------------------------------ dry run


def plan(spec: JobSpec) -> str:
    """What `stage(spec)` would do, from the spec alone (no cluster, no network): for --dry-run."""
    assert isinstance(spec, Staged)
    o = spec.staging
    token = (f"token from {o.token_file} on the nodes" if o.token_file else
             "token from HF_TOKEN / HUGGING_FACE_HUB_TOKEN on the nodes (if set)")
    where = (f"workspace {spec.storage.workspace} (shared storage; on an embedded local cluster: "
             f"{spec.storage.local_workspace})")
    standins = getattr(spec, "standins", None)
    lines = [f"plan for job {spec.name!r} (stage): {len(spec.artifacts)} artifact(s) into {where}",
             *([f"first: make the tiny local stand-ins in {standins} (a4ray.staging.standins)"] if standins else []),
             f"one Ray task per artifact ({o.cpus:g} CPU, {o.max_workers} files in parallel, "
             f"{o.retries} retries if its worker or node dies"
             + (f", on nodes labelled {o.node_labels}" if o.node_labels else "") + "); exactly once per target "
             "through the staging service; published by atomic rename with a manifest",
             f"replace a different or modified target: {'yes' if o.replace else 'no (error)'}"]
    if spec.cluster.nodes > 1:
        lines.append(f"the job spans {spec.cluster.nodes} nodes: the workspace is checked to be shared first")
    for a in spec.artifacts:
        source = source_for(_absolute_source(a), o)
        lines.append(f"- {a.name}: {a.source}")
        lines.append(f"    -> <workspace>/{a.target}" if not a.target.startswith("/") else f"    -> {a.target}")
        lines.append(f"    {source.describe()}" + (f"; {token}" if source.uses_token else ""))
        for label, values in (("files", a.files), ("include", a.include), ("exclude", a.exclude)):
            if values:
                lines.append(f"    {label}: {', '.join(values)}")
        if a.sha256:
            lines.append(f"    sha256 given for: {', '.join(sorted(a.sha256))}")
    return "\n".join(lines)
