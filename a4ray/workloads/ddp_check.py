"""The DDP test workload: torchrun of `a4ray.programs.ddp_worker` on every node, one verdict."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from a4ray.core.console import table
from a4ray.core.results import axes
from a4ray.runtime.launch import GangResult, Launch, NodeContext
from a4ray.spec.ddp import DDPTestJob
from a4ray.workloads.torchrun import torchrun
from a4ray.workloads.workload import Workload, WorkloadResult


class DDPRank(BaseModel):
    rank: int
    local_rank: int
    node_rank: int
    host: str
    device: str
    backend: str
    step_time_ms: float
    allreduce_ok: bool
    param_max_diff: float
    grad_max_diff: float
    loss_first: float
    loss_last: float
    passed: bool


class DDPTestResult(WorkloadResult):
    kind: str = "ddp_test"
    nodes: int
    expected_ranks: int
    ranks: list[DDPRank] = []

    def table(self) -> str:
        rows = [[r.rank, r.node_rank, r.local_rank, r.host, r.device, f"{r.step_time_ms:.2f}",
                 f"{max(r.param_max_diff, r.grad_max_diff):.2g}", "pass" if r.passed else "FAIL"]
                for r in sorted(self.ranks, key=lambda r: r.rank)]
        return table("DDP test", ["rank", "node", "local", "host", "device", "step ms", "max diff", ""], rows)

    def rows(self) -> list[dict[str, Any]]:
        return [r.model_dump() for r in sorted(self.ranks, key=lambda r: r.rank)]

    def summary(self) -> dict[str, Any]:
        return {"ranks passed": sum(r.passed for r in self.ranks),
                "slowest step ms": max((r.step_time_ms for r in self.ranks), default=None)}

    def plot(self, ax=None):
        ax = axes(ax, title=f"DDP step time per rank ({self.nodes} nodes)", xlabel="rank", ylabel="step time (ms)")
        ranks = sorted(self.ranks, key=lambda r: r.rank)
        ax.bar([r.rank for r in ranks], [r.step_time_ms for r in ranks],
               color=["tab:blue" if r.passed else "tab:red" for r in ranks])
        return ax


class DDPTest(Workload[DDPTestJob]):
    kind = "ddp_test"

    def launch(self, node: NodeContext) -> Launch:
        t = self.spec.ddp_test
        return Launch(
            argv=torchrun(node, ["-m", "a4ray.programs.ddp_worker", f"--steps={t.steps}",
                                 f"--hidden={t.hidden}", f"--layers={t.layers}",
                                 f"--batch-size={t.batch_size}", f"--backend={t.backend}",
                                 f"--tolerance={t.tolerance}"]),
            nproc=node.gpus,
        )

    def result(self, gang: GangResult) -> DDPTestResult:
        c = self.spec.cluster
        ranks = [DDPRank(**r) for r in gang.records if "param_max_diff" in r]
        expected = c.nodes * c.gpus_per_node
        passed = [r for r in ranks if r.passed]
        ok = gang.ok and len(passed) == expected
        steps = self.spec.ddp_test.steps
        if ok:
            worst = max((max(r.param_max_diff, r.grad_max_diff) for r in ranks), default=0.0)
            slowest = max(r.step_time_ms for r in ranks)
            verdict = (f"PASS: {len(passed)}/{expected} ranks over {c.nodes} nodes agree after {steps} "
                       f"DDP steps (max diff {worst:.2g}; slowest rank {slowest:.1f} ms/step)")
        else:
            failed = sorted(r.rank for r in ranks if not r.passed)
            missing = expected - len(ranks)
            why = [f"ranks {failed} failed their checks"] if failed else []
            why += [f"{missing} rank(s) reported nothing"] if missing else []
            why += [gang.failure.splitlines()[0]] if gang.failure else []
            verdict = f"FAIL: {len(passed)}/{expected} ranks passed; " + "; ".join(why)
        return DDPTestResult(ok=ok, verdict=verdict, gang=gang, nodes=c.nodes, expected_ranks=expected,
                             ranks=ranks)
