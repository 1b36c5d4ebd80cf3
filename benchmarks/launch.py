"""Launch overhead: the same trivial DDP program started as bare torchrun, by a4ray's gang, by Ray Train.

    python benchmarks/launch.py                          # 2, 4, 8 simulated nodes, 5 repetitions
    python benchmarks/launch.py --sizes 2 --reps 1       # a quick check

On one embedded Ray cluster of simulated A4 nodes (1 CPU process per node; the cluster starts with the
smallest size and grows with `add_node` for the next), times from "launch requested" to "every rank's
user code has run and the launch has returned", for `benchmarks/ddp_trivial.py` (gloo, DDP, an all-reduce
every rank checks):
  (a) torchrun  N `python -m torch.distributed.run --nnodes N --node-rank i ...` processes started
                directly (no Ray), from spawn to all exited 0
  (b) gang      `a4ray.driver.execute.run(spec)` of a `command` job (`torchrun: true`, 1 process per node) with
                the defaults, attached to this process's Ray session: run directory, placement group,
                node actors, node facts, launch (each node's ranks started by a4ray's rank launcher with
                torchrun's env contract), every rank's lines streamed through the driver, results, teardown
  (c) Ray Train `TorchTrainer(...).fit()`, one worker per node (STRICT_SPREAD, 1 CPU each)
and two diagnostics in the same rotation: (b') the gang with `cluster.launcher: torchrun` (torchrun's
elastic agent on every node, as before a4ray had its own launcher), and Ray's floor of (b)'s start: the
same placement group and N empty actors with the gang's options (what any one-actor-per-node design
pays Ray). For each size: one untimed warm-up round of all of them, then `--reps` rounds, each running them in a rotating order, `--pause` seconds apart.
Prints a table per size (median, min, max), the gang's time by phase (timed from outside a4ray, by
wrapping Gang.start's waits, the supervisor and Gang.close), how its start grows with nodes against
Ray's floor, the CPU the driver and the GCS spend per launch (serial however many nodes there are), the
driver's cost per streamed line and per idle node, and last the ratios b/a and b/c against the goals
(b/a <= 1.1, b/c <= 0.6). Ray Train runs with its defaults (Ray Train v2).

Every rank's lines and all of Ray's and a4ray's messages go to a run log (`--logs`, printed at the
start), so that the tables stay readable; `--verbose` leaves them on the terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from a4ray.core import ports  # noqa: E402

PROGRAM = HERE / "ddp_trivial.py"
GOAL_VS_TORCHRUN = 1.1
GOAL_VS_RAY_TRAIN = 0.6
METHODS = ("torchrun", "gang", "ray_train")
ROTATION = (*METHODS, "gang_torchrun", "floor")  # diagnostics in the same rotation: (b') and (b)'s floor
LABELS = {"torchrun": "(a) bare torchrun", "gang": "(b) a4ray gang", "ray_train": "(c) Ray Train TorchTrainer",
          "gang_torchrun": "(b') gang, launcher: torchrun"}
PHASES = ("prep", "placement", "actors+facts", "launch", "processes", "finish")
PHASE_NOTES = {
    "prep": "spec, attach to the session, run directory, plan",
    "placement": "placement group requested -> ready",
    "actors+facts": "node actors started, node facts gathered, rank order",
    "launch": "free port on node 0, each node's env built, its rank launcher started",
    "processes": "rank launcher + user code on every node, lines streamed to the driver",
    "node_s": "of which the rank launcher ran, on the slowest node (as its node actor saw it)",
    "finish": "node results, actors killed, placement group removed, result.json",
}


# ------------------------------------------------------------------------------------------ output
class Report:
    """Where the tables go: the terminal, while everything else this process (and Ray) prints goes to
    the run log, so that thousands of rank lines do not bury them."""

    def __init__(self, log: Path, verbose: bool):
        self.log = log
        self.out = sys.stdout
        self._saved: tuple[int, int] | None = None
        if not verbose:
            sys.stdout.flush()
            sys.stderr.flush()
            self.out = os.fdopen(os.dup(1), "w", buffering=1)
            self._saved = (os.dup(1), os.dup(2))
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)

    def print(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def mark(self, text: str) -> None:
        """A marker line in the run log (so each run's lines can be found)."""
        print(f"\n===== launch benchmark: {text}", flush=True)


# ------------------------------------------------------------------------------------------ (a)
def bare_torchrun(nodes: int, logs: Path) -> dict:
    """N torchrun agents, one per simulated node, rendezvous on 127.0.0.1; each one's output to a file."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    port = ports.free_port("127.0.0.1")
    procs = []
    for i in range(nodes):
        with open(logs / f"node-{i:02d}.log", "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={i}",
                 "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", str(PROGRAM)],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=logs))
    codes = [p.wait() for p in procs]
    wall = time.monotonic() - t0
    ok_lines = sum((logs / f"node-{i:02d}.log").read_text().count("all_reduce ok") for i in range(nodes))
    if any(codes) or ok_lines != nodes:
        raise RuntimeError(f"bare torchrun on {nodes} nodes: exit codes {codes}, {ok_lines}/{nodes} ranks ok "
                           f"(logs in {logs})")
    return {"wall": wall}


# ------------------------------------------------------------------------------------------ (b)
class _RayClock:
    """Stands in for `ray` inside a4ray.runtime.gang while a gang starts, noting when its first
    `ray.wait` (the placement group is ready) and its first `ray.get` (every actor's facts) return."""

    def __init__(self, real, marks: dict[str, float]):
        self._real = real
        self._marks = marks
        self.starting = False

    def __getattr__(self, name):
        return getattr(self._real, name)

    def wait(self, *args, **kwargs):
        result = self._real.wait(*args, **kwargs)
        if self.starting:
            self._marks.setdefault("pg_ready", time.monotonic())
        return result

    def get(self, *args, **kwargs):
        result = self._real.get(*args, **kwargs)
        if self.starting:
            self._marks.setdefault("facts", time.monotonic())
        return result


@contextlib.contextmanager
def gang_clock(marks: dict[str, float]):
    """Timestamps of the gang's phases, taken from outside a4ray (nothing in a4ray changes): around
    Gang.start (and the waits inside it), Supervisor.watch and Gang.close."""
    import a4ray.runtime.gang as g
    from a4ray.runtime.supervisor import Supervisor

    clock = _RayClock(g.ray, marks)
    start, watch, close, emit = g.Gang.start, Supervisor.watch, g.Gang.close, Supervisor._emit

    def timed_start(self):
        marks.setdefault("start_in", time.monotonic())
        clock.starting = True
        try:
            return start(self)
        finally:
            clock.starting = False
            marks.setdefault("start_out", time.monotonic())

    def timed_watch(self):
        marks["watch_in"], marks["watch_cpu_in"] = time.monotonic(), time.process_time()
        try:
            return watch(self)
        finally:
            marks["watch_out"], marks["watch_cpu_out"] = time.monotonic(), time.process_time()

    def timed_close(self):
        marks.setdefault("close_in", time.monotonic())
        close(self)

    def counted_emit(self, rank, poll):
        marks["answers"] = marks.get("answers", 0) + 1  # poll answers the supervisor handled
        emit(self, rank, poll)

    saved = g.ray, g.Gang.start, Supervisor.watch, g.Gang.close, Supervisor._emit
    g.ray, g.Gang.start, Supervisor.watch, g.Gang.close, Supervisor._emit = (
        clock, timed_start, timed_watch, timed_close, counted_emit)
    try:
        yield marks
    finally:
        g.ray, g.Gang.start, Supervisor.watch, g.Gang.close, Supervisor._emit = saved


def command_spec(nodes: int, workspace: Path, argv: list[str], *, torchrun: bool, launcher: str = "a4ray"):
    from a4ray.spec import CommandJob
    from a4ray.spec.overrides import validate

    command = {"argv": argv, "torchrun": torchrun, **({"nproc": 1} if torchrun else {})}
    return validate(CommandJob, {
        "kind": "command", "name": "launch-bench", "timeout_s": 600, "command": command,
        "cluster": {"nodes": nodes, "gpus_per_node": 1, "cpus_per_node": 1, "launcher": launcher},
        "storage": {"local_workspace": str(workspace)},
    }, "<launch benchmark>")


def _cpu(proc) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def idle_rates(gcs, seconds: float = 5.0) -> dict[str, float]:
    """CPU seconds per second this driver and the GCS spend with no launch at all (Ray's own threads in
    the driver; the raylets' heartbeats and reports in the GCS, which grow with the nodes)."""
    cpu0, gcs0 = time.process_time(), _cpu(gcs)
    time.sleep(seconds)
    return {"driver": (time.process_time() - cpu0) / seconds, "gcs": (_cpu(gcs) - gcs0) / seconds}


def gang(nodes: int, workspace: Path, gcs, launcher: str = "a4ray") -> dict:
    """a4ray's public run path, timed end to end; the phases from `gang_clock`. Also the CPU this
    driver and the GCS spent on it: the two places every node's work meets (on A4 each node's own
    work runs on its own CPUs; here all of it shares this machine's)."""
    from a4ray.driver import execute as runner

    marks: dict[str, float] = {}
    cpu0, gcs0 = time.process_time(), _cpu(gcs)
    with gang_clock(marks):
        t0 = time.monotonic()
        spec = command_spec(nodes, workspace, [str(PROGRAM)], torchrun=True, launcher=launcher)
        result = runner.run(spec)
        t_end = time.monotonic()
    driver_cpu, gcs_cpu = time.process_time() - cpu0, _cpu(gcs) - gcs0
    if not result.ok:
        raise RuntimeError(f"gang on {nodes} nodes: {result.verdict}")
    g = result.gang
    phases = {
        "prep": marks["start_in"] - t0,
        "placement": marks["pg_ready"] - marks["start_in"],
        "actors+facts": marks["start_out"] - marks["pg_ready"],
        "launch": marks["watch_in"] - marks["start_out"],
        "processes": marks["watch_out"] - marks["watch_in"],
        "finish": t_end - marks["watch_out"],
    }
    node_s = max(n.duration_s or 0.0 for n in g.nodes)  # the rank launcher's run, as each node actor saw it
    return {"wall": t_end - t0, "start_s": g.start_s, "run_s": g.run_s, "node_s": node_s, **phases,
            "driver_cpu": driver_cpu, "gcs_cpu": gcs_cpu, "answers": marks.get("answers", 0)}


# ------------------------------------------------------------------------------------------ (c)
def ray_train(nodes: int, storage: Path, index: int) -> dict:
    import ddp_trivial
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    t0 = time.monotonic()
    trainer = TorchTrainer(
        ddp_trivial.train_loop_per_worker,
        scaling_config=ScalingConfig(num_workers=nodes, use_gpu=False, resources_per_worker={"CPU": 1},
                                     placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(storage_path=str(storage), name=f"launch-bench-{nodes}-{index}"),
    )
    result = trainer.fit()
    wall = time.monotonic() - t0
    if result.error is not None:
        raise RuntimeError(f"Ray Train on {nodes} nodes: {result.error}")
    return {"wall": wall}


# ------------------------------------------------------------------------------------------ Ray's floor
def ray_floor(nodes: int, gcs) -> dict:
    """The gang's start with nothing of a4ray in it: the same placement group (STRICT_SPREAD, the same
    bundles) and the same actor options, an empty class, one call to each; then both removed."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from a4ray.spec.cluster import ClusterSpec

    class Empty:  # defined here so that it travels by value: workers need not import this file
        def ping(self) -> int:
            return os.getpid()

    c = ClusterSpec(nodes=nodes, gpus_per_node=1, cpus_per_node=1)
    cpu0, gcs0 = time.process_time(), _cpu(gcs)
    t0 = time.monotonic()
    pg = placement_group([{"CPU": c.cpus_per_node, "GPU": c.gpus_per_node, c.node_resource: 1}] * nodes,
                         strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=120)
    t_pg = time.monotonic()
    actor_cls = ray.remote(Empty)
    actors = [actor_cls.options(num_cpus=c.cpus_per_node, num_gpus=c.gpus_per_node,
                                resources={c.node_resource: 1}, max_concurrency=8,
                                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                                ).remote() for i in range(nodes)]
    ray.get([a.ping.remote() for a in actors], timeout=120)
    t_actors = time.monotonic()
    for a in actors:
        ray.kill(a)
    remove_placement_group(pg)
    time.sleep(0.5)  # the kills and the removal, which the GCS handles after these calls return
    return {"wall": t_actors - t0, "placement": t_pg - t0, "actors": t_actors - t_pg,
            "driver_cpu": time.process_time() - cpu0, "gcs_cpu": _cpu(gcs) - gcs0, "cpu_s": time.monotonic() - t0}


# ------------------------------------------------------------------------------------------ fan-in
def fanin(nodes: int, lines: int, workspace: Path, logs: Path, idle_s: float = 5.0) -> dict:
    """What streaming every node's lines through the driver costs: a command printing `lines` lines on
    every node, through the gang and bare (its output to a file), the same N processes; and the driver's
    CPU while N nodes run a silent `sleep` (the long polls of supervision alone)."""
    from a4ray.driver import execute as runner

    argv = [sys.executable, "-c", f"import sys\nfor i in range({lines}): sys.stdout.write(f'line {{i}}\\n')"]
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    procs = []
    for i in range(nodes):
        with open(logs / f"fanin-{i:02d}.log", "w") as out:
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT))
    if any(p.wait() for p in procs):
        raise RuntimeError("the fan-in command failed bare")
    bare = time.monotonic() - t0
    busy: dict[str, float] = {}
    with gang_clock(busy):
        result = runner.run(command_spec(nodes, workspace, argv, torchrun=False))
    if not result.ok:
        raise RuntimeError(f"fan-in through the gang: {result.verdict}")
    cpu0 = time.process_time()
    time.sleep(idle_s)  # what this driver spends with no gang at all (Ray's own threads in it)
    baseline = (time.process_time() - cpu0) / idle_s
    # An idle node answers its long poll every POLL_WAIT_S; answering often makes each answer's cost
    # measurable above the driver's own noise.
    import a4ray.runtime.supervisor as g

    quiet: dict[str, float] = {}
    wait_s, g.POLL_WAIT_S = g.POLL_WAIT_S, 0.05
    try:
        with gang_clock(quiet):
            silent = runner.run(command_spec(nodes, workspace, ["sleep", f"{idle_s:g}"], torchrun=False))
    finally:
        g.POLL_WAIT_S = wait_s
    if not silent.ok:
        raise RuntimeError(f"sleep through the gang: {silent.verdict}")
    total = nodes * lines
    watched = quiet["watch_out"] - quiet["watch_in"]
    return {"nodes": nodes, "lines": total, "bare_s": bare, "gang_run_s": result.gang.run_s,
            "us_per_line": max(0.0, result.gang.run_s - bare) / total * 1e6,
            # driver CPU while the supervisor streamed them (the polls' own cost is a small part here)
            "driver_us_per_line": (busy["watch_cpu_out"] - busy["watch_cpu_in"]) / total * 1e6,
            "ms_per_answer": max(0.0, quiet["watch_cpu_out"] - quiet["watch_cpu_in"] - baseline * watched)
                             / quiet["answers"] * 1e3, "poll_wait_s": wait_s}


def wait_cost(pending: int) -> float:
    """Driver ms of one `ray.wait(num_returns=1)` over `pending` outstanding calls (the supervisor's loop
    makes one per batch of answers, over one long poll per node)."""
    import asyncio

    import ray

    @ray.remote(num_cpus=0, max_concurrency=pending + 1)
    class Holder:
        async def hold(self, s: float) -> float:
            await asyncio.sleep(s)
            return s

    holder = Holder.remote()
    ray.get(holder.hold.remote(0))
    refs = [holder.hold.remote(600) for _ in range(pending)]
    time.sleep(1)
    t0, calls = time.perf_counter(), 200
    for _ in range(calls):
        ray.wait(refs, num_returns=1, timeout=0)
    cost = (time.perf_counter() - t0) / calls * 1e3
    ray.kill(holder)
    return cost


# ------------------------------------------------------------------------------------------ tables
def _machine_cpu() -> float:
    """CPU seconds the whole machine has spent (every process: Ray's, the ranks', this one's)."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.system + getattr(t, "nice", 0.0)


def cpu_table(sizes: list[int], runs: dict[int, dict[str, list[dict]]]) -> str:
    """What each way costs the machine: on this one the CPU work of N nodes shares its cores, so
    CPU-seconds / cores is a floor under the wall time (on A4 each node's work runs on its own CPUs)."""
    cores = os.cpu_count() or 1
    rows = []
    for m in (*METHODS, "gang_torchrun"):
        meds = [statistics.median(r["machine_cpu"] for r in runs[n][m]) for n in sizes]
        slope = _slope(sizes, meds)
        rows.append([LABELS[m], *(f"{v:.1f}" for v in meds), f"{slope:.2f}" if slope is not None else "-"])
    return _table(f"machine CPU-seconds per launch, medians ({cores} cores: wall time >= CPU-seconds / {cores})",
                  ["", *(f"{n} nodes" for n in sizes), "CPU-s/node"], rows)


def _stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _table(title: str, columns: list[str], rows: list[list[object]]) -> str:
    from a4ray.core.console import table

    return f"{title}\n{table('', columns, rows)}"  # the title on its own line: rich would wrap it to the table


def size_table(nodes: int, runs: dict[str, list[dict]], reps: int) -> str:
    rows = []
    for m in (*METHODS, "gang_torchrun"):
        med, lo, hi = _stats([r["wall"] for r in runs[m]])
        rows.append([LABELS[m], f"{med:.2f}", f"{lo:.2f}", f"{hi:.2f}"])
    return _table(f"{nodes} nodes: launch -> every rank done -> returned, seconds ({reps} reps)",
                  ["", "median", "min", "max"], rows)


def phase_table(sizes: list[int], gang_runs: dict[int, list[dict]]) -> str:
    rows = []
    keys = ("start_s", "run_s", *PHASES[:5], "node_s", *PHASES[5:], "wall")
    for key in keys:
        label = {"start_s": "GangResult.start_s", "run_s": "GangResult.run_s", "wall": "total (b)",
                 "node_s": "  rank launcher itself"}.get(key, key)
        meds = [statistics.median(r[key] for r in gang_runs[n]) for n in sizes]
        slope = _slope(sizes, meds)
        rows.append([label, *(f"{v:.2f}" for v in meds), f"{slope * 1000:+.0f}" if slope is not None else "-",
                     PHASE_NOTES.get(key, "placement + actors + facts" if key == "start_s" else
                                     "launch request -> results collected" if key == "run_s" else "")])
    return _table("the gang's time by phase, medians in seconds (timed from outside a4ray)",
                  ["phase", *(f"{n} nodes" for n in sizes), "ms/node", "what"], rows)


def _slope(xs: list[int], ys: list[float]) -> float | None:
    """Least-squares seconds per node."""
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def growth_summary(sizes: list[int], runs: dict[int, dict[str, list[dict]]]) -> list[str]:
    lines = []
    for n in sizes:
        gang_runs, floor = runs[n]["gang"], runs[n]["floor"]
        meds = {p: statistics.median(r[p] for r in gang_runs) for p in PHASES}
        total = statistics.median(r["wall"] for r in gang_runs)
        start = meds["placement"] + meds["actors+facts"]
        ray_pg, ray_actors = (statistics.median(r[k] for r in floor) for k in ("placement", "actors"))
        lines.append(f"  {n} nodes: start {start:.2f}s = placement {meds['placement']:.2f}s + actors and facts "
                     f"{meds['actors+facts']:.2f}s; Ray's floor (same placement group, empty actors) "
                     f"{ray_pg + ray_actors:.2f}s, so a4ray's own part {start - ray_pg - ray_actors:+.2f}s; "
                     f"the whole launch: processes {meds['processes']:.2f}s of {total:.2f}s")
    if len(sizes) > 1:
        series = {
            "gang start": [statistics.median(r["placement"] + r["actors+facts"] for r in runs[n]["gang"]) for n in sizes],
            "Ray's floor": [statistics.median(r["wall"] for r in runs[n]["floor"]) for n in sizes],
            "placement": [statistics.median(r["placement"] for r in runs[n]["gang"]) for n in sizes],
        }
        for name, meds in series.items():
            lines.append(f"  {name}: " + " -> ".join(f"{v:.2f}s" for v in meds)
                         + f" for {' -> '.join(map(str, sizes))} nodes ({_slope(sizes, meds) * 1000:+.0f} ms/node)")
    return lines


def ratio_table(sizes: list[int], runs: dict[int, dict[str, list[dict]]]) -> tuple[str, bool]:
    rows, met = [], True
    for n in sizes:
        med = {m: statistics.median(r["wall"] for r in runs[n][m]) for m in (*METHODS, "gang_torchrun")}
        vs_a, vs_c = med["gang"] / med["torchrun"], med["gang"] / med["ray_train"]
        ok_a, ok_c = vs_a <= GOAL_VS_TORCHRUN, vs_c <= GOAL_VS_RAY_TRAIN
        met &= ok_a and ok_c
        rows.append([f"{n}", f"{vs_a:.2f}", "PASS" if ok_a else "MISS", f"{vs_c:.2f}", "PASS" if ok_c else "MISS",
                     f"{med['gang_torchrun'] / med['torchrun']:.2f}", f"{med['gang_torchrun'] / med['ray_train']:.2f}"])
    return _table(f"ratios of medians (goals: b/a <= {GOAL_VS_TORCHRUN}, b/c <= {GOAL_VS_RAY_TRAIN}; b' for comparison)",
                  ["nodes", "b/a", "", "b/c", "", "b'/a", "b'/c"], rows), met


# ------------------------------------------------------------------------------------------ main
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="2,4,8", help="simulated node counts, ascending (default 2,4,8)")
    p.add_argument("--reps", type=int, default=5, help="timed rounds per size (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of all of them per size (default 1)")
    p.add_argument("--pause", type=float, default=1.0, help="seconds between runs, to let teardown settle")
    p.add_argument("--fanin-lines", type=int, default=20000,
                   help="lines per node for the log fan-in measurement at the largest size (0: skip)")
    p.add_argument("--logs", help="run log and per-run files (default: a temporary directory, kept)")
    p.add_argument("--verbose", action="store_true", help="leave every rank's lines on the terminal")
    args = p.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",")})

    work = Path(args.logs or tempfile.mkdtemp(prefix="a4ray-launch-bench-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    # Ray's socket paths must stay short: a RAY_TMPDIR of its own under /tmp.
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="r", dir="/tmp")
    os.environ.pop("RAY_ADDRESS", None)
    report = Report(work / "run.log", args.verbose)
    report.print(f"launch benchmark: sizes {sizes}, {args.reps} reps after {args.warmup} warm-up round(s) "
                 f"of all of them, {os.cpu_count()} CPU cores; run log: {work / 'run.log'}")

    import psutil
    import ray
    import ray.cloudpickle

    from a4ray.runtime.connect import NAMESPACE
    from a4ray.runtime.simulated import SimulatedCluster

    sys.path.insert(0, str(HERE))
    import ddp_trivial

    ray.cloudpickle.register_pickle_by_value(ddp_trivial)  # Ray Train's workers need not find the file

    cluster = SimulatedCluster(sizes[0], gpus_per_node=1, cpus_per_node=2)
    runs: dict[int, dict[str, list[dict]]] = {}
    idle: dict[int, dict[str, float]] = {}
    failures: list[str] = []
    fan = None
    try:
        cluster.start()
        ray.init(address=cluster.address, namespace=NAMESPACE)
        gcs = psutil.Process(cluster.cluster.head_node.all_processes["gcs_server"][0].process.pid)
        count = 0
        for n in sizes:
            while len(cluster.workers) < n:
                cluster.add_node()
            cluster.cluster.wait_for_nodes()
            runs[n] = {m: [] for m in ROTATION}
            idle[n] = idle_rates(gcs)
            for rnd in range(args.warmup + args.reps):
                timed = rnd >= args.warmup
                order = ROTATION[rnd % len(ROTATION):] + ROTATION[:rnd % len(ROTATION)]
                for m in order:
                    count += 1
                    tag = f"{n} nodes, {'rep ' + str(rnd - args.warmup + 1) if timed else 'warm-up'}, {m}"
                    report.mark(tag)
                    time.sleep(args.pause)
                    machine0 = _machine_cpu()
                    for attempt in (1, 2):  # a run that fails is reported and run once more
                        try:
                            if m == "torchrun":
                                r = bare_torchrun(n, work / f"torchrun-{count:03d}-{attempt}")
                            elif m == "gang":
                                r = gang(n, work / "workspace", gcs)
                            elif m == "gang_torchrun":
                                r = gang(n, work / "workspace", gcs, launcher="torchrun")
                            elif m == "floor":
                                r = ray_floor(n, gcs)
                            else:
                                r = ray_train(n, work / "ray-train", count)
                            break
                        except Exception as e:  # noqa: BLE001 - counted and shown; a second failure ends the run
                            failures.append(f"{tag}: {e}".splitlines()[0])
                            report.print(f"run failed, running it once more: {failures[-1]}")
                            if attempt == 2:
                                raise
                    r["machine_cpu"] = _machine_cpu() - machine0
                    report.mark(f"{tag}: {r['wall']:.2f}s")
                    if timed:
                        runs[n][m].append(r)
            report.print(size_table(n, runs[n], args.reps))
        if args.fanin_lines:
            report.mark("log fan-in")
            time.sleep(args.pause)
            fan = fanin(sizes[-1], args.fanin_lines, work / "workspace", work / "fanin")
            fan["wait_ms"] = {n: wait_cost(n) for n in (64, 512)}
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)

    gang_runs = {n: runs[n]["gang"] for n in sizes}
    (work / "results.json").write_text(json.dumps({"runs": runs, "idle_cpu_per_s": idle, "fanin": fan,
                                                   "failures": failures}, indent=1))
    report.print()
    report.print(phase_table(sizes, gang_runs))
    report.print("what dominates the gang's start, and how it grows:")
    for line in growth_summary(sizes, runs):
        report.print(line)
    report.print("where every node's work meets (serial however many nodes): CPU seconds per launch, medians, "
                 "above what each spends idle over the same time")
    per_answer = fan["ms_per_answer"] / 1e3 if fan else 0.0
    series = {
        "this driver, gang": [statistics.median(r["driver_cpu"] - idle[n]["driver"] * r["wall"] for r in gang_runs[n])
                              for n in sizes],
        "  less its answers to idle long polls": [
            statistics.median(r["driver_cpu"] - idle[n]["driver"] * r["wall"] - r["answers"] * per_answer
                              for r in gang_runs[n]) for n in sizes],
        "this driver, Ray's floor": [statistics.median(r["driver_cpu"] - idle[n]["driver"] * r["cpu_s"]
                                                       for r in runs[n]["floor"]) for n in sizes],
        "the GCS, gang": [statistics.median(r["gcs_cpu"] - idle[n]["gcs"] * r["wall"] for r in gang_runs[n])
                          for n in sizes],
        "the GCS, Ray's floor": [statistics.median(r["gcs_cpu"] - idle[n]["gcs"] * r["cpu_s"] for r in runs[n]["floor"])
                                 for n in sizes],
    }
    for name, meds in series.items():
        slope = _slope(sizes, meds)
        report.print(f"  {name}: " + " -> ".join(f"{v:.3f}s" for v in meds) + f" for {' -> '.join(map(str, sizes))} "
                     f"nodes" + (f" ({slope * 1000:+.1f} ms/node)" if slope is not None else ""))
    report.print("  idle: this driver " + ", ".join(f"{idle[n]['driver'] * 1e3:.1f}" for n in sizes)
                 + " ms/s; the GCS " + ", ".join(f"{idle[n]['gcs'] * 1e3:.1f}" for n in sizes)
                 + f" ms/s at {', '.join(map(str, sizes))} nodes")
    if fan:
        report.print(f"log fan-in through the driver, {fan['nodes']} nodes x {args.fanin_lines} lines: run "
                     f"{fan['gang_run_s']:.2f}s through the gang vs {fan['bare_s']:.2f}s bare to files: "
                     f"{fan['us_per_line']:.1f} us per line more ({fan['lines'] / fan['gang_run_s']:,.0f} lines/s), "
                     f"{fan['driver_us_per_line']:.1f} us of driver CPU per line")
        report.print(f"supervision alone: {fan['ms_per_answer']:.2f} ms of driver CPU per answer of an idle node's "
                     f"long poll (timed with answers every 0.05s); an idle node answers every "
                     f"{fan['poll_wait_s']:g}s: {fan['ms_per_answer'] / fan['poll_wait_s']:.2f} ms per node per second")
        report.print("the supervisor's ray.wait over one pending poll per node: " + ", ".join(
            f"{ms:.2f} ms at {n} nodes" for n, ms in fan["wait_ms"].items()))
    report.print()
    rows = []
    for n in sizes:
        rows.append([str(n), *(f"{statistics.median(r['wall'] for r in runs[n][m]):.2f} "
                               f"({min(r['wall'] for r in runs[n][m]):.2f}-{max(r['wall'] for r in runs[n][m]):.2f})"
                               for m in METHODS)])
    report.print(_table(f"launch -> every rank done -> returned: median (min-max) seconds, {args.reps} reps",
                        ["nodes", *(LABELS[m] for m in METHODS)], rows))
    report.print(cpu_table(sizes, runs))
    report.print()
    text, met = ratio_table(sizes, runs)
    report.print(text)
    report.print("goals met at every size" if met else "goals missed at some size (see MISS)")
    report.print(f"failed runs (each run once more): {len(failures)}" + "".join(f"\n  {f}" for f in failures))
    report.print(f"every run's figures: {work / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
