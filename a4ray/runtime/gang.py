"""The gang: one placement-group bundle and one NodeActor per node, placed, launched and closed as one.

Lifecycle (one owner, as in Ray Train's worker group):
  start  -> STRICT_SPREAD placement group of whole-node bundles, bounded wait, a clear error if the
            cluster cannot hold it; rank order from the topology of the nodes the bundles landed on; one
            NodeActor per bundle, named `<run>-<step>-n<rank>` in that order; node facts; master = rank 0's
            IP, port chosen free on that node.
  run    -> every node launches its command (`launch.Launch`, env built on the node), and the launch is
            handed to a `supervisor.Supervisor`, which streams every line and ends it on the first
            failure, a hang, a timeout or a cancel; the gang then stops every node's whole process tree.
            A launch with no command is a standby: that node waits (serving exec requests, e.g. OpenMPI
            daemons started from node 0) and is stopped when every other node's command has ended. `run`
            may be called again, on all nodes or on a subset (a test of node pairs), with a fresh
            rendezvous port each time.
  spares -> `cluster.spare_nodes` more bundles and actors, the last in rank order, run nothing: each stands by
            with the next attempt's launcher, its ranks warm (`node_actor`). When a node is lost, or is to be
            kept off, the next attempt runs on the same gang with a spare in its place (the launch ranks stay in
            topology order: the members are kept in their nodes' rank order): no new placement, no cold ranks.
            Ray places a lost node's bundle again where a node fits it (KubeRay's recreated pod, a repaired
            machine); while a launch runs, the gang starts a node actor there, a spare again, warmed like the
            others: spares last through more than one loss.
  close  -> actors end themselves (killed only if stuck), placement group removed.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import ray
from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
from ray._raylet import GcsClient
from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from a4ray.core.console import say
from a4ray.core.errors import (
    A4RayError,
    Cancelled,
    GangFailed,
    GangHang,
    GangStartTimeout,
    GangTimeout,
    GangUnplaceable,
)
from a4ray.core.rundir import RunDir
from a4ray.observe.verdicts import NodeRef
from a4ray.runtime.deaths import ACTOR_GONE
from a4ray.runtime.launch import GangResult, Launch, NodeContext, NodeResult, Peer
from a4ray.runtime.netenv import summarize_reports
from a4ray.runtime.node_actor import LaunchRequest, NodeActor, NodeIdentity, NodeRun
from a4ray.runtime.simulated import SIMULATED_LABEL
from a4ray.runtime.supervisor import LAST_LINES, LineObserver, Outcome, Supervisor
from a4ray.runtime.topology import NodeFacts, rank_order
from a4ray.spec.job import JobSpec

# One Ray actor class for every gang of this process: Ray exports a class to the cluster (pickled, and
# disassembled for a name-collision check, ~0.06 s of driver CPU) the first time each class object is used
# in a job; a fresh ray.remote(NodeActor) per gang repeated that on every launch.
_REMOTE_NODE_ACTOR = ray.remote(NodeActor)
_PLACE_POLL_S = 2.0  # how often a waiting gang asks whether the cluster could ever hold it
_STATUS_STALE_S = 60.0  # an autoscaler status older than this is no autoscaler's
_END_WAIT_S = 10.0  # how long closing waits for node actors to end themselves before killing them
_RESTORE_POLL_S = 5.0  # while a launch runs, how often the gang looks for a lost node's bundle placed again


class Gang:
    def __init__(self, spec: JobSpec, *, log_dir: str, run_dir: str = "", name: str | None = None,
                 attempt: int = 0, avoid: dict[str, str] | None = None):
        self.spec = spec
        self.avoid = dict(avoid or {})  # host -> why: nodes to keep this gang off (a restart after their failure)
        self.cluster = spec.cluster
        self.log_dir = log_dir
        self.run_dir = run_dir
        self.attempt = attempt
        self.launch_id = uuid.uuid4().hex[:12]
        self.name = name or f"a4ray-{spec.name}-{self.launch_id}"
        self.pg = None
        self.actors: list = []  # in rank order once started
        self.actor_names: list[str] = []  # in rank order
        self.bundles: list[int] = []  # gang rank -> its placement-group bundle
        self.nodes: list[NodeFacts] = []  # in rank order: the members and the spares
        self.members: list[int] = []  # the gang ranks a launch runs on by default, in launch-rank order
        self.left: dict[int, str] = {}  # gang rank -> why it left the members: lost, or kept off
        self.master_port: int | None = None  # of the latest launch
        self.start_s = 0.0
        self.placing_at: float | None = None  # wall clock: when the placement group was asked for
        self.observers: list[LineObserver] = []
        self._runs = 0
        self._restored = 0  # node actors started again in lost nodes' bundles

    # ------------------------------------------------------------------------------------ start
    def start(self) -> list[NodeFacts]:
        if self.actors:
            return self.nodes
        t0, self.placing_at = time.monotonic(), time.time()
        c = self.cluster
        bundle = {"CPU": c.cpus_per_node, "GPU": c.gpus_per_node, c.node_resource: 1}
        selector = None
        if self.avoid:
            can, selector, line = self.keep_off(self.avoid)
            say(f"gang {self.name}: {line}" + ("" if can else f"; placing the gang on the nodes there are, "
                                               f"{'that one' if len(self.avoid) == 1 else 'those'} included"))
        size = c.placed_nodes
        self.pg = placement_group([dict(bundle)] * size, strategy="STRICT_SPREAD", name=self.name,
                                  bundle_label_selector=[dict(selector)] * size if selector else None)
        self._wait_placed(t0)
        # The rank order is known from where the bundles landed, before any actor exists, so that each actor is
        # created with its node rank in its name (a Ray actor's name is fixed at creation) and its __repr__.
        planned = placed_nodes(self.pg)  # bundle index -> the node's facts as Ray's node table has them
        bundle_of = {facts.node_id: bundle for bundle, facts in planned.items()}  # STRICT_SPREAD: one per node
        order = [bundle_of[facts.node_id] for facts in rank_order(list(planned.values()), c.topology)]
        self.actor_names = [self.actor_name(rank) for rank in range(size)]
        self.bundles = order
        self.actors = [self._node_actor(rank, planned[bundle]) for rank, bundle in enumerate(order)]
        self.nodes = ray.get([a.facts.remote() for a in self.actors], timeout=max(60.0, c.start_timeout_s))
        self.members = list(range(c.nodes))
        self.start_s = time.monotonic() - t0
        spares = f" and {c.spare_nodes} spare(s)" if c.spare_nodes else ""
        say(f"gang {self.name}: {c.nodes} nodes{spares} x {c.gpus_per_node} GPUs placed in {self.start_s:.1f}s; "
            f"master {self.nodes[0].ip}")
        for rank, node in enumerate(self.nodes):
            say(f"  node {rank}: {node.describe(c.topology)} gpus={','.join(node.gpu_ids) or '-'} "
                f"actor {self.actor_names[rank]}" + ("" if rank in self.members else " (spare)"))
        return self.nodes

    def _node_actor(self, rank: int, node: NodeFacts):
        """Gang rank `rank`'s node actor, in its bundle, on `node` (as Ray's node table has it)."""
        c = self.cluster
        return _REMOTE_NODE_ACTOR.options(
            num_cpus=c.cpus_per_node, num_gpus=c.gpus_per_node, resources={c.node_resource: 1},
            max_concurrency=8, name=self.actor_names[rank],
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg,
                                                                 placement_group_bundle_index=self.bundles[rank]),
        ).remote(self._identity(rank, node))

    @property
    def spares(self) -> list[int]:
        """The gang ranks standing by: placed, alive as far as the gang knows, running nothing."""
        return [g for g in range(len(self.actors)) if g not in self.members and g not in self.left]

    def keep_off(self, avoid: dict[str, str]) -> tuple[bool, dict[str, str] | None, str]:
        """Whether a gang can be placed off the hosts in `avoid` (host -> why): other nodes fit it, or something can
        add nodes; the label selector that does it (Ray places the gang: this only narrows where; None where no
        node of the cluster is to be avoided); and what to say of it. Hosts without the topology's host label are
        kept off by their current Ray node ids."""
        c, t = self.cluster, self.cluster.topology
        fitting = whole_nodes(c)
        labels = [n.get("Labels") or {} for n in fitting]
        host_of = [lab.get(t.host_label) or n.get("NodeManagerHostname", "") for n, lab in zip(fitting, labels)]
        others, need = len(fitting) - len([h for h in host_of if h in avoid]), c.placed_nodes
        if all(t.host_label in lab for lab in labels):
            selector = {t.host_label: f"!in({','.join(sorted(avoid))})"}
        else:
            ids = [n["NodeID"] for n, h in zip(fitting, host_of) if h in avoid]
            selector = {"ray.io/node-id": f"!in({','.join(ids)})"} if ids else {}
        what = f"{', '.join(sorted(avoid))} ({'; '.join(f'{host}: {why}' for host, why in avoid.items())})"
        if others >= need:
            return True, selector or None, f"keeping off {what}; {others} other node(s) fit, the gang needs {need}"
        grows, why = cluster_growth()
        if grows:
            return True, selector or None, (f"keeping off {what}; only {others} other node(s) fit and the gang needs "
                                            f"{need}: waiting for new nodes ({why})")
        return False, None, (f"cannot keep off {what}: only {others} other node(s) fit and the gang needs {need}, "
                             f"and {why}")

    def serves_again(self, failed: GangResult, leave: dict[str, str]) -> bool:
        """Whether the next attempt can run on this gang: with a spare in the place of each member that was lost or
        is to be kept off (`leave`: host -> why), or, with no spares for them, where none was lost and a gang could
        not be placed without those kept off (a new gang would land on the same nodes, at the cost of a placement
        and a node actor per node: seconds on a busy cluster). The failed launch's processes were all stopped."""
        if not self.actors:
            return False
        host = {g: node.short_name(self.cluster.topology) for g, node in enumerate(self.nodes)}
        lost = {n.gang_rank for n in failed.nodes if n.status == "lost"}
        self.left.update({g: "was lost" for g in lost})
        out = [g for g in self.members if g in lost or host[g] in leave]
        spares = [g for g in self.alive(self.spares) if host[g] not in leave] if out else []
        if out and len(spares) >= len(out):
            for gone, spare in zip(out, spares):
                self.left[gone] = "was lost" if gone in lost else f"is kept off ({leave[host[gone]]})"
                say(f"gang {self.name}: spare node {spare} ({self.nodes[spare].describe(self.cluster.topology)}) "
                    f"takes the place of node {gone} ({host[gone]}), which {self.left[gone]}")
            self.members = self._in_rank_order(set(self.members) - set(out) | set(spares[:len(out)]))
            return True
        if lost:
            return False
        mine = {h: why for h, why in leave.items() if h in {host[g] for g in self.members}}
        if not mine:
            return True
        can, _, line = self.keep_off(mine)
        if not can:
            say(f"gang {self.name}: {line}; the next attempt runs on this gang, {'that node' if len(mine) == 1 else 'those'} "
                "included")
        return not can

    def _in_rank_order(self, ranks: set[int]) -> list[int]:
        """Gang ranks `ranks` in the topology order of the nodes they are on now: a restored spare keeps the gang rank
        of the lost node whose bundle Ray placed again, but its node may sort anywhere among the others."""
        by_node = {self.nodes[g].node_id: g for g in ranks}
        return [by_node[node.node_id] for node in rank_order([self.nodes[g] for g in ranks], self.cluster.topology)]

    def alive(self, ranks: list[int], wait_s: float = 5.0) -> list[int]:
        """Those of gang ranks `ranks` whose node actor answers within `wait_s`; the others have left (lost)."""
        asked = {self.actors[g].alive.remote(): g for g in ranks}
        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=wait_s) if asked else ([], [])
        answered = set()
        for ref in ready:
            with contextlib.suppress(Exception):  # gone: Ray's word comes with the next attempt that needs it
                ray.get(ref)
                answered.add(asked[ref])
        for g in set(ranks) - answered:
            self.left[g] = "was lost while standing by"
        return [g for g in ranks if g in answered]

    @property
    def step(self) -> str:
        """What this gang runs, in its actors' names: the pipeline step whose `logs/<step>/` it logs to, else the
        job's kind (a run of one job)."""
        logs = Path(self.log_dir)
        return logs.name if self.run_dir and logs.parent == Path(self.run_dir) / "logs" else self.spec.kind

    def actor_name(self, rank: int) -> str:
        """Node `rank`'s actor, as the dashboard's Actors page lists it: `<run id>-<step>-n<rank>` (rank in topology
        order), `-a<attempt>` on a restart's fresh gang."""
        return f"{self.run_id}-{self.step}-n{rank}" + (f"-a{self.attempt}" if self.attempt else "")

    def _identity(self, rank: int, node: NodeFacts) -> NodeIdentity:
        g = self.cluster.gpus_per_node
        spare = rank >= self.cluster.nodes or rank in self.left  # a restored spare stands in a lost member's bundle
        ranks = "spare" if spare else f"{rank * g}-{rank * g + g - 1}" if g > 1 else str(rank)
        return NodeIdentity(run=self.run_id, step=self.step, node_rank=rank,
                            host=node.short_name(self.cluster.topology), ip=node.ip,
                            block=node.labels.get(self.cluster.topology.block_label, ""), ranks=ranks)

    def _wait_placed(self, t0: float) -> None:
        """Wait for the placement group, at most cluster.start_timeout_s. A gang the cluster's nodes can never
        hold fails at once where nothing can add nodes (no autoscaler: an embedded or `a4ray local up` cluster,
        a static Ray cluster); where an autoscaler (Ray's, KubeRay's) can, or where that is unknown, it waits,
        saying what for."""
        c = self.cluster
        deadline, said, unfit = t0 + c.start_timeout_s, False, 0
        while not ray.wait([self.pg.ready()], timeout=max(0.0, min(_PLACE_POLL_S, deadline - time.monotonic())))[0]:
            unfit = 0 if fits_the_nodes(self.spec) else unfit + 1
            if unfit:
                grows, why = cluster_growth()
                if grows is False and unfit >= 2:  # twice in a row: not a node list caught mid-change
                    message = explain_unplaceable(self.spec, self.name, lead="gang cannot be placed")
                    self.close()
                    raise GangUnplaceable(f"{message}; and {why}", hint="add nodes, or lower cluster.nodes / "
                                          "cluster.gpus_per_node")
                if not said and grows is not False:
                    say(f"gang {self.name}: waiting up to cluster.start_timeout_s={c.start_timeout_s:g}s for nodes "
                        f"the cluster does not have yet ({explain_unplaceable(self.spec, self.name, lead='')}): {why}")
                    said = True
            if time.monotonic() >= deadline:
                message = explain_unplaceable(self.spec, self.name)
                self.close()
                raise GangStartTimeout(
                    message, hint="add nodes, lower cluster.nodes / cluster.gpus_per_node, or raise "
                    "cluster.start_timeout_s if nodes are still being added",
                )

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
        members = list(self.members) if nodes is None else list(nodes)
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
        started_at = time.time()
        # A gang without a run directory (a test's) has no workspace of record: its processes keep their defaults.
        compile_cache_env = self.spec.storage.compile_cache_env(str(RunDir(Path(self.run_dir)).workspace)) \
            if self.run_dir else {}
        requests = [
            LaunchRequest(
                argv=launch.argv, cwd=launch.cwd, env=launch.env, env_scripts=launch.env_scripts,
                files=launch.files, network=self.spec.network, node_rank=rank, nproc=launch.nproc,
                log_dir=log_dir, launch_id=f"{launch_id}-n{rank}", grace_s=self.cluster.stop_grace_s,
                attempt=self.attempt, metric_tags={"job": self.spec.name, "run": self.run_id},
                seq_length=self.spec.observe.seq_length,
                flight_recorder=self.spec.observe.watchdog.enabled and self.spec.observe.watchdog.flight_recorder,
                compile_cache_env=compile_cache_env,
                warm_next=self.spec.restart.warm_ranks and self.attempt < self.spec.restart.max_restarts,
            )
            for rank, launch in enumerate(launches)
        ]
        actors = [self.actors[g] for g in members]

        def standby(g: int):
            """Spare `g` stands by for the next attempt as the last member would run it, its ranks warm: any member's
            command, for the launch rank, the master and the port are the hand-over's (ranks.PER_LAUNCH_ARGS)."""
            return self.actors[g].launch.remote(requests[-1].model_copy(update={
                "warm_only": True, "node_rank": g, "launch_id": f"{launch_id}-n{g}"}), env_name)

        warm_spares = nodes is None and requests[-1].warm_next
        spares = {g: standby(g) for g in (self.spares if warm_spares else [])}
        infos = {}  # rank -> what its node launched; a node lost while launching is the supervisor's to report
        for rank, ref in enumerate([a.launch.remote(r, env_name) for a, r in zip(actors, requests)]):
            try:
                infos[rank] = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                self._stop(members)  # the nodes that did start must not run on alone
                if isinstance(e.cause, A4RayError):
                    raise e.cause from None
                raise
            except ACTOR_GONE:
                pass  # its first poll finds the actor gone: "node N was lost", and the restart policy decides
        say("\n".join(summarize_reports([info.env_report for info in infos.values()], [members[r] for r in infos],
                                         log_dir)))
        for g, ref in spares.items():
            self._stands_by(g, ref, launch_id)
        starts = {info.ranks for info in infos.values() if info.ranks}
        if starts:
            say(f"launch {launch_id}: ranks warm on every node (started with the last attempt)" if starts == {"warm"}
                else f"launch {launch_id}: " + "; ".join(f"n{members[r]} ranks {info.ranks}"
                                                         for r, info in infos.items() if info.ranks))
        if nodes is not None or any(launch.standby for launch in launches):
            say(f"launch {launch_id}: nodes {members}" + "".join(
                f"; n{members[r]} standby" for r, launch in enumerate(launches) if launch.standby))
        hang_dir = Path(self.run_dir or Path(log_dir).parent) / (f"hang-attempt-{self.attempt}" if self.attempt
                                                                 else "hang")
        wheres = [self.nodes[g].describe(self.cluster.topology) for g in members]
        supervisor = Supervisor(
            actors, members, wheres, [self.node_ref(g) for g in members], launches, timeout_s,
            observe=self.spec.observe, observers=self.observers, stop=self._stop, hang_dir=hang_dir,
            notice=self._notice if any(launch.saves_on_notice for launch in launches) else None,
            log_dir=log_dir, tags=(self.spec.name, self.run_id), records_dir=Path(log_dir) / "flight-recorder")
        restoring = self._restoring(standby if warm_spares else None, launch_id) if nodes is None else \
            contextlib.nullcontext()
        with restoring:
            outcome = supervisor.watch()
        outcome.times.started_at, outcome.times.ended_at = started_at, time.time()
        outcome.times.placing_at = self.placing_at
        result = self._collect(members, outcome, time.monotonic() - t0, log_dir, launch_id)
        if not result.ok:
            error_cls = {"timeout": GangTimeout, "cancelled": Cancelled, "hang": GangHang}.get(outcome.kind, GangFailed)
            raise error_cls(result.failure or "the gang failed", result=result, hint=outcome.hint)
        return result

    @staticmethod
    def _stands_by(g: int, ref, launch_id: str) -> None:
        """Say how spare `g` stands by, once its node actor has answered `ref` (its warm-only launch)."""
        try:
            info = ray.get(ref, timeout=60)
            say(f"launch {launch_id}: spare node {g} stands by for the next attempt, " + (
                "its ranks warm" if info.ranks == "warm" else f"its ranks {info.ranks}"))
        except Exception as e:  # noqa: BLE001 - a spare that cannot warm up still stands by, cold
            say(f"launch {launch_id}: spare node {g} stands by cold: {type(e).__name__}: {e}")

    @contextlib.contextmanager
    def _restoring(self, standby: Callable[[int], object] | None, launch_id: str):
        """While the block runs (a launch), every _RESTORE_POLL_S: `restore_spares`, in a thread of its own. When the
        block ends, a restore under way gives up within half a second (its actor killed, to be tried with the next
        launch): the failure path waits for no node actor's start, and the gang's state is one thread's again."""
        if not self.cluster.spare_nodes:
            yield
            return
        done = threading.Event()

        def restore() -> None:
            while True:
                try:
                    self.restore_spares(standby, launch_id, stop=done)
                except Exception as e:  # noqa: BLE001 - a spare not restored now is looked for with the next launch
                    say(f"gang {self.name}: no spare restored: {type(e).__name__}: {e}")
                    return
                if done.wait(_RESTORE_POLL_S):
                    return

        thread = threading.Thread(target=restore, name=f"{self.name}-spares", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def restore_spares(self, standby: Callable[[int], object] | None = None, launch_id: str = "",
                       stop: threading.Event | None = None) -> list[int]:
        """A spare again in the bundle of each lost node that Ray has placed on a live node since: a node actor there,
        standing by (`standby(g)`: its launch of the next attempt's launcher, warm). The gang ranks made spares; once
        `stop` is set, no more (an actor still starting is killed)."""
        lost = [g for g, why in self.left.items() if why.startswith("was lost")]
        if not lost or self.pg is None:
            return []
        placed = placed_nodes(self.pg)
        live = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        again = [g for g in lost if (node := placed.get(self.bundles[g])) is not None and node.node_id in live
                 and node.node_id != self.nodes[g].node_id]
        restored = []
        for g in again:
            self._restored += 1
            self.actor_names[g] = f"{self.actor_name(g)}-s{self._restored}"  # the lost actor's name may be held yet
            actor = self._node_actor(g, placed[self.bundles[g]])
            facts = actor.facts.remote()
            within = max(60.0, self.cluster.start_timeout_s)
            if not _answers(facts, within, stop):
                ray.kill(actor)
                if not (stop and stop.is_set()):
                    say(f"gang {self.name}: no spare in the bundle of node {g}, placed again on "
                        f"{placed[self.bundles[g]].describe(self.cluster.topology)}: its node actor did not start "
                        f"within {within:g}s (tried again with the next launch)")
                break
            self.nodes[g], self.actors[g] = ray.get(facts), actor
            del self.left[g]
            restored.append(g)
            say(f"gang {self.name}: the bundle of node {g}, which was lost, is placed again on "
                f"{self.nodes[g].describe(self.cluster.topology)}: a spare again, actor {self.actor_names[g]}")
            if standby is not None and _answers(ref := standby(g), 60.0, stop):
                self._stands_by(g, ref, launch_id)
        return restored

    def _collect(self, members: list[int], outcome: Outcome, run_s: float, log_dir: str,
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
                        host=facts.short_name(self.cluster.topology),
                        location="/".join(p for p in facts.location(self.cluster.topology) if p))
            if rank in outcome.lost:
                nodes.append(NodeResult(**base, status="lost", last_lines=outcome.tails.get(rank, [])))
                continue
            try:
                run: NodeRun = ray.get(asked[rank], timeout=0)
            except Exception:  # noqa: BLE001 - a node that cannot answer now is as good as lost
                nodes.append(NodeResult(**base, status="lost", last_lines=outcome.tails.get(rank, [])))
                continue
            # A process a4ray stopped is "stopped" whatever its exit code (bash may exit 0 on SIGTERM), unless its
            # node is the one that failed: the gang stops a node whose launcher reported a dead rank at once.
            failed_here = outcome.kind == "failed" and outcome.failed_node == rank
            status = ("standby" if run.standby else "failed" if failed_here else "stopped" if run.stopped else
                      "succeeded" if run.exit_code == 0 else "failed")
            duration = (run.ended_at - run.started_at) if run.ended_at and run.started_at else None
            nodes.append(NodeResult(**base, status=status, exit_code=run.exit_code, duration_s=duration,
                                    last_lines=run.last_lines[-LAST_LINES:], records=run.records,
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
            saved_on_notice=outcome.saved_on_notice,
            hang_report=outcome.hang_report, hang_verdict=outcome.hang_verdict, stragglers=outcome.stragglers,
            times=outcome.times,
        )

    def node_ref(self, gang_rank: int) -> NodeRef:
        """Gang node `gang_rank` as verdicts and the node history name it."""
        facts, topology = self.nodes[gang_rank], self.cluster.topology
        return NodeRef(node=gang_rank, host=facts.short_name(topology), hostname=facts.hostname, ip=facts.ip,
                       location="/".join(p for p in facts.location(topology) if p))

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

    def _notice(self, ranks: list[int]) -> float:
        """A stop with notice to gang ranks `ranks` (runtime/notice.py): their ranks save and end, each node waited
        for up to cluster.notice_grace_s. Returns the grace given."""
        grace = self.cluster.notice_grace_s
        refs = [self.actors[g].notice.remote(grace) for g in ranks]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=grace + 30)
        except Exception:  # noqa: BLE001 - an actor gone meanwhile: the stop that follows reports it
            pass
        return grace

    def close(self) -> None:
        """End the node actors and remove the placement group. An actor ends itself (Ray's `__ray_terminate__`: the
        dashboard then shows an intended exit, "User requested to exit the actor", not "killed by ray.kill"); one
        that cannot answer in time (a stuck node) is killed. The reaper of any launch still running kills its tree."""
        ended = [actor.__ray_terminate__.remote() for actor in self.actors]
        if ended:
            ready, _ = ray.wait(ended, num_returns=len(ended), timeout=_END_WAIT_S)
            for actor, ref in zip(self.actors, ended):
                if ref not in ready:
                    try:
                        ray.kill(actor)
                    except Exception:  # noqa: BLE001 - already gone
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


def _answers(ref, within_s: float, stop: threading.Event | None) -> bool:
    """Whether `ref` is ready within `within_s`, asked every half second until `stop` is set."""
    deadline = time.monotonic() + within_s
    while not ray.wait([ref], timeout=max(0.0, min(0.5, deadline - time.monotonic())))[0]:
        if (stop is not None and stop.is_set()) or time.monotonic() >= deadline:
            return False
    return True


def placed_nodes(pg) -> dict[int, NodeFacts]:
    """{bundle index: the facts of the node it is placed on} of a placement group, from Ray's node table (the id, IP
    and labels that rank the node; the node actor reports the rest). A bundle placed on no node is left out."""
    where = placement_group_table(pg)["bundles_to_node_id"]
    table = {n["NodeID"]: n for n in ray.nodes()}
    return {int(bundle): NodeFacts(
        node_id=node_id, ip=table[node_id]["NodeManagerAddress"],
        hostname=table[node_id].get("NodeManagerHostname", ""),
        labels={k: v for k, v in (table[node_id].get("Labels") or {}).items() if not k.startswith("ray.io/")})
        for bundle, node_id in where.items() if node_id in table}


def fits_the_nodes(spec: JobSpec) -> bool:
    """Whether the cluster's alive nodes could hold the gang if nothing else ran (else only new nodes can)."""
    return len(whole_nodes(spec.cluster)) >= spec.cluster.placed_nodes


def whole_nodes(c) -> list[dict]:
    """The cluster's alive nodes (Ray's node table) that could each hold one of the gang's bundles if nothing else
    ran on them: the node resource, the GPUs and the CPUs of `c` (the spec's cluster)."""
    return [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get(c.node_resource, 0) >= 1
            and n["Resources"].get("GPU", 0) >= c.gpus_per_node and n["Resources"].get("CPU", 0) >= c.cpus_per_node]


def cluster_growth() -> tuple[bool | None, str]:
    """Can anything add nodes to this cluster? (True | False | None: unknown, why), as Ray exposes it: nodes of
    a4ray's simulated clusters never autoscale; Ray's autoscaler v2 (KubeRay's) reports its state to the GCS;
    v1 writes its status to the GCS's KV, where a cluster with no autoscaling config (`ray start`, KubeRay with
    enableInTreeAutoscaling off) shows only the read-only monitor, whose node types are the nodes it has."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if alive and all(n.get("Labels", {}).get(SIMULATED_LABEL) == "true" for n in alive):
        return False, "nothing can add nodes to a cluster of simulated nodes (embedded or `a4ray local up`)"
    try:
        gcs = GcsClient(address=ray.get_runtime_context().gcs_address)
        reply = GetClusterStatusReply()
        reply.ParseFromString(gcs.get_cluster_status(timeout_s=5))
        if reply.autoscaling_state.autoscaler_state_version:
            return True, "Ray's autoscaler can add nodes"
        raw = gcs.internal_kv_get(DEBUG_AUTOSCALING_STATUS.encode(), None)
    except Exception as e:  # noqa: BLE001 - an older or unusual GCS: say so and keep waiting
        return None, f"whether an autoscaler can add nodes is unknown ({type(e).__name__}: {e})"
    status = json.loads(raw) if raw else {}
    report = status.get("autoscaler_report") or {}
    types = set((report.get("node_type_mapping") or {}).values())
    if not report or time.time() - status.get("time", 0) > _STATUS_STALE_S:
        return None, "whether an autoscaler can add nodes is unknown (no current autoscaler status in the GCS)"
    if types and all(t.startswith("node_") for t in types):
        return False, "the cluster has no autoscaler (a static Ray cluster: nothing adds nodes)"
    return True, f"Ray's autoscaler can add nodes (node types: {', '.join(sorted(types)) or 'configured'})"


def explain_unplaceable(spec: JobSpec, pg_name: str, lead: str | None = None) -> str:
    """Why the gang could not be placed: what it needs against what the cluster has."""
    c = spec.cluster
    spares = f" ({c.nodes} and {c.spare_nodes} spare)" if c.spare_nodes else ""
    need = (f"the gang needs {c.placed_nodes} node(s){spares} with resource '{c.node_resource}' and "
            f"{c.gpus_per_node} GPU(s) each, one per node")
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
    lead = f"gang not placed within cluster.start_timeout_s={c.start_timeout_s:g}s" if lead is None else lead
    return f"{lead + ': ' if lead else ''}{need}; {have} of {len(alive)} alive node(s){busy}"
