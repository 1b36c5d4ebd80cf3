"""The network test: nccl-tests (or the built-in torch benchmark) across the gang, parsed into a verdict.

"Is the network right?" in one command. With nccl-tests' binaries and mpirun on every node, each
collective runs as `<binaries_dir>/<collective>_perf` under mpirun on node 0, one rank per GPU, its
daemons started through the node actors (`a4ray.runtime.rsh`; no SSH). Without them, `a4ray.programs.collectives`
measures the same collectives with the same formulas under torchrun. Either way the output is
nccl-tests' format, parsed into a table per collective; the verdict checks every result was right,
the busbw at the largest size against the spec's thresholds for this node count (real nodes only),
and that NCCL really used the network it should (NCCL_DEBUG=INFO lines: a run over TCP sockets where
gIB was expected fails). With `isolate`, a failed or slow result is followed by tests of node pairs
that name the slow or broken nodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from a4ray.builds.builder import BuildFailed, BuildOutcome, ensure
from a4ray.core.console import say, table
from a4ray.core.errors import ToolMissing
from a4ray.core.results import axes
from a4ray.core.rundir import RunDir
from a4ray.observe import metrics
from a4ray.parsers import nccl_debug, nccl_tests
from a4ray.parsers.nccl_tests import PerfRun
from a4ray.runtime.connect import Connection
from a4ray.runtime.gang import Gang
from a4ray.runtime.launch import GangResult, Launch, NodeContext
from a4ray.runtime.mpirun import mpi_launch
from a4ray.runtime.node_actor import Line
from a4ray.runtime.simulated import SIMULATED_LABEL
from a4ray.spec.nccl import NCCL_TESTS_DIRS, NcclTestJob, format_size
from a4ray.workloads import tool_words
from a4ray.workloads.torchrun import torchrun
from a4ray.workloads.workload import Plan, Workload, WorkloadResult, run_launch


class CollectiveResult(BaseModel):
    collective: str
    ok: bool
    run: PerfRun | None = None
    largest_bytes: int | None = None
    busbw: float | None = None  # GB/s at the largest size (the better of out-of-place and in-place)
    threshold: float | None = None
    problems: list[str] = []


class PairResult(BaseModel):
    nodes: list[int]  # gang ranks
    hosts: list[str]
    ok: bool
    busbw: float | None = None
    problem: str | None = None


class BadNode(BaseModel):
    rank: int
    hostname: str
    ip: str
    reason: str


class Isolation(BaseModel):
    collective: str
    size: int
    tests: list[PairResult] = []
    bad_nodes: list[BadNode] = []
    verdict: str = ""


class NcclTestResult(WorkloadResult):
    kind: str = "nccl_test"
    implementation: str
    backend: str
    nodes: int
    gpus_per_node: int
    simulated: bool
    expect_transport: str
    transport: nccl_debug.TransportReport
    transport_problem: str | None = None
    thresholds_applied: bool
    thresholds_note: str = ""
    collectives: list[CollectiveResult] = []
    isolation: Isolation | None = None
    binaries_dir: str = ""  # where the *_perf binaries ran from (nccl-tests)
    builds: list[BuildOutcome] = []  # how they came to be there, per node (empty: the image's, found by path)

    def table(self) -> str:
        parts = []
        for c in self.collectives:
            if c.run is None:
                continue
            rows = [[format_size(r.size), r.count, *_cells(r.out_of_place), *_cells(r.in_place)] for r in c.run.rows]
            parts.append(table(f"{c.collective} ({self.implementation}, {self.backend}, {self.nodes} nodes x "
                               f"{self.gpus_per_node})", ["size", "count", "time us", "algbw", "busbw", "#wrong",
                                                           "in-place us", "algbw", "busbw", "#wrong"], rows))
        summary = [[c.collective, format_size(c.largest_bytes) if c.largest_bytes else "-",
                    f"{c.busbw:.2f}" if c.busbw is not None else "-",
                    f"{c.threshold:g}" if c.threshold is not None else "-",
                    "pass" if c.ok else "FAIL: " + "; ".join(c.problems)] for c in self.collectives]
        parts.append(table("busbw at the largest size (GB/s)", ["collective", "size", "busbw", "threshold", ""],
                           summary))
        if self.isolation:
            rows = [["+".join(f"n{n}" for n in t.nodes), ", ".join(t.hosts),
                     f"{t.busbw:.2f}" if t.busbw is not None else "-", "ok" if t.ok else f"BAD: {t.problem}"]
                    for t in self.isolation.tests]
            parts.append(table(f"isolation: {self.isolation.collective} at {format_size(self.isolation.size)}",
                               ["nodes", "hosts", "busbw", ""], rows))
        return "\n".join(parts)

    def rows(self) -> list[dict[str, Any]]:
        """One row per collective, size and placement (out-of-place, in-place), as nccl-tests prints them."""
        rows = []
        for c in self.collectives:
            for r in c.run.rows if c.run else []:
                for placement, t in (("out-of-place", r.out_of_place), ("in-place", r.in_place)):
                    if t is not None:
                        rows.append({"collective": c.collective, "size": r.size, "count": r.count, "dtype": r.dtype,
                                     "placement": placement, "time_us": t.time_us, "algbw": t.algbw,
                                     "busbw": t.busbw, "wrong": t.wrong})
        return rows

    def summary(self) -> dict[str, Any]:
        """busbw (GB/s) at the largest size, per collective."""
        return {f"{c.collective} busbw": c.busbw for c in self.collectives}

    def plot(self, ax=None):
        ax = axes(ax, title=f"busbw ({self.implementation}, {self.backend}, {self.nodes} nodes x {self.gpus_per_node})",
                  xlabel="message size (bytes)", ylabel="busbw (GB/s)")
        for c in self.collectives:
            points = [(r.size, r.busbw) for r in (c.run.rows if c.run else []) if r.busbw is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=c.collective)
        ax.set_xscale("log", base=2)
        ax.legend()
        return ax


def _cells(t) -> list[object]:
    if t is None:
        return ["N/A"] * 4
    return [f"{t.time_us:.1f}", f"{t.algbw:.2f}", f"{t.busbw:.2f}", "N/A" if t.wrong is None else t.wrong]


class _Lines:
    """Collects a launch's output: node 0's first rank (the table), every NCCL INFO line, and nccl-tests'
    own failure lines from any rank."""

    def __init__(self) -> None:
        self.table: list[str] = []
        self.info: list[str] = []
        self.failures: list[str] = []

    def __call__(self, rank: int, line: Line) -> None:
        if rank == 0 and line.local_rank in (None, 0):
            self.table.append(line.text)
        if "NCCL INFO" in line.text:
            self.info.append(line.text)
        elif nccl_tests.FAILURE.search(line.text) and len(self.failures) < 5:
            self.failures.append(line.text)


# Each rank's GPU is its node-local MPI rank: nccl-tests would count ranks per hostname, and simulated nodes
# share one hostname while each sees only its own GPUs. A built nccl-tests finds NCCL's pip library after
# whatever LD_LIBRARY_PATH the node has (gIB's NCCL first).
_RANK_DEVICE = (
    'export NCCL_TESTS_DEVICE="${NCCL_TESTS_DEVICE:-${OMPI_COMM_WORLD_LOCAL_RANK:-0}}"; '
    'if [ -n "$A4RAY_NCCL_LIB" ]; then export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$A4RAY_NCCL_LIB"; '
    'fi; exec "$@"'
)


class NcclTest(Workload[NcclTestJob]):
    kind = "nccl_test"

    def __init__(self, spec: NcclTestJob, *, env_label: str | None = None):
        super().__init__(spec)
        self.implementation = "torch" if spec.nccl.implementation == "torch" else "nccl-tests"
        self.binaries_dir = self.binaries_dirs()[0]  # until the nodes are asked (choose_implementation)
        # Whose the variables it sets are, in env reports: the test's own, or the job it probes for (preflight).
        self.env_label = env_label or self.kind
        self.builds: list[BuildOutcome] = []
        self.workspace = ""
        self.conn: Connection | None = None

    # ----------------------------------------------------------------------- commands
    def env(self) -> dict[str, str]:
        # INIT,NET: the lines that say which network NCCL picked and what each channel runs over.
        env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
        built = next((b.toolchain for b in self.builds if b.status != "image" and b.toolchain), None)
        if built and built.nccl_lib:
            env["A4RAY_NCCL_LIB"] = built.nccl_lib
        return env

    def binaries_dirs(self) -> list[str]:
        """Where to look for the *_perf binaries: the one configured, else each place images ship them."""
        return [self.spec.nccl.binaries_dir] if self.spec.nccl.binaries_dir else list(NCCL_TESTS_DIRS)

    def binary(self, collective: str, binaries_dir: str | None = None) -> str:
        return f"{(binaries_dir or self.binaries_dir).rstrip('/')}/{collective}_perf"

    def size_args(self, min_bytes: int, max_bytes: int) -> list[str]:
        n = self.spec.nccl
        return ["-b", format_size(min_bytes), "-e", format_size(max_bytes), "-f", str(n.factor), "-n", str(n.iters),
                "-w", str(n.warmup), "-c", str(int(n.check)), "-d", n.dtype]

    def nccl_tests_launch(self, node: NodeContext, collective: str, sizes: tuple[int, int] | None = None) -> Launch:
        n = self.spec.nccl
        program = ["bash", "-c", _RANK_DEVICE, "nccl-tests", self.binary(collective),
                   *self.size_args(*(sizes or (n.min_bytes, n.max_bytes))), "-g", "1"]
        return mpi_launch(node, program, slots=node.gpus, env=self.env(), mpi=self.spec.mpi)

    def torch_launch(self, node: NodeContext, collectives: list[str] | None = None,
                     sizes: tuple[int, int] | None = None) -> Launch:
        n = self.spec.nccl
        low, high = sizes or (n.min_bytes, n.max_bytes)
        # On CPU (gloo) the benchmark takes the rehearsal sizes; one size stays one size.
        cpu = (n.cpu_max_bytes, n.cpu_max_bytes) if sizes else (n.cpu_min_bytes, n.cpu_max_bytes)
        args = ["-m", "a4ray.programs.collectives", "--collectives", ",".join(collectives or n.collectives),
                *self.size_args(low, high), "--cpu-min-bytes", format_size(cpu[0]),
                "--cpu-max-bytes", format_size(cpu[1])]
        return Launch(argv=torchrun(node, args), env=self.env(), nproc=node.gpus)

    def launch(self, node: NodeContext) -> Launch:
        if self.implementation == "torch":
            return self.torch_launch(node)
        return self.nccl_tests_launch(node, self.spec.nccl.collectives[0])

    def plan(self, workspace: str | None = None) -> Plan:
        plan = super().plan()
        n = self.spec.nccl
        if self.implementation == "nccl-tests":
            plan.notes.append(f"one such mpirun per collective: {', '.join(n.collectives)}; the other nodes "
                              f"are standbys whose actors start mpirun's daemons (no SSH)")
        if n.implementation == "auto":
            plan.notes.append(f"auto: nccl-tests if {' or '.join(self.binaries_dirs())}/*_perf and "
                              f"{self.spec.mpi.mpirun} are on every node, else the torch benchmark under torchrun "
                              f"(a4ray.programs.collectives)")
        elif len(self.binaries_dirs()) > 1:
            plan.notes.append(f"the binaries: the first of {', '.join(self.binaries_dirs())} that has them on "
                              f"every node")
        return plan

    # ----------------------------------------------------------------------- running
    def run(self, conn: Connection, run_dir: RunDir, **kwargs):
        self.workspace, self.conn = str(run_dir.workspace), conn  # where builds go, and staging's cluster
        return super().run(conn, run_dir, **kwargs)

    def build(self, gang: Gang) -> str:
        """nccl-tests built on the nodes (or found built): the binaries' directory."""
        self.builds = ensure(gang, "nccl-tests", self.spec.nccl.build, workspace=self.workspace or
                             str(Path(gang.log_dir).parent), log_dir=gang.log_dir, conn=self.conn)
        return f"{self.builds[0].path}/src/build"

    def choose_implementation(self, gang: Gang) -> str:
        n = self.spec.nccl
        if n.implementation == "torch":
            return "torch"
        # A binaries_dir named by the user is theirs alone; else the image's, and a build where it has none.
        buildable = not n.binaries_dir and n.build.mode != "never"
        if buildable and n.build.mode == "always":
            self.binaries_dir = self.build(gang)
            return "nccl-tests"
        for binaries_dir in self.binaries_dirs():
            wanted = [self.binary(c, binaries_dir) for c in n.collectives] + [self.spec.mpi.mpirun]
            missing = {rank: [name for name, path in found.items() if path is None]
                       for rank, found in enumerate(gang.executables(wanted))}
            missing = {rank: names for rank, names in missing.items() if names}
            if not missing:
                self.binaries_dir = binaries_dir
                return "nccl-tests"
        where = "; ".join(f"node {r} ({gang.nodes[r].hostname}): {', '.join(names)}" for r, names in missing.items())
        if buildable:
            try:
                self.binaries_dir = self.build(gang)
                return "nccl-tests"
            except BuildFailed as failed:
                if n.implementation == "nccl-tests":
                    raise
                say(f"nccl-tests not in the image and not buildable here ({failed.message}): measuring with the "
                    "built-in torch benchmark instead")
                return "torch"
        if n.implementation == "nccl-tests":
            raise ToolMissing(f"nccl.implementation=nccl-tests, but missing or not executable: {where}",
                              hint="build nccl-tests into the image (make MPI=1) and set nccl.binaries_dir, "
                              "or set nccl.implementation=auto to fall back to the torch benchmark")
        say(f"nccl-tests not usable ({where}): measuring with the built-in torch benchmark instead")
        return "torch"

    def execute(self, gang: Gang) -> NcclTestResult:
        gang.start()
        self.implementation = self.choose_implementation(gang)
        runs: dict[str, PerfRun] = {}
        failures: dict[str, str] = {}
        info: list[str] = []
        gang_result = None
        batches = ([[c] for c in self.spec.nccl.collectives] if self.implementation == "nccl-tests"
                   else [list(self.spec.nccl.collectives)])
        for i, batch in enumerate(batches):
            with gang.observing(_Lines()) as lines:
                gang_result = run_launch(gang, self._builder(batch), timeout_s=self.spec.timeout_s,
                                         env_name=self.env_label)
            info += lines.info
            for run in nccl_tests.parse(lines.table, binary=f"{batch[0]}_perf"):
                runs[run.collective] = run
            if not gang_result.ok:  # nccl-tests' own words where it printed them
                failures.update({c: tool_words.said(gang_result.failure, lines.failures) for c in batch})
                # A broken fabric fails (or hangs until the timeout) every collective alike.
                failures.update({c: f"not run: {batch[0]} failed first" for later in batches[i + 1:] for c in later})
                break
        result = self.judge(gang, runs, failures, nccl_debug.parse(info), gang_result)
        for c in result.collectives:  # to the dashboard's Fabric bandwidth panel
            metrics.record_fabric(self.spec.name, gang.run_id, c.collective, list(range(len(gang.nodes))),
                                  {"busbw": c.busbw})
        if self.spec.nccl.isolate and not result.ok:
            result.isolation = self.isolate(gang, result)
            if result.isolation.bad_nodes:
                result.verdict += f"; isolation: {result.isolation.verdict}"
        return result

    def _builder(self, collectives: list[str], sizes: tuple[int, int] | None = None):
        if self.implementation == "torch":
            return lambda node: self.torch_launch(node, collectives, sizes)
        return lambda node: self.nccl_tests_launch(node, collectives[0], sizes)

    def judge(self, gang: Gang, runs: dict[str, PerfRun], failures: dict[str, str],
              transport: nccl_debug.TransportReport, gang_result: GangResult | None) -> NcclTestResult:
        c = self.spec.cluster
        nodes = len(gang.nodes)
        simulated = any(n.labels.get(SIMULATED_LABEL) == "true" for n in gang.nodes)
        backend = next((r.backend for r in runs.values()), "nccl")
        applied = not simulated and backend == "nccl"
        note = "" if applied else ("not applied: " + ", ".join(
            why for why, cond in (("simulated nodes", simulated), ("gloo on CPU, a rehearsal", backend == "gloo"))
            if cond))
        expect = self.expected_transport(simulated, nodes, backend)
        transport_problem = nccl_debug.check(transport, expect) if runs else None
        results = []
        for name in self.spec.nccl.collectives:
            run = runs.get(name)
            # Wrong results first: nccl-tests exits non-zero on them, and they say why better than the exit.
            checked = run.check_problem() if run else None
            problems = ([checked] if checked else []) + ([failures[name]] if name in failures else [])
            largest = run.largest if run else None
            threshold = self.spec.nccl.threshold(name, nodes) if applied else None
            if run is None or largest is None:
                problems = problems or ["no results in the output"]
            else:
                if threshold is not None and (largest.busbw or 0) < threshold:
                    problems.append(f"busbw {largest.busbw:.2f} < {threshold:g} GB/s")
            results.append(CollectiveResult(
                collective=name, ok=not problems, run=run, largest_bytes=largest.size if largest else None,
                busbw=largest.busbw if largest else None, threshold=threshold, problems=problems))
        ok = all(r.ok for r in results) and transport_problem is None
        figures = ", ".join(f"{r.collective} {r.busbw:.2f}" for r in results if r.busbw is not None)
        network = transport.describe() if backend == "nccl" else f"{backend}, not NCCL"
        where = f"{nodes} node(s) x {c.gpus_per_node} GPUs ({self.implementation}; {network})"
        if ok:
            verdict = f"PASS: busbw GB/s at the largest size: {figures} over {where}"
            verdict += f"; thresholds {note}" if note else "; thresholds met"
        else:
            why = [f"{r.collective}: {'; '.join(r.problems)}" for r in results if not r.ok]
            why += [f"transport: {transport_problem}"] if transport_problem else []
            verdict = f"FAIL over {where}: " + " | ".join(why)
        return NcclTestResult(
            ok=ok, verdict=verdict, gang=gang_result, implementation=self.implementation, backend=backend,
            nodes=nodes, gpus_per_node=c.gpus_per_node, simulated=simulated, expect_transport=expect,
            transport=transport, transport_problem=transport_problem, thresholds_applied=applied,
            thresholds_note=note, collectives=results,
            binaries_dir=self.binaries_dir if self.implementation == "nccl-tests" else "", builds=self.builds,
        )

    def expected_transport(self, simulated: bool, nodes: int, backend: str) -> str:
        wanted = self.spec.nccl.expect_transport
        if backend != "nccl":
            return "any"  # gloo never uses NCCL
        if wanted != "auto":
            return wanted
        if simulated or nodes == 1:
            return "any"
        return "gib" if self.spec.network.gib == "on" else "rdma"

    # ----------------------------------------------------------------------- isolation
    def isolate(self, gang: Gang, result: NcclTestResult) -> Isolation:
        """Test node pairs (one pair at a time, so they do not share the fabric) to name bad nodes.

        Pairs (0,1), (2,3), ...; a pair that fails, or is slow (below the 2-node threshold, or where none
        applies below `isolate_ratio` x the best pair), makes both suspects; each suspect (and an odd node
        out) is then tested with a node from a good pair: a suspect that is bad with a good partner is bad.
        Two nodes are tested one at a time instead."""
        failing = next((c for c in result.collectives if not c.ok), result.collectives[0])
        name = failing.collective
        n = self.spec.nccl
        size = n.max_bytes
        iso = Isolation(collective=name, size=size)
        count = len(gang.nodes)
        threshold = n.threshold(name, 2) if result.thresholds_applied else None
        say(f"isolation: testing node pairs with {name} at {format_size(size)}"
            + (f" ({format_size(n.cpu_max_bytes)} where it runs on CPU)" if self.implementation == "torch" else ""))

        def test(members: list[int]) -> PairResult:
            label = "-".join(f"n{m}" for m in members)
            with gang.observing(_Lines()) as lines:
                gr = run_launch(gang, self._builder([name], (size, size)), nodes=members,
                                timeout_s=self.spec.timeout_s, env_name=self.env_label,
                                log_dir=f"{gang.log_dir}/isolate/{label}")
            run = next(iter(nccl_tests.parse(lines.table, binary=f"{name}_perf")), None)
            largest = run.largest if run else None
            problem = None if gr.ok else (gr.failure or "failed").splitlines()[0]
            if run is not None and run.check_problem():
                problem = run.check_problem()
            elif problem is None and largest is None:
                problem = "no results"
            pair = PairResult(nodes=members, hosts=[gang.nodes[m].hostname for m in members], ok=problem is None,
                              busbw=largest.busbw if largest else None, problem=problem)
            iso.tests.append(pair)
            metrics.record_fabric(self.spec.name, gang.run_id, name, members, {"busbw": pair.busbw})
            return pair

        def slow(pair: PairResult, best: float) -> bool:
            if pair.busbw is None or len(pair.nodes) < 2:
                return False
            floor = threshold if threshold is not None else n.isolate_ratio * best
            if pair.busbw < floor:
                pair.ok, pair.problem = False, f"busbw {pair.busbw:.2f} < {floor:.2f} GB/s"
                return True
            return False

        def bad(rank: int, reason: str) -> None:
            node = gang.nodes[rank]
            iso.bad_nodes.append(BadNode(rank=rank, hostname=node.hostname, ip=node.ip, reason=reason))

        if count == 1:
            iso.verdict = "one node: nothing to compare it with"
            return iso
        if count == 2:
            for rank in (0, 1):
                single = test([rank])
                if not single.ok:
                    bad(rank, f"fails on its own: {single.problem}")
            iso.verdict = (self._name(iso) if iso.bad_nodes else "both nodes pass on their own: the fault is "
                           "between them (NIC, cable, switch port); test each with a third node")
            return iso
        pairs = [test([i, i + 1]) for i in range(0, count - 1, 2)]
        best = max((p.busbw or 0.0 for p in pairs if p.ok), default=0.0)
        good_pairs = [p for p in pairs if p.ok and not slow(p, best)]
        good = [m for p in good_pairs for m in p.nodes]
        suspects = [m for p in pairs if p not in good_pairs for m in p.nodes] + ([count - 1] if count % 2 else [])
        if not good:
            iso.verdict = ("every pair failed or was slow: not one bad node, but the fabric or the nodes' "
                           "common configuration")
            return iso
        for rank in suspects:
            check = test([good[0], rank])
            if not check.ok or slow(check, best):
                bad(rank, f"with good node {good[0]}: {check.problem}")
        if iso.bad_nodes:
            iso.verdict = self._name(iso)
        elif suspects and len(suspects) > (count % 2):
            iso.verdict = ("each node passes with a good partner: the slow pairs fail only together (check the "
                           "path between them)")
        else:
            iso.verdict = "every pair passes: the all-node result is not one node's doing"
        return iso

    @staticmethod
    def _name(iso: Isolation) -> str:
        return "bad node(s): " + "; ".join(f"node {b.rank} {b.hostname} ({b.ip}): {b.reason}" for b in iso.bad_nodes)
