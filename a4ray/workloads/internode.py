"""The DeepEP internode test: DeepEP's tests/test_internode.py on every node, parsed into one table.

One process per node (the test spawns its GPU processes itself) with WORLD_SIZE = the node count,
RANK = the node's rank and MASTER_ADDR = node 0 of the gang's topology order, which is also the MPI
hostfile's order (the seeds could hang where the two differed; under MPI each rank checks that its MPI
rank is its node's rank before it starts). The env is the node's gIB env, then DeepEP's env script
(NVSHMEM, LD_PRELOAD, ...) sourced on the node, then the spec's values. Launched through mpirun on
node 0 with one rank per node (the seeds' way) or by each node actor directly.
"""

from __future__ import annotations

from a4ray.core.console import table, warn
from a4ray.core.errors import SpecError
from a4ray.parsers import deepep_log as deepep
from a4ray.runtime.gang import Gang
from a4ray.runtime.launch import Launch, NodeContext
from a4ray.runtime.mpirun import mpi_launch
from a4ray.spec.deepep import DeepEPJob
from a4ray.workloads.workload import Workload, WorkloadResult, run_launch

# Under mpirun: refuse to start where MPI's rank order and the gang's differ, rather than hang in
# DeepEP's rendezvous; then RANK = the MPI rank = the node's rank.
_MPI_GUARD = (
    'if [ "$OMPI_COMM_WORLD_RANK" != "$A4RAY_NODE_RANK" ]; then '
    'echo "a4ray: MPI rank $OMPI_COMM_WORLD_RANK runs on gang node $A4RAY_NODE_RANK: the hostfile order is not '
    'the gang order, and DeepEP would hang" >&2; exit 97; fi; export RANK="$OMPI_COMM_WORLD_RANK"; exec "$@"'
)
_BEST = ("dispatch FP8", "dispatch BF16", "combine")


class DeepEPResult(WorkloadResult):
    kind: str = "deepep_test"
    launcher: str
    nodes: int
    processes_per_node: int
    reports: list[deepep.NodeReport] = []

    def table(self) -> str:
        def bw(report: deepep.NodeReport, name: str) -> str:
            best = report.best.get(name)
            return f"{best.rdma_gbps:.2f} / {best.nvl_gbps:.2f}" if best else "-"

        rows = [[r.node, f"{r.passed}/{r.cases}", f"{r.layout_ms:.3f}" if r.layout_ms is not None else "-",
                 *(bw(r, name) for name in _BEST), "pass" if r.all_passed else "FAIL"] for r in self.reports]
        return table(f"DeepEP internode test ({self.nodes} nodes x {self.processes_per_node} GPUs, {self.launcher})",
                     ["node", "passed", "layout ms", *(f"{n} GB/s RDMA / NVL" for n in _BEST), ""], rows)


class DeepEPTest(Workload[DeepEPJob]):
    kind = "deepep_test"

    @property
    def processes(self) -> int:
        return self.spec.deepep.num_processes or self.spec.cluster.gpus_per_node

    def check(self) -> None:
        d, c = self.spec.deepep, self.spec.cluster
        ranks = c.nodes * self.processes
        problems = []
        if c.nodes < 2:
            problems.append(f"cluster.nodes: the internode test needs at least 2 nodes, got {c.nodes}")
        if self.processes > c.gpus_per_node:
            problems.append(f"deepep.num_processes: {self.processes} processes per node, but a node has "
                            f"{c.gpus_per_node} GPUs")
        if d.num_experts % ranks:
            fits = [k * ranks for k in range(max(1, d.num_experts // ranks), d.num_experts // ranks + 2)]
            problems.append(f"deepep.num_experts: {d.num_experts} experts do not divide evenly over {ranks} ranks "
                            f"({c.nodes} nodes x {self.processes}); e.g. {' or '.join(map(str, fits))} would")
        if problems:
            raise SpecError(self.spec.source, problems, hint="DeepEP's test asserts these; fix them before an A4 "
                            "hour is spent")
        if self.processes != 8:
            warn(f"{self.processes} processes per node: upstream test_internode.py asserts 8 local ranks")

    def test_argv(self, node: NodeContext) -> list[str]:
        d = self.spec.deepep
        args = [d.python or node.python, d.test_script, f"--num-processes={self.processes}",
                f"--num-tokens={d.num_tokens}", f"--hidden={d.hidden}", f"--num-topk={d.num_topk}",
                f"--num-experts={d.num_experts}"]
        if d.num_topk_groups:
            args.append(f"--num-topk-groups={d.num_topk_groups}")
        return args + list(d.extra_args)

    def launch(self, node: NodeContext) -> Launch:
        d = self.spec.deepep
        env = {"WORLD_SIZE": str(node.nnodes), "MASTER_ADDR": node.master_addr, "MASTER_PORT": str(node.master_port),
               **d.env}
        scripts = [d.env_script] if d.env_script else []
        if d.launcher == "direct":
            return Launch(argv=self.test_argv(node), env={**env, "RANK": str(node.rank)}, env_scripts=scripts,
                          cwd=d.deepep_dir)
        program = ["bash", "-c", _MPI_GUARD, "deepep", *self.test_argv(node)]
        return mpi_launch(node, program, slots=1, env=env, env_scripts=scripts, mpi=self.spec.mpi,
                          tag_output=True, cwd=d.deepep_dir)

    def execute(self, gang: Gang) -> DeepEPResult:
        lines: list[tuple[int, str]] = []
        with gang.observing(lambda rank, line: lines.append((rank, line.text))):
            gang_result = run_launch(gang, self.launch, timeout_s=self.spec.timeout_s, env_name=self.kind)
        c = self.spec.cluster
        reports = [r for r in deepep.parse(lines) if r.cases or r.best]
        missing = sorted(set(range(c.nodes)) - {r.node for r in reports})
        failed = [r.node for r in reports if not r.all_passed]
        ok = gang_result.ok and not missing and not failed
        if ok:
            first = reports[0]
            figures = ", ".join(f"{n} {b.rdma_gbps:.1f} GB/s RDMA / {b.nvl_gbps:.1f} NVL"
                                for n, b in first.best.items())
            verdict = (f"PASS: {first.passed}/{first.cases} cases on each of {c.nodes} nodes"
                       + (f"; node 0: {figures}" if figures else ""))
        else:
            why = [f"nodes {failed} failed cases"] if failed else []
            why += [f"nodes {missing} reported no cases"] if missing else []
            why += [gang_result.failure.splitlines()[0]] if gang_result.failure else []
            verdict = "FAIL: " + "; ".join(why)
        return DeepEPResult(ok=ok, verdict=verdict, gang=gang_result, launcher=self.spec.deepep.launcher,
                            nodes=c.nodes, processes_per_node=self.processes, reports=reports)
