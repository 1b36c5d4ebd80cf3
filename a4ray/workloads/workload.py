"""What the nodes of a gang run. A workload = a command builder (per node) + an output parser + a typed
result; `Workload.run` is the attempt loop: the workload on a gang, again after a failure as the restart
policy allows (on the same gang where none of its nodes is lost or to be kept off)."""

from __future__ import annotations

import shlex
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel

from a4ray.core.console import say
from a4ray.core.errors import Cancelled, GangFailed
from a4ray.core.node_history import NodeHistory
from a4ray.core.redact import Redactor, secret_values
from a4ray.core.results import Result
from a4ray.core.rundir import RunDir
from a4ray.observe import metrics
from a4ray.observe.goodput import AttemptRecord, Goodput, LaunchTimes, Stopwatch, account
from a4ray.runtime.connect import Connection
from a4ray.runtime.gang import Gang
from a4ray.runtime.launch import GangResult, Launch, NodeContext, Peer
from a4ray.runtime.netenv import describe_env_plan
from a4ray.runtime.restart import blamed_nodes, keep_off, should_retry
from a4ray.spec.job import JobSpec

S = TypeVar("S", bound=JobSpec)


class WorkloadResult(Result):
    gang: GangResult | None = None
    goodput: Goodput | None = None  # where the run's wall time went, over every attempt

    def rows(self) -> list[dict[str, Any]]:
        """One row per node of the (last) launch."""
        if self.gang is None:
            return []
        return [{"node": n.gang_rank, "host": n.hostname, "ip": n.ip, "location": n.location, "status": n.status,
                 "exit_code": n.exit_code, "seconds": n.duration_s} for n in self.gang.nodes]


class NodePlan(BaseModel):
    rank: int
    argv: list[str]
    env: dict[str, str] = {}
    cwd: str | None = None


class Plan(BaseModel):
    """What a launch would do, computed from the spec alone (no cluster): for --dry-run."""

    job: str
    kind: str
    nodes: list[NodePlan]
    rank_order: str
    env: list[str]
    notes: list[str] = []

    def render(self) -> str:
        lines = [f"plan for job {self.job!r} ({self.kind}): {len(self.nodes)} node(s)",
                 f"rank order: {self.rank_order}", "env layers (later wins):"]
        lines += [f"  {line}" for line in self.env]
        for node in self.nodes:
            lines.append(f"node {node.rank}:")
            if node.cwd:
                lines.append(f"  cd {node.cwd}")
            lines.append("  " + (shlex.join(node.argv) if node.argv else "(standby: serves exec requests, "
                                 "e.g. mpirun's daemons, until the other nodes' commands end)"))
            if node.env:
                shown = Redactor(secret_values(node.env)).env(node.env)
                lines.append("  env: " + " ".join(f"{k}={v}" for k, v in shown.items()))
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


class Workload(ABC, Generic[S]):
    kind: ClassVar[str]
    cancel_note: ClassVar[str] = ""  # what a cancelled run keeps (said after "cancelled")

    def __init__(self, spec: S):
        self.spec = spec

    def check(self) -> None:
        """Refuse, before anything is launched, what the workload would reject later."""

    def resume_note(self) -> str:
        """On a restart: where the workload resumes from (e.g. "from checkpoint iteration 40"), or ""."""
        return ""

    @abstractmethod
    def launch(self, node: NodeContext) -> Launch:
        """The command one node runs."""

    def result(self, gang: GangResult) -> WorkloadResult:
        """The typed result, parsed from what the nodes reported (used by the default `execute`)."""
        raise NotImplementedError(f"{type(self).__name__}: override result() or execute()")

    def execute(self, gang: Gang) -> WorkloadResult:
        """Run the workload on a placed gang. One launch by default; a workload that needs several
        (one per collective, node pairs, ...) overrides this."""
        return self.result(run_launch(gang, self.launch, timeout_s=self.spec.timeout_s, env_name=self.spec.kind))

    def plan_contexts(self) -> list[NodeContext]:
        """Placeholder node contexts, computed from the spec alone (no cluster): for --dry-run."""
        c = self.spec.cluster
        peers = [Peer(rank=i, ip=f"<node-{i} ip>", hostname=f"<node-{i}>", actor=f"<node actor {i}>")
                 for i in range(c.nodes)]
        return [
            NodeContext(
                rank=rank, nnodes=c.nodes, gpus=c.gpus_per_node, master_addr="<node-0 ip>",
                master_port="<free port on node 0>", ip=f"<node-{rank} ip>", hostname=f"<node-{rank}>",
                log_dir="<run dir>/logs", run_dir="<run dir>", launch_id="<launch id>", peers=peers,
                ray_address="<ray address>", namespace="<namespace>", launcher=c.launcher,
                grace_s=c.stop_grace_s,
            )
            for rank in range(c.nodes)
        ]

    def run(self, conn: Connection, run_dir: RunDir, *, log_dir: Path | None = None) -> WorkloadResult:
        """The whole job on the connected cluster: `execute` on a gang, and again after a failure while
        `spec.restart` allows; each attempt gets `spec.timeout_s`. A restart relaunches on the same gang (its
        placement and node actors, already there) unless a node of it was lost, or is to be kept off (blamed, a
        straggler) and the cluster has another to take its place: then on a fresh gang, off those nodes. Logs go to `log_dir`
        (default: the run directory's `logs/`). A job that is not a gang launch (conversion: a cache check, Ray
        tasks) overrides this."""
        spec, attempt, gang = self.spec, 0, None
        history = NodeHistory(run_dir.workspace)
        # host -> why: the nodes the workspace's history blames (never again on them, cluster.keep_off_blamed), and
        # those the failed attempts are attributed to, and stragglers
        avoid: dict[str, str] = history.blamed() if spec.cluster.keep_off_blamed else {}
        started_at, attempts = time.time(), []  # the goodput accounting's: the run's start, each attempt's record
        try:
            while True:
                metrics.record_attempt(spec.name, run_dir.id, attempt)
                if gang is None:
                    gang = Gang(spec, log_dir=str(log_dir or run_dir.logs), run_dir=str(run_dir.root),
                                attempt=attempt, avoid=avoid)
                else:
                    gang.attempt = attempt
                if attempt:
                    note = self.resume_note()
                    say(f"attempt {attempt}/{spec.restart.max_restarts}: relaunching on "
                        f"{'the same gang' if gang.actors else 'a new gang'}" + (f"; {note}" if note else ""))
                live = _live_goodput(spec.name, run_dir.id, gang, attempt, attempts, started_at)
                with gang.observing(Stopwatch(on_progress=live)) as stopwatch:
                    result = self.execute(gang)
                if result.gang is None:
                    return result
                attempts.append(stopwatch.record(attempt, result.gang.times, result.gang.failure_kind,
                                                 result.gang.failure))
                history.served({n.host or n.hostname: n.duration_s for n in result.gang.nodes if n.duration_s},
                               run=run_dir.id)
                blamed = blamed_nodes(result.gang)
                for host, (event, why) in blamed.items():
                    history.add(host, event, run=run_dir.id, detail=why)
                for straggler in result.gang.stragglers:
                    history.add(straggler.node.host, "straggler", run=run_dir.id, detail=straggler.line())
                retry, why = should_retry(result.gang, spec.restart, attempt)
                if not retry:
                    if spec.restart.max_restarts or attempt:
                        say(f"not restarting: {why}")
                    result.goodput = account(attempts, started_at, time.time())
                    metrics.record_goodput(spec.name, run_dir.id, result.goodput.goodput, result.goodput.buckets)
                    if result.goodput.iterations is not None:  # a training run: where its time went, in one line
                        say(result.goodput.line())
                    return result
                leave = keep_off(result.gang, blamed)
                avoid.update(leave)
                if not gang.serves_again(result.gang, leave):
                    gang.close()
                    gang = None
                attempt += 1
                say(f"restarting in {spec.restart.backoff_s:g}s: {why}")
                time.sleep(spec.restart.backoff_s)
        finally:
            if gang is not None:
                gang.close()

    def plan(self, workspace: str | None = None) -> Plan:
        """What a launch would do, from the spec alone (nothing runs, no cluster): every node's command and env."""
        c = self.spec.cluster
        launches = [self.launch(ctx) for ctx in self.plan_contexts()]
        t = c.topology
        order = ("by IP" if t.order == "ip" else
                 f"by node labels {t.block_label}, {t.subblock_label}, {t.host_label}, then IP")
        env = describe_env_plan(self.spec.network, launches[0].env if launches else {},
                                self.spec.storage.compile_cache_env(workspace or self.spec.storage.workspace))
        return Plan(job=self.spec.name, kind=self.spec.kind, rank_order=order, env=env,
                    nodes=[NodePlan(rank=i, argv=launch.argv, env=launch.env, cwd=launch.cwd)
                           for i, launch in enumerate(launches)],
                    notes=[f"hang watchdog: {self.spec.observe.watchdog.rule()}"] + ([
                        f"spare nodes: {c.spare_nodes}, placed with the gang; each runs nothing and stands by, its "
                        "ranks warm, to take the place of a lost node (or one a restart keeps off)"]
                        if c.spare_nodes else []))


def _live_goodput(job: str, run: str, gang: Gang, attempt: int, attempts: list[AttemptRecord],
                  started_at: float):
    """What a Stopwatch calls as iterations come: the run's goodput so far, to the metrics (Grafana's panel). Until
    the launch ends its placement is not told apart from its startup, and its steps count as productive."""

    def update(stopwatch: Stopwatch) -> None:
        now = time.time()
        times = LaunchTimes(placing_at=gang.placing_at, ended_at=now)
        so_far = account([*attempts, stopwatch.record(attempt, times)], started_at, now)
        try:
            metrics.record_goodput(job, run, so_far.goodput, so_far.buckets)
        except Exception as e:  # noqa: BLE001 - a gauge must never stop the supervision of a training run
            if not failed:
                say(f"goodput gauges not updated: {type(e).__name__}: {e}")
            failed.append(e)

    failed: list[Exception] = []

    return update


def run_launch(gang: Gang, build, **kwargs) -> GangResult:
    """`gang.run(build, ...)`, with a failed launch returned as its (not ok) result instead of raised.
    Errors before anything ran (placement, gIB, env scripts) and cancellation still raise."""
    try:
        return gang.run(build, **kwargs)
    except GangFailed as failure:
        if failure.result is None or isinstance(failure, Cancelled):
            raise
        said = failure.result.failure_kind == "hang"  # the supervisor has said the verdict, whole, once
        say(f"FAILED: {failure.result.brief}" if said else f"FAILED: {failure}")
        return failure.result
