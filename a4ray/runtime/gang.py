"""The gang: one placement-group bundle and one NodeActor per node, launched and supervised as one.

Lifecycle (one owner, as in Ray Train's worker group):
  start  -> STRICT_SPREAD placement group of whole-node bundles, bounded wait, a clear error if the
            cluster cannot hold it; one NodeActor per bundle; node facts; rank order from topology;
            master = rank 0's IP, port chosen free on that node.
  run    -> every node launches its command (env built on the node); the driver streams every line
            with its node and rank; the first failure (non-zero exit, actor death, node loss), a
            timeout or a cancel stops every node's whole process tree, and the error names the node,
            its exit code and its last lines. A launch with no command is a standby: that node waits
            (serving exec requests, e.g. OpenMPI daemons started from node 0) and is stopped when
            every other node's command has ended. `run` may be called again, on all nodes or on a
            subset (a test of node pairs), with a fresh rendezvous port each time.
  close  -> actors killed, placement group removed.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import ray
from pydantic import BaseModel
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from a4ray.core.console import say
from a4ray.core.errors import A4RayError, Cancelled, GangFailed, GangHang, GangStartTimeout, GangTimeout
from a4ray.runtime.netenv import NEVER_OVERRIDE
from a4ray.observe import metrics
from a4ray.observe.progress import Progress
from a4ray.observe.stacks import summarize
from a4ray.runtime.node_actor import LaunchRequest, Line, NodeActor, NodeRun, Poll
from a4ray.runtime.topology import NodeFacts, rank_order
from a4ray.spec.job import JobSpec

_LAST_LINES = 20
# How long a node's long poll waits for news. Lines and the command's end answer at once; an idle node
# answers this often, which costs the driver ~1.5 ms of CPU a time: every second, that was most of a core
# at 512 nodes. The supervisor checks deadlines and hangs every second whatever the polls do.
_POLL_WAIT_S = 5.0
_LOST_CHECK_S = 10.0  # after a node fails: how long its peers have to show they are alive


class Peer(BaseModel):
    """One node of a launch, as the other nodes see it."""

    rank: int
    ip: str
    hostname: str
    actor: str  # the node actor's Ray name (in NodeContext.namespace)


class NodeContext(BaseModel):
    """What a workload needs to build one node's command. In a dry run the node values are placeholders."""

    rank: int
    nnodes: int
    gpus: int
    master_addr: str
    master_port: int | str
    ip: str
    hostname: str
    python: str = "python3"
    log_dir: str
    run_dir: str = ""
    launch_id: str = ""
    peers: list[Peer] = []  # every node of this launch, in rank order (peers[0] is the master)
    ray_address: str = ""  # the cluster's GCS address, for processes that reach the gang (the rsh agent)
    namespace: str = ""
    attempt: int = 0  # 0 = first launch; > 0: a restart, the workload should resume from its checkpoint
    launcher: str = "a4ray"  # cluster.launcher: what starts the node's ranks of a torchrun workload
    grace_s: float = 10.0  # cluster.stop_grace_s


class Launch(BaseModel):
    """One node's command. `nproc` > 0 marks a torchrun launch whose lines carry local-rank prefixes.

    An empty `argv` is a standby: the node builds its env and serves exec requests until the nodes
    with commands have ended. `env_scripts` are sourced on the node after gIB (e.g. DeepEP's env);
    `files` are written on the node before the command starts (e.g. an MPI hostfile).
    """

    argv: list[str]
    env: dict[str, str] = {}
    env_scripts: list[str] = []
    files: dict[str, str] = {}
    cwd: str | None = None
    nproc: int = 0

    @property
    def standby(self) -> bool:
        return not self.argv


class NodeResult(BaseModel):
    rank: int  # in this launch
    gang_rank: int  # in the gang (differs from `rank` when a launch runs on a subset of the nodes)
    hostname: str
    ip: str
    node_id: str
    location: str
    status: Literal["succeeded", "failed", "stopped", "lost", "not-started", "standby"]
    exit_code: int | None = None
    duration_s: float | None = None
    last_lines: list[str] = []
    records: list[dict] = []
    log_file: str = ""


FailureKind = Literal["failed", "lost", "hang", "timeout", "cancelled"]


class GangResult(BaseModel):
    job: str
    launch_id: str
    ok: bool
    failure: str | None = None
    failure_kind: FailureKind | None = None
    failed_node: int | None = None  # gang rank of the node that failed first
    attempt: int = 0
    iterations_seen: int = 0  # iteration lines seen in this launch (progress made)
    last_iteration: int | None = None
    hang_report: str | None = None  # directory with every rank's stack dump and a summary
    start_s: float = 0.0  # placement + actors + facts
    run_s: float = 0.0
    log_dir: str = ""
    nodes: list[NodeResult] = []

    @property
    def records(self) -> list[dict]:
        return [r for node in self.nodes for r in node.records]


LineObserver = Callable[[int, Line], None]

# One Ray actor class for every gang of this process: Ray exports a class to the cluster (pickled, and
# disassembled for a name-collision check, ~0.06 s of driver CPU) the first time each class object is used
# in a job; a fresh ray.remote(NodeActor) per gang repeated that on every launch.
_REMOTE_NODE_ACTOR = ray.remote(NodeActor)


class Gang:
    def __init__(self, spec: JobSpec, *, log_dir: str, run_dir: str = "", name: str | None = None,
                 attempt: int = 0):
        self.spec = spec
        self.cluster = spec.cluster
        self.log_dir = log_dir
        self.run_dir = run_dir
        self.attempt = attempt
        self.launch_id = uuid.uuid4().hex[:12]
        self.name = name or f"a4ray-{spec.name}-{self.launch_id}"
        self.pg = None
        self.actors: list = []  # in rank order once started
        self.actor_names: list[str] = []  # in rank order
        self.nodes: list[NodeFacts] = []  # in rank order
        self.master_port: int | None = None  # of the latest launch
        self.start_s = 0.0
        self.observers: list[LineObserver] = []
        self._runs = 0

    # ------------------------------------------------------------------------------------ start
    def start(self) -> list[NodeFacts]:
        if self.actors:
            return self.nodes
        t0 = time.monotonic()
        c = self.cluster
        bundle = {"CPU": c.cpus_per_node, "GPU": c.gpus_per_node, c.node_resource: 1}
        self.pg = placement_group([dict(bundle)] * c.nodes, strategy="STRICT_SPREAD", name=self.name)
        ready, _ = ray.wait([self.pg.ready()], timeout=c.start_timeout_s)
        if not ready:
            message = explain_unplaceable(self.spec, self.name)
            self.close()
            raise GangStartTimeout(
                message, hint="add nodes, lower cluster.nodes / cluster.gpus_per_node, or raise "
                "cluster.start_timeout_s if nodes are still being added",
            )
        actors = [
            _REMOTE_NODE_ACTOR.options(
                num_cpus=c.cpus_per_node, num_gpus=c.gpus_per_node, resources={c.node_resource: 1},
                max_concurrency=8, name=f"{self.name}-{i}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote()
            for i in range(c.nodes)
        ]
        facts = ray.get([a.facts.remote() for a in actors], timeout=max(60.0, c.start_timeout_s))
        ordered = rank_order(facts, c.topology)
        by_id = {f.node_id: (a, f"{self.name}-{i}") for i, (f, a) in enumerate(zip(facts, actors))}
        self.nodes = ordered
        self.actors = [by_id[f.node_id][0] for f in ordered]
        self.actor_names = [by_id[f.node_id][1] for f in ordered]
        self.start_s = time.monotonic() - t0
        say(f"gang {self.name}: {c.nodes} nodes x {c.gpus_per_node} GPUs placed in {self.start_s:.1f}s; "
            f"master {self.nodes[0].ip}")
        for rank, node in enumerate(self.nodes):
            say(f"  node {rank}: {node.describe(c.topology)} gpus={','.join(node.gpu_ids) or '-'}")
        return self.nodes

    def context(self, rank: int, members: list[int] | None = None, *, master_port: int | None = None,
                log_dir: str | None = None, launch_id: str | None = None) -> NodeContext:
        """The context of launch rank `rank` in a launch on `members` (gang ranks; default: all nodes)."""
        members = list(range(len(self.nodes))) if members is None else members
        node = self.nodes[members[rank]]
        ctx = ray.get_runtime_context()
        peers = [Peer(rank=i, ip=self.nodes[g].ip, hostname=self.nodes[g].hostname, actor=self.actor_names[g])
                 for i, g in enumerate(members)]
        return NodeContext(
            rank=rank, nnodes=len(members), gpus=self.cluster.gpus_per_node,
            master_addr=peers[0].ip, master_port=master_port or self.master_port or 0, ip=node.ip,
            hostname=node.hostname, python=node.python, log_dir=log_dir or self.log_dir, run_dir=self.run_dir,
            launch_id=launch_id or self.launch_id, peers=peers, ray_address=ctx.gcs_address,
            namespace=ctx.namespace or "", attempt=self.attempt, launcher=self.cluster.launcher,
            grace_s=self.cluster.stop_grace_s,
        )

    @contextlib.contextmanager
    def observing(self, observer: LineObserver):
        """Feed every streamed line to `observer` (launch rank, line) while the block runs."""
        self.observers.append(observer)
        try:
            yield observer
        finally:
            self.observers.remove(observer)

    def executables(self, names: list[str]) -> list[dict[str, str | None]]:
        """`names` resolved on every node (absolute paths checked, others looked up on PATH), in rank order."""
        if not self.actors:
            self.start()
        return ray.get([a.executables.remote(names) for a in self.actors], timeout=60)

    # -------------------------------------------------------------------------------------- run
    def run(self, build: Callable[[NodeContext], Launch], *, timeout_s: float | None = None,
            env_name: str = "workload", nodes: list[int] | None = None,
            log_dir: str | None = None) -> GangResult:
        """Launch `build(node)` on every node (or on `nodes`, gang ranks in launch-rank order) and
        supervise until all commands end, one fails, or time runs out."""
        if not self.actors:
            self.start()
        members = list(range(len(self.nodes))) if nodes is None else list(nodes)
        if not members or len(set(members)) != len(members) or not all(0 <= g < len(self.nodes) for g in members):
            raise ValueError(f"nodes={nodes}: need distinct gang ranks in 0..{len(self.nodes) - 1}")
        log_dir = log_dir or self.log_dir
        launch_id = f"{self.launch_id}-r{self._runs}"
        self._runs += 1
        self.master_port = ray.get(self.actors[members[0]].free_port.remote(), timeout=60)
        launches = [build(self.context(rank, members, master_port=self.master_port, log_dir=log_dir,
                                       launch_id=launch_id))
                    for rank in range(len(members))]
        if all(launch.standby for launch in launches):
            raise ValueError("every launch is a standby: at least one node needs a command")
        t0 = time.monotonic()
        requests = [
            LaunchRequest(
                argv=launch.argv, cwd=launch.cwd, env=launch.env, env_scripts=launch.env_scripts,
                files=launch.files, network=self.spec.network, node_rank=rank, nproc=launch.nproc,
                log_dir=log_dir, launch_id=f"{launch_id}-n{rank}", grace_s=self.cluster.stop_grace_s,
                attempt=self.attempt, metric_tags={"job": self.spec.name, "run": self.run_id},
                seq_length=self.spec.observe.seq_length,
                flight_recorder=self.spec.observe.watchdog.enabled and self.spec.observe.watchdog.flight_recorder,
            )
            for rank, launch in enumerate(launches)
        ]
        actors = [self.actors[g] for g in members]
        try:
            infos = ray.get([a.launch.remote(r, env_name) for a, r in zip(actors, requests)])
        except ray.exceptions.RayTaskError as e:
            self._stop(members)  # the nodes that did start must not run on alone
            if isinstance(e.cause, A4RayError):
                raise e.cause from None
            raise
        for rank, info in enumerate(infos):
            say(f"[n{members[rank]}] env ({len(info.env_report)} set by a4ray, secrets masked): "
                + "; ".join(info.env_report))
        if nodes is not None or any(launch.standby for launch in launches):
            say(f"launch {launch_id}: nodes {members}" + "".join(
                f"; n{members[r]} standby" for r, launch in enumerate(launches) if launch.standby))
        outcome = _Supervisor(self, members, launches, timeout_s).watch()
        result = self._collect(members, outcome, time.monotonic() - t0, log_dir, launch_id)
        if not result.ok:
            error_cls = {"timeout": GangTimeout, "cancelled": Cancelled, "hang": GangHang}.get(outcome.kind, GangFailed)
            raise error_cls(result.failure or "the gang failed", result=result, hint=outcome.hint)
        return result

    def _collect(self, members: list[int], outcome: _Outcome, run_s: float, log_dir: str,
                 launch_id: str) -> GangResult:
        # Every node is asked at once, with one bound for all: a round trip per node, one after another,
        # would add up on hundreds of nodes.
        asked = {rank: self.actors[g].result.remote() for rank, g in enumerate(members) if rank not in outcome.lost}
        if asked:
            ray.wait(list(asked.values()), num_returns=len(asked), timeout=60)
        nodes = []
        for rank, g in enumerate(members):
            facts = self.nodes[g]
            base = dict(rank=rank, gang_rank=g, hostname=facts.hostname, ip=facts.ip, node_id=facts.node_id,
                        location="/".join(p for p in facts.location(self.cluster.topology) if p))
            if rank in outcome.lost:
                nodes.append(NodeResult(**base, status="lost", last_lines=outcome.tails.get(rank, [])))
                continue
            try:
                run: NodeRun = ray.get(asked[rank], timeout=0)
            except Exception:  # noqa: BLE001 - a node that cannot answer now is as good as lost
                nodes.append(NodeResult(**base, status="lost", last_lines=outcome.tails.get(rank, [])))
                continue
            # A process a4ray stopped is "stopped" whatever its exit code (bash may exit 0 on SIGTERM).
            status = ("standby" if run.standby else "stopped" if run.stopped else
                      "succeeded" if run.exit_code == 0 else "failed")
            duration = (run.ended_at - run.started_at) if run.ended_at and run.started_at else None
            nodes.append(NodeResult(**base, status=status, exit_code=run.exit_code, duration_s=duration,
                                    last_lines=run.last_lines[-_LAST_LINES:], records=run.records,
                                    log_file=run.log_file))
        ok = outcome.kind == "done" and all(n.status in ("succeeded", "standby") for n in nodes)
        failure = outcome.message if not ok else None
        if not ok and failure is None:
            failed = next(n for n in nodes if n.status not in ("succeeded", "standby"))
            failure = f"node {failed.gang_rank} ({failed.hostname}) ended with status {failed.status}"
        return GangResult(
            job=self.spec.name, launch_id=launch_id, ok=ok, failure=failure, start_s=self.start_s, run_s=run_s,
            log_dir=log_dir, nodes=nodes, attempt=self.attempt,
            failure_kind=None if ok else ("failed" if outcome.kind == "done" else outcome.kind),
            failed_node=None if outcome.failed_node is None else members[outcome.failed_node],
            iterations_seen=outcome.iterations_seen, last_iteration=outcome.last_iteration,
            hang_report=outcome.hang_report,
        )

    @property
    def run_id(self) -> str:
        return Path(self.run_dir).name if self.run_dir else self.launch_id

    def stop(self, grace_s: float | None = None, skip: set[int] = frozenset()) -> None:
        """Stop every node's process trees in parallel (SIGTERM, bounded wait, SIGKILL); `skip`: gang ranks."""
        self._stop([g for g in range(len(self.actors)) if g not in skip], grace_s)

    def _stop(self, ranks: list[int], grace_s: float | None = None) -> None:
        grace = self.cluster.stop_grace_s if grace_s is None else grace_s
        refs = [self.actors[g].stop.remote(grace) for g in ranks]
        if not refs:
            return
        try:
            ray.wait(refs, num_returns=len(refs), timeout=grace + 30)
        except Exception:  # noqa: BLE001 - stopping is best effort; the reapers finish the job
            pass

    def close(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor)  # the reaper of any launch still running kills its process tree
            except Exception:  # noqa: BLE001
                pass
        self.actors = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
            self.pg = None

    def __enter__(self) -> Gang:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Outcome:
    def __init__(self) -> None:
        self.kind: Literal["done", "failed", "lost", "hang", "timeout", "cancelled"] = "done"
        self.message: str | None = None
        self.hint: str | None = None
        self.failed_node: int | None = None  # launch rank
        self.lost: set[int] = set()
        self.stopped: set[int] = set()
        self.tails: dict[int, list[str]] = {}
        self.iterations_seen = 0
        self.last_iteration: int | None = None
        self.hang_report: str | None = None


class _Supervisor:
    """Streams every node's lines to the driver and ends the launch on the first failure.

    Ranks here are launch ranks; `members[rank]` is the node's gang rank, used in what is printed so a
    node keeps one name across launches.
    """

    def __init__(self, gang: Gang, members: list[int], launches: list[Launch], timeout_s: float | None):
        self.gang = gang
        self.members = members
        self.actors = [gang.actors[g] for g in members]
        self.nproc = [launch.nproc for launch in launches]
        self.standby = {rank for rank, launch in enumerate(launches) if launch.standby}
        self.deadline = time.monotonic() + timeout_s if timeout_s else None
        self.timeout_s = timeout_s
        self.cursors = {rank: 0 for rank in range(len(members))}
        self.rank_tails: dict[tuple[int, int], list[str]] = {}
        self.outcome = _Outcome()
        self.observe = gang.spec.observe
        self.started_at = self.last_output_at = time.monotonic()
        self.last_progress_at: float | None = None
        self.last_summary_iteration: int | None = None

    def _emit(self, rank: int, poll: Poll) -> None:
        node = self.members[rank]
        if poll.dropped:
            say(f"[n{node}] ... {poll.dropped} lines not streamed (driver fell behind); "
                f"they are in the node log")
        tail = self.outcome.tails.setdefault(rank, [])
        for line in poll.lines:
            if line.local_rank is not None:
                print(f"[n{node} r{rank * self.nproc[rank] + line.local_rank}] {line.text}", flush=True)
                rank_tail = self.rank_tails.setdefault((rank, line.local_rank), [])
                rank_tail.append(line.text)
                del rank_tail[:-_LAST_LINES]
            else:
                print(f"[n{node}] {line.text}", flush=True)
            for observer in self.gang.observers:
                observer(rank, line)
            if line.progress is not None:
                self._on_progress(line.progress)
            tail.append(line.text)
        del tail[:-_LAST_LINES]
        if poll.lines:
            self.last_output_at = time.monotonic()
        self.cursors[rank] = poll.cursor

    def _on_progress(self, progress: Progress) -> None:
        out = self.outcome
        self.last_progress_at = time.monotonic()
        if out.last_iteration is None or progress.iteration > out.last_iteration:
            out.iterations_seen += 1
            out.last_iteration = progress.iteration
            every = self.observe.summary_every
            if (self.last_summary_iteration is None or progress.iteration - self.last_summary_iteration >= every
                    or progress.iteration == progress.train_iters):
                self.last_summary_iteration = progress.iteration
                say(f"progress: {progress_summary(progress, self.observe.seq_length)}")

    def _hang(self) -> str | None:
        """Why the launch looks hung, or None."""
        w = self.observe.watchdog
        if not w.enabled:
            return None
        now = time.monotonic()
        if self.last_progress_at is not None:
            if w.no_progress_s and now - self.last_progress_at > w.no_progress_s:
                return (f"no new iteration for {now - self.last_progress_at:.0f}s (after iteration "
                        f"{self.outcome.last_iteration}; observe.watchdog.no_progress_s={w.no_progress_s:g})")
        elif w.startup_s and now - self.started_at > w.startup_s:
            return f"no iteration line in the first {w.startup_s:g}s (observe.watchdog.startup_s)"
        if w.no_output_s and now - self.last_output_at > w.no_output_s:
            return f"no output from any node for {now - self.last_output_at:.0f}s (observe.watchdog.no_output_s)"
        return None

    def _forensics(self, why: str) -> None:
        """Stack dumps of every rank on every node, written to the run directory with a summary."""
        gang, out = self.gang, self.outcome
        say(f"hang detected: {why}; collecting the stacks of every rank")
        metrics.record_hang(gang.spec.name, gang.run_id)
        base = Path(gang.run_dir or Path(gang.log_dir).parent)
        report = base / (f"hang-attempt-{gang.attempt}" if gang.attempt else "hang")
        report.mkdir(parents=True, exist_ok=True)
        dumps = []
        if self.observe.watchdog.py_spy:
            refs = {a.stacks.remote(): rank for rank, a in enumerate(self.actors)}
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=120)
            for ref in ready:
                try:
                    dumps += ray.get(ref)
                except Exception as e:  # noqa: BLE001 - a node that cannot answer is named in the summary
                    say(f"  node {self.members[refs[ref]]}: no stacks ({type(e).__name__})")
        for d in dumps:
            name = f"rank-{int(d.rank):04d}.txt" if d.rank.isdigit() else f"{d.rank.replace(':', '-')}.txt"
            (report / name).write_text(d.text + (f"\n# py-spy error: {d.error}\n" if d.error else ""))
        summary = summarize(dumps) if dumps else "no stacks collected (observe.watchdog.py_spy is off)"
        (report / "summary.txt").write_text(f"{why}\n{summary}\n")
        say(f"stacks: {summary}")
        say(f"hang report: {report}")
        out.kind, out.hang_report = "hang", str(report)
        out.message = f"the launch hung: {why}; {summary}"
        out.hint = f"stack dumps of every rank are in {report}"

    def watch(self) -> _Outcome:
        out = self.outcome
        pending = {a.poll.remote(0, _POLL_WAIT_S): rank for rank, a in enumerate(self.actors)}
        try:
            # Standby nodes never end by themselves: the launch is over when every command has ended.
            while any(rank not in self.standby for rank in pending.values()):
                wait_s = 1.0 if self.deadline is None else max(0.0, min(1.0, self.deadline - time.monotonic()))
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
                for ref in ready:
                    rank = pending.pop(ref)
                    try:
                        poll: Poll = ray.get(ref)
                    except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
                        self._fail(rank, "lost", self._lost(rank, f"its node actor died ({type(e).__name__}); "
                                   "the node was removed, ran out of memory or was killed"))
                        return self._finish(pending)
                    self._emit(rank, poll)
                    if poll.running:
                        pending[self.actors[rank].poll.remote(poll.cursor, _POLL_WAIT_S)] = rank
                    elif poll.exit_code not in (0, None):
                        failed = (f"node {self.members[rank]} ({self._where(rank)}) exited with code "
                                  f"{poll.exit_code}{_signal_name(poll.exit_code)}")
                        lost = self._lost_among(sorted(set(pending.values())))
                        if lost is None:
                            self._fail(rank, "failed", failed)
                        else:  # the failure was the echo of a lost peer (a collective's peer vanished)
                            self._fail(lost, "lost", self._lost(lost, f"its node actor died; {failed} after it"))
                        return self._finish(pending)
                why = self._hang() if pending else None
                if why:
                    self._forensics(why)
                    return self._finish(pending)
                if self.deadline is not None and time.monotonic() >= self.deadline and pending:
                    out.kind, out.message = "timeout", f"the launch ran past its timeout ({self.timeout_s:g}s)"
                    out.hint = "raise timeout_s in the spec if the job needs longer"
                    return self._finish(pending)
        except KeyboardInterrupt:
            out.kind, out.message = "cancelled", "cancelled (Ctrl-C or `ray job stop`)"
            return self._finish(pending)
        if pending:  # the standby nodes: their exec'd commands (MPI daemons) end with the launch
            self.gang._stop([self.members[rank] for rank in pending.values()])
        return out

    def _lost_among(self, ranks: list[int]) -> int | None:
        """The first of `ranks` whose node actor is gone. When a node dies, its peers' collectives fail
        within milliseconds, often before Ray reports the node: the lost node is the root cause."""
        refs = {self.actors[rank].alive.remote(): rank for rank in ranks}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=_LOST_CHECK_S)
        for ref in ready:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
                return refs[ref]
        return None

    def _lost(self, rank: int, why: str) -> str:
        return f"node {self.members[rank]} ({self._where(rank)}) was lost: {why}"

    def _where(self, rank: int) -> str:
        return self.gang.nodes[self.members[rank]].describe(self.gang.cluster.topology)

    def _fail(self, rank: int, kind: str, message: str) -> None:
        out = self.outcome
        out.kind = kind  # type: ignore[assignment]
        out.failed_node = rank
        if kind == "lost":
            out.lost.add(rank)
        tail = out.tails.get(rank, [])
        cause = _root_cause(tail) if self.nproc[rank] else None
        if cause and (rank, cause[1]) in self.rank_tails:
            global_rank, local_rank, code = cause
            message += f": rank {global_rank} (local rank {local_rank}) failed first, with exit code {code}"
            tail = self.rank_tails[(rank, local_rank)]
            message += f"; last lines of rank {global_rank}"
        else:
            message += "; last lines"
        out.message = message + (":\n" + "\n".join(f"    {t}" for t in tail[-_LAST_LINES:]) if tail else "")

    def _finish(self, pending: dict) -> _Outcome:
        """Stop every still-running node, then drain the lines they printed while stopping."""
        out = self.outcome
        running = set(pending.values())
        out.stopped = running - self.standby
        say(f"stopping {len(running)} node(s): {out.message.splitlines()[0] if out.message else ''}")
        self.gang._stop([self.members[rank] for rank in sorted(running - out.lost)])
        for rank in sorted(running - out.lost):
            try:
                poll = ray.get(self.actors[rank].poll.remote(self.cursors[rank], 0.0), timeout=30)
                self._emit(rank, poll)
            except Exception:  # noqa: BLE001 - an actor that died while stopping is reported as lost
                out.lost.add(rank)
        return out


_ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_ROOT_CAUSE_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def _root_cause(lines: list[str]) -> tuple[int, int, int] | None:
    """(global rank, local rank, exit code) from the "Root Cause (first observed failure)" report that torchrun
    and a4ray.runtime.ranks print."""
    try:
        start = max(i for i, line in enumerate(lines) if "Root Cause" in line)
    except ValueError:
        return None
    rank = code = None
    for line in lines[start:]:
        if rank is None and (m := _ROOT_CAUSE_RANK.match(line)):
            rank = (int(m.group(1)), int(m.group(2)))
        elif code is None and (m := _ROOT_CAUSE_CODE.match(line)):
            code = int(m.group(1))
    return (*rank, code) if rank and code is not None else None


def progress_summary(p: Progress, seq_length: int | None = None) -> str:
    parts = [f"iteration {p.iteration}/{p.train_iters}"]
    if p.step_time_ms is not None:
        parts.append(f"{p.step_time_ms / 1000:.3g} s/it")
    tokens = p.tokens_per_second(seq_length)
    if tokens is not None:
        parts.append(f"{tokens:,.0f} tokens/s")
    if p.loss is not None:
        parts.append(f"loss {p.loss:.4g}")
    if p.tflops_per_gpu is not None:
        parts.append(f"{p.tflops_per_gpu:.1f} TFLOP/s/GPU")
    if p.grad_norm is not None:
        parts.append(f"grad norm {p.grad_norm:.3g}")
    return " | ".join(parts)


def _signal_name(code: int) -> str:
    import signal as _signal

    if code < 0:
        try:
            return f" (killed by {_signal.Signals(-code).name})"
        except ValueError:
            return ""
    return ""


def explain_unplaceable(spec: JobSpec, pg_name: str) -> str:
    """Why the gang could not be placed: what it needs against what the cluster has."""
    c = spec.cluster
    need = (f"the gang needs {c.nodes} node(s) with resource '{c.node_resource}' and {c.gpus_per_node} "
            f"GPU(s) each, one per node")
    alive = [n for n in ray.nodes() if n.get("Alive")]
    typed = [n for n in alive if n["Resources"].get(c.node_resource, 0) >= 1]
    fitting = [n for n in typed if n["Resources"].get("GPU", 0) >= c.gpus_per_node]
    parts = [f"{n['NodeManagerAddress']}: {int(n['Resources'].get('GPU', 0))} GPUs" for n in typed[:8]]
    have = (f"the cluster has {len(typed)} such node(s)" + (f" ({', '.join(parts)}"
            f"{', ...' if len(typed) > 8 else ''})" if parts else "")
            + (f", {len(fitting)} with enough GPUs" if len(fitting) != len(typed) else ""))
    others = [pg for pg in placement_group_table().values()
              if pg.get("name", "").startswith("a4ray-") and pg.get("name") != pg_name
              and pg.get("state") == "CREATED"]
    busy = f"; {len(others)} other a4ray gang(s) hold nodes now" if others else ""
    return (f"gang not placed within cluster.start_timeout_s={c.start_timeout_s:g}s: {need}; "
            f"{have} of {len(alive)} alive node(s){busy}")


def describe_env_plan(spec: JobSpec, workload_env: dict[str, str]) -> list[str]:
    """The env a launch would get, layer by layer, for a dry run (nothing is sourced)."""
    net = spec.network
    lines = []
    if net.gib == "off":
        lines.append("gib: off")
    else:
        lines.append(f"gib ({net.gib}): source {net.gib_script} on each node"
                     + (" (fail if missing)" if net.gib == "on" else " (skip where missing)"))
        lines += [f"  {k}={v}" for k, v in net.gib_overrides.items()]
        lines.append(f"  LD_LIBRARY_PATH={net.gib_lib_dir}:<node's LD_LIBRARY_PATH>")
    lines.append("a4ray: PYTHONUNBUFFERED=1 A4RAY_NODE_RANK=<rank> A4RAY_ATTEMPT=<n> A4RAY_LAUNCH_ID=<id>")
    from a4ray.core.redact import Redactor, secret_values

    for layer, env in (("workload", workload_env), ("user (network.env)", net.env)):
        shown = Redactor(secret_values(env)).env(env)
        lines.append(f"{layer}: " + (" ".join(f"{k}={v}" for k, v in shown.items()) or "-"))
    lines.append(f"never overridden where the node sets them: {', '.join(NEVER_OVERRIDE)}")
    return lines
