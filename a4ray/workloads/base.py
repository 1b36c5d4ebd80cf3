"""What a node runs. A workload = a command builder (per node) + an output parser + a typed result."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

from pydantic import BaseModel

from a4ray.runtime.gang import GangResult, Launch, NodeContext, describe_env_plan
from a4ray.spec.job import JobSpec

if TYPE_CHECKING:
    from a4ray.rundir import RunDir
    from a4ray.runtime.connect import Connection

S = TypeVar("S", bound=JobSpec)

WORKLOADS: dict[str, type[Workload]] = {}


def workload(cls: type[Workload]) -> type[Workload]:
    """Register a workload class for its job kind (so `a4ray.run(spec)` finds it)."""
    WORKLOADS[cls.kind] = cls
    return cls


class WorkloadResult(BaseModel):
    kind: str
    ok: bool
    verdict: str
    gang: GangResult | None = None

    def table(self) -> str:
        return ""


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

    def render(self) -> str:
        from a4ray.redact import Redactor, secret_values

        lines = [f"plan for job {self.job!r} ({self.kind}): {len(self.nodes)} node(s)",
                 f"rank order: {self.rank_order}", "env layers (later wins):"]
        lines += [f"  {line}" for line in self.env]
        for node in self.nodes:
            lines.append(f"node {node.rank}:")
            if node.cwd:
                lines.append(f"  cd {node.cwd}")
            lines.append("  " + " ".join(node.argv))
            if node.env:
                shown = Redactor(secret_values(node.env)).env(node.env)
                lines.append("  env: " + " ".join(f"{k}={v}" for k, v in shown.items()))
        return "\n".join(lines)


class Workload(ABC, Generic[S]):
    kind: ClassVar[str]

    def __init__(self, spec: S):
        self.spec = spec

    def check(self) -> None:
        """Refuse, before anything is launched, what the workload would reject later."""

    @abstractmethod
    def launch(self, node: NodeContext) -> Launch:
        """The command one node runs."""

    @abstractmethod
    def result(self, gang: GangResult) -> WorkloadResult:
        """The typed result, parsed from what the nodes reported."""

    def execute(self, conn: Connection, run_dir: RunDir) -> WorkloadResult:
        """Run the workload on the connected cluster. The default: one gang launch of `launch` on every
        node; workloads that are more than one launch (conversion: a cache check, Ray tasks) override it."""
        from a4ray.console import say
        from a4ray.errors import GangFailed
        from a4ray.runtime.gang import Gang

        with Gang(self.spec, log_dir=str(run_dir.logs), run_dir=str(run_dir.root)) as gang:
            try:
                gang_result = gang.run(self.launch, timeout_s=self.spec.timeout_s, env_name=self.spec.kind)
            except GangFailed as failure:
                if failure.result is None:
                    raise
                say(f"FAILED: {failure}")
                gang_result = failure.result
        return self.result(gang_result)

    def plan(self) -> Plan:
        c = self.spec.cluster
        launches = [
            self.launch(NodeContext(
                rank=rank, nnodes=c.nodes, gpus=c.gpus_per_node, master_addr="<node-0 ip>",
                master_port="<free port on node 0>", ip=f"<node-{rank} ip>", hostname=f"<node-{rank}>",
                log_dir="<run dir>/logs", run_dir="<run dir>", launch_id="<launch id>",
            ))
            for rank in range(c.nodes)
        ]
        t = c.topology
        order = ("by IP" if t.order == "ip" else
                 f"by node labels {t.block_label}, {t.subblock_label}, {t.host_label}, then IP")
        env = describe_env_plan(self.spec, launches[0].env if launches else {})
        return Plan(job=self.spec.name, kind=self.spec.kind, rank_order=order, env=env,
                    nodes=[NodePlan(rank=i, argv=launch.argv, env=launch.env, cwd=launch.cwd)
                           for i, launch in enumerate(launches)])
