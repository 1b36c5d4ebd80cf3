"""The launch contract: what a workload builds for one node (`Launch`, from its `NodeContext`) and what a
launch reports back (`NodeResult`, `GangResult`). Every workload imports these; nothing here runs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from a4ray.observe.goodput import LaunchTimes
from a4ray.observe.verdicts import HangVerdict, Straggler


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
    `files` are written on the node before the command starts (e.g. an MPI hostfile). `saves_on_notice`: the
    ranks save at the iteration they reached and end on a4ray's notice (runtime/notice.py), so a cancel gives them
    the time to (cluster.notice_grace_s).
    """

    argv: list[str]
    env: dict[str, str] = {}
    env_scripts: list[str] = []
    files: dict[str, str] = {}
    cwd: str | None = None
    nproc: int = 0
    saves_on_notice: bool = False

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
    host: str = ""  # the machine, as the topology's host label names it (else the hostname)
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
    saved_on_notice: int | None = None  # the iteration the ranks saved at when told of a stop (a cancel)
    hang_report: str | None = None  # directory with every rank's stack dump and a summary
    hang_verdict: HangVerdict | None = None  # which rank, on which node, the hang waits for
    stragglers: list[Straggler] = []  # nodes flagged slower than the gang while it ran
    start_s: float = 0.0  # placement + actors + facts
    run_s: float = 0.0
    times: LaunchTimes = LaunchTimes()
    log_dir: str = ""
    nodes: list[NodeResult] = []

    @property
    def records(self) -> list[dict]:
        return [r for node in self.nodes for r in node.records]

    @property
    def brief(self) -> str:
        """The failure in a few words, for the lines after the one that said it whole (a verdict is said once)."""
        verdict = self.hang_verdict
        if verdict is not None and self.failure_kind == "hang":  # the supervisor said the verdict whole
            what = {"ended": "a rank ended early", "desync": "a desync", "hang": "the launch hung"}[verdict.kind]
            who = ", ".join(f"rank {c.rank}" for c in verdict.culprits) or "no culprit named"
            return f"{what} ({who}; the verdict above)"
        return (self.failure or "").splitlines()[0] if self.failure else ""

