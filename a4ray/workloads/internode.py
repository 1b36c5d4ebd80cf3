"""The DeepEP tests: DeepEP's own tests/test_{intranode,low_latency,internode}.py, parsed into one table.

One process per node (the test spawns its GPU processes itself) with WORLD_SIZE = the node count and RANK =
the node's rank, as DeepEP's `init_dist` means them (not torchrun's), and MASTER_ADDR = node 0 of the gang's
topology order, which is also the MPI hostfile's order (the seeds could hang where the two differed; under
MPI each rank checks that its MPI rank is its node's rank before it starts). intranode and low_latency run
on each node by itself (WORLD_SIZE 1), one node after another; internode across every node. The env is the
node's gIB env, then DeepEP's env script (NVSHMEM, LD_PRELOAD, ...) sourced on the node, then the spec's
values. Launched through mpirun on node 0 with one rank per node (the seeds' way) or by each node actor.
Where a node's image has no DeepEP at deepep_dir, DeepEP is built on the nodes from its pinned source
(`a4ray.builds`) and run from there.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from a4ray.builds.builder import BuildOutcome, ensure
from a4ray.core.console import table, warn
from a4ray.core.errors import SpecError
from a4ray.core.rundir import RunDir
from a4ray.observe import metrics
from a4ray.parsers import deepep_log as deepep
from a4ray.runtime.connect import Connection
from a4ray.runtime.gang import Gang
from a4ray.runtime.launch import GangResult, Launch, NodeContext
from a4ray.runtime.mpirun import mpi_launch
from a4ray.spec.deepep import DeepEPJob
from a4ray.workloads import tool_words
from a4ray.workloads.workload import Workload, WorkloadResult, run_launch

# Under mpirun: refuse to start where MPI's rank order and the gang's differ, rather than hang in
# DeepEP's rendezvous; then RANK = the MPI rank = the node's rank.
_MPI_GUARD = (
    'if [ "$OMPI_COMM_WORLD_RANK" != "$A4RAY_NODE_RANK" ]; then '
    'echo "a4ray: MPI rank $OMPI_COMM_WORLD_RANK runs on gang node $A4RAY_NODE_RANK: the hostfile order is not '
    'the gang order, and DeepEP would hang" >&2; exit 97; fi; export RANK="$OMPI_COMM_WORLD_RANK"; exec "$@"'
)
# A built DeepEP (deep_ep and deep_ep_cpp in its directory) comes first on the test's path, before the node's.
_DEEPEP_PATH = ('if [ -n "$A4RAY_DEEPEP_PATH" ]; then '
                'export PYTHONPATH="$A4RAY_DEEPEP_PATH${PYTHONPATH:+:$PYTHONPATH}"; fi; exec "$@"')
_BEST = ("dispatch FP8", "dispatch BF16", "combine")
_TITLE = {"intranode": "intranode (one node, NVLink)", "low_latency": "low-latency (one node)",
          "internode": "internode (RDMA + NVLink)"}


class DeepEPRun(BaseModel):
    """One DeepEP test on some nodes: what each node printed, and its verdict against the thresholds."""

    test: str
    nodes: list[int]  # gang ranks
    ok: bool
    reports: list[deepep.NodeReport] = []
    figures: dict[str, float] = {}  # GB/s at the slowest node
    thresholds: dict[str, float] = {}
    problems: list[str] = []
    exit: str = ""  # the launch's failure, in its own words ("" when it ended well)


class DeepEPResult(WorkloadResult):
    kind: str = "deepep_test"
    launcher: str
    nodes: int
    processes_per_node: int
    runs: list[DeepEPRun] = []
    builds: list[BuildOutcome] = []
    deepep_dir: str = ""

    @property
    def reports(self) -> list[deepep.NodeReport]:
        """The internode test's per-node reports (every test's, where no internode test ran)."""
        chosen = [r for r in self.runs if r.test == "internode"] or self.runs
        return [rep for run in chosen for rep in run.reports]

    def table(self) -> str:
        def bw(report: deepep.NodeReport, name: str) -> str:
            best = report.best.get(name)
            if not best:
                return "-"
            rdma = f"{best.rdma_gbps:.2f} / " if best.rdma_gbps is not None else ""
            return f"{rdma}{best.nvl_gbps:.2f}"

        parts = []
        for run in self.runs:
            if run.test == "low_latency":
                rows = [[rep.node, rank, *(f"{getattr(ll, f):.2f}" if getattr(ll, f) is not None else "-" for f in
                                           ("dispatch_gbps", "combine_gbps", "dispatch_combine_gbps"))]
                        for rep in run.reports for rank, ll in sorted(rep.low_latency.items())]
                head = ["node", "rank", "dispatch GB/s", "combine GB/s", "dispatch+combine GB/s"]
            else:
                rows = [[rep.node, f"{rep.passed}/{rep.cases}", f"{rep.layout_ms:.3f}" if rep.layout_ms is not None
                         else "-", *(bw(rep, name) for name in _BEST)] for rep in run.reports]
                rdma = " RDMA /" if run.test == "internode" else ""
                head = ["node", "passed", "layout ms", *(f"{n} GB/s{rdma} NVL" for n in _BEST)]
            verdict = "pass" if run.ok else "FAIL: " + "; ".join(run.problems)
            parts.append(table(f"DeepEP {_TITLE[run.test]}, {self.processes_per_node} GPUs per node "
                               f"({self.launcher}): {verdict}", head, rows))
        return "\n".join(parts)

    def summary(self) -> dict[str, float]:
        return {f"{run.test} {name} GB/s": value for run in self.runs for name, value in run.figures.items()}

    def rows(self) -> list[dict]:
        return [{"test": run.test, "figure": name, "gbps": value, "threshold": run.thresholds.get(name),
                 "ok": run.ok} for run in self.runs for name, value in run.figures.items()]


class DeepEPTest(Workload[DeepEPJob]):
    kind = "deepep_test"

    def __init__(self, spec: DeepEPJob):
        super().__init__(spec)
        self.deepep_dir = spec.deepep.deepep_dir
        self.builds: list[BuildOutcome] = []
        self.workspace = ""
        self.conn: Connection | None = None
        self.test = spec.deepep.tests[0]  # the one being launched

    @property
    def processes(self) -> int:
        return self.spec.deepep.num_processes or self.spec.cluster.gpus_per_node

    def check(self) -> None:
        d, c = self.spec.deepep, self.spec.cluster
        problems = []
        if self.processes > c.gpus_per_node:
            problems.append(f"deepep.num_processes: {self.processes} processes per node, but a node has "
                            f"{c.gpus_per_node} GPUs")
        if "internode" in d.tests:
            ranks = c.nodes * self.processes
            if c.nodes < 2:
                problems.append(f"cluster.nodes: the internode test needs at least 2 nodes, got {c.nodes} (A4: 2 or "
                                "more nodes of 8 GPUs; on one node run deepep.tests=[intranode,low_latency])")
            if d.num_experts % ranks:
                fits = [k * ranks for k in range(max(1, d.num_experts // ranks), d.num_experts // ranks + 2)]
                problems.append(f"deepep.num_experts: {d.num_experts} experts do not divide evenly over {ranks} "
                                f"ranks ({c.nodes} nodes x {self.processes}); e.g. {' or '.join(map(str, fits))} "
                                "would")
        if "intranode" in d.tests and d.num_experts % self.processes:
            problems.append(f"deepep.num_experts: {d.num_experts} experts do not divide evenly over "
                            f"{self.processes} ranks of one node (the intranode test asserts it)")
        if problems:
            raise SpecError(self.spec.source, problems, hint="DeepEP's tests assert these; fix them before an A4 "
                            "hour is spent")
        if "internode" in d.tests and self.processes != 8:
            warn(f"{self.processes} processes per node: upstream test_internode.py asserts 8 local ranks")

    def script(self, test: str) -> str:
        d = self.spec.deepep
        return {"intranode": d.intranode_script, "low_latency": d.low_latency_script, "internode": d.test_script}[test]

    def test_argv(self, node: NodeContext, test: str | None = None) -> list[str]:
        d, test = self.spec.deepep, test or self.test
        args = [d.python or node.python, self.script(test), f"--num-processes={self.processes}"]
        if test == "low_latency":  # its own defaults (128 tokens, 288 experts) are the seeds'
            return args
        args += [f"--num-tokens={d.num_tokens}", f"--hidden={d.hidden}", f"--num-topk={d.num_topk}",
                 f"--num-experts={d.num_experts}"]
        if test == "internode":
            if d.num_topk_groups:
                args.append(f"--num-topk-groups={d.num_topk_groups}")
            args += list(d.extra_args)
        return args

    def env(self, node: NodeContext) -> dict[str, str]:
        env = {"WORLD_SIZE": str(node.nnodes), "MASTER_ADDR": node.master_addr, "MASTER_PORT": str(node.master_port),
               **self.spec.deepep.env}
        if self.deepep_dir != self.spec.deepep.deepep_dir:  # built: its directory holds deep_ep and deep_ep_cpp
            env["A4RAY_DEEPEP_PATH"] = self.deepep_dir
        return env

    def launch(self, node: NodeContext) -> Launch:
        d = self.spec.deepep
        scripts = [d.env_script] if d.env_script else []
        program = ["bash", "-c", _DEEPEP_PATH, "deepep", *self.test_argv(node)]
        if d.launcher == "direct":
            return Launch(argv=program, env={**self.env(node), "RANK": str(node.rank)}, env_scripts=scripts,
                          cwd=self.deepep_dir)
        return mpi_launch(node, ["bash", "-c", _MPI_GUARD, "deepep", *program], slots=1, env=self.env(node),
                          env_scripts=scripts, mpi=self.spec.mpi, tag_output=True, cwd=self.deepep_dir)

    # ----------------------------------------------------------------------- running
    def run(self, conn: Connection, run_dir: RunDir, **kwargs):
        self.workspace, self.conn = str(run_dir.workspace), conn  # where builds go, and staging's cluster
        return super().run(conn, run_dir, **kwargs)

    def prepare(self, gang: Gang) -> None:
        """The image's DeepEP where every node has it, else one built on the nodes (or found built)."""
        d = self.spec.deepep
        self.builds = ensure(gang, "deepep", d.build, workspace=self.workspace or str(Path(gang.log_dir).parent),
                             log_dir=gang.log_dir, conn=self.conn, image=f"{d.deepep_dir}/{d.test_script}")
        self.deepep_dir = d.deepep_dir if self.builds[0].status == "image" else f"{self.builds[0].path}/src"

    def execute(self, gang: Gang) -> DeepEPResult:
        gang.start()
        self.prepare(gang)
        runs: list[DeepEPRun] = []
        gang_result = None
        for test in self.spec.deepep.tests:
            self.test = test
            groups = [list(range(len(gang.nodes)))] if test == "internode" else [[g] for g in range(len(gang.nodes))]
            for members in groups:
                lines: list[tuple[int, str]] = []
                log_dir = gang.log_dir if test == "internode" else f"{gang.log_dir}/{test}/node-{members[0]:02d}"
                with gang.observing(lambda rank, line: lines.append((rank, line.text))):
                    gang_result = run_launch(gang, self.launch, nodes=members, timeout_s=self.spec.timeout_s,
                                             env_name=self.kind, log_dir=log_dir)
                runs.append(self.judge(test, members, lines, gang_result))
                metrics.record_fabric(self.spec.name, gang.run_id, f"deepep {test}", members, runs[-1].figures)
        ok = all(r.ok for r in runs)
        verdict = ("PASS: " if ok else "FAIL: ") + " | ".join(self.describe(r, len(gang.nodes)) for r in runs)
        c = self.spec.cluster
        return DeepEPResult(ok=ok, verdict=verdict, gang=gang_result, launcher=self.spec.deepep.launcher,
                            nodes=c.nodes, processes_per_node=self.processes, runs=runs, builds=self.builds,
                            deepep_dir=self.deepep_dir)

    @staticmethod
    def describe(run: DeepEPRun, gang_nodes: int) -> str:
        where = f" on node {run.nodes[0]}" if len(run.nodes) == 1 and gang_nodes > 1 else ""
        cases = [f"{r.passed}/{r.cases}" for r in run.reports if r.cases]
        text = f"{run.test}{where}"
        if cases:
            text += (f" {cases[0]} cases on each of {len(run.nodes)} node{'s' if len(run.nodes) > 1 else ''}"
                     if len(set(cases)) == 1 else f" cases {', '.join(cases)}")
        if run.ok:
            return text + (": " + ", ".join(f"{k} {v:.1f}" for k, v in run.figures.items()) + " GB/s"
                           if run.figures else "")
        return f"{text}: {'; '.join(run.problems)}"

    def judge(self, test: str, members: list[int], lines: list[tuple[int, str]], gang: GangResult) -> DeepEPRun:
        reports = [r for r in deepep.parse(lines) if r.cases or r.best or r.low_latency or r.errors]
        for r in reports:  # launch rank (and MPI rank: one per node) -> the gang's node
            r.node = members[r.node] if r.node < len(members) else r.node
        problems = [f"node {r.node}: {r.errors[0]}" for r in reports if r.errors]  # DeepEP's own words first
        seen = {r.node for r in reports if r.cases or r.best or r.low_latency}
        missing = [g for g in members if g not in seen]
        if test != "low_latency":
            problems += [f"node {r.node}: {r.passed}/{r.cases} cases passed" for r in reports
                         if (r.cases or r.best) and not r.all_passed]
        if missing:
            problems.append(f"node{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} reported no results")
        if not gang.ok:
            problems.append(tool_words.said(gang.failure))
        figures: dict[str, float] = {}
        for r in reports:
            for name, value in r.figures().items():
                figures[name] = min(value, figures.get(name, value))
        thresholds = dict(self.spec.deepep.thresholds.get(test, {}))
        for name, floor in thresholds.items():
            if name not in figures:
                problems.append(f"{name}: no figure to hold to its threshold {floor:g} GB/s")
            elif figures[name] < floor:
                problems.append(f"{name} {figures[name]:.2f} < {floor:g} GB/s")
        return DeepEPRun(test=test, nodes=members, ok=gang.ok and not problems, reports=reports, figures=figures,
                         thresholds=thresholds, problems=problems,
                         exit="" if gang.ok else tool_words.said(gang.failure))
