"""Goodput soak: the same training program, checkpoint interval and seeded faults under three launchers, and what each
fault costs under each.

    python benchmarks/goodput_soak.py [--rounds 6] [--iterations 40] [--faults sigkill,sigstop,early,node]

launchers  a4ray      `a4ray.driver.execute.run` of a `command` job (torchrun's env contract, a4ray's rank
                      launcher) with its restart policy (restart.max_restarts, backoff 0)
           torchrun   one `until torchrun ...; do :; done` loop a node (static rendezvous, --max-restarts 0): what a
                      JobSet that recreates its pods amounts to
           ray_train  Ray Train's TorchTrainer with FailureConfig(max_failures), one worker a rank
faults     sigkill    rank 1 SIGKILLed
           sigstop    rank 1 SIGSTOPped: a hang (a4ray's watchdog: --pace-floor-s; the others: the process group's
                      own timeout, --pg-timeout-s, the same for all)
           early      rank 1 returns from its loop (exit 0) while the others go on
           node       the node of rank 1 lost: a4ray and Ray Train lose a simulated Ray node (its raylet and every
                      process on it; a spare node is there to take its place); torchrun loses its node's loop and
                      everything under it, and a new loop is started at once (a recreated pod, at no cost)
Every fault is injected once the run passes an iteration drawn from --seed, the same for every launcher, and has
trained --settle-s (then at the first iteration as far past a checkpoint as the drawn one). The program
(rank 0) records each iteration's own step time and when it ended; each rank its pid at start. Per fault:
detection = the fault -> every process of the faulted ranks gone; recovery = that -> the first iteration of the new
processes; lost work = the iterations redone (the fault's iteration - the checkpoint resumed from) x the step time;
time lost = the fault -> the first new iteration, plus the lost work. ETTR = iterations x step time / wall. A
fault-free leg of each launcher, in --rounds alternating rounds, gives the step time (median) and the ratios.

CPU: 2 simulated nodes x 2 ranks over gloo (a third node stands by for the node fault). GPUs: 2 x 1 over NCCL
(--gpus-per-node 1; no spare node, so no node fault), where the machine has 2 GPUs or more and --cpu is not given.
Ray Train needs `pip install 'a4ray[bench]'`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAUNCHERS = ("a4ray", "torchrun", "ray_train")
FAULTS = ("sigkill", "sigstop", "early", "node")
VICTIM = 1

PROGRAM = r'''
"""The soak's training program, the same under every launcher: matmuls and an all-reduce a step, a checkpoint (a
state file, in Megatron-LM's words) every EVERY iterations, resumed from on a restart."""
import datetime, json, os, sys, time
from pathlib import Path

import torch
import torch.distributed as dist


def main(argv, device=None):
    work, total, every, size, save_s, timeout_s, on = (Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]),
                                                       float(argv[4]), float(argv[5]), argv[6])
    gpu = on == "gpu"
    if not dist.is_initialized():  # a4ray and torchrun start ranks with torchrun's env; Ray Train makes the group
        if gpu:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if gpu else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    if not gpu:
        torch.set_num_threads(1)  # the same under every launcher, whatever OMP_NUM_THREADS each sets
    rank = dist.get_rank()
    with open(work / "ranks.log", "a") as f:
        f.write(f"{time.time():.6f} {rank} {os.getpid()}\n")
    state = work / "state.json"
    start = json.loads(state.read_text())["iteration"] if state.exists() else 0
    torch.manual_seed(rank)
    weight = torch.randn(size, size, device=device) / size ** 0.5
    x = torch.randn(size, size, device=device)
    for it in range(start + 1, total + 1):
        end = work / f"end-rank{rank}"
        if end.exists():  # the fault "a rank ends early"
            end.unlink()
            print(f"rank {rank}: ending early, before iteration {it}", flush=True)
            return
        t0 = time.perf_counter()
        for _ in range(4):
            x = torch.tanh(x @ weight)
        grad = x.sum(0)
        dist.all_reduce(grad)
        if gpu:
            torch.cuda.synchronize(device)
        step = time.perf_counter() - t0
        if rank == 0:
            print(f" iteration {it:8d}/{total:8d} | elapsed time per iteration (ms): {step * 1000:.1f} |"
                  f" lm loss: {1 / it:.4E} |", flush=True)
            with open(work / "progress.log", "a") as f:
                f.write(f"{time.time():.6f} {it} {os.getpid()} {step:.6f}\n")
        if it % every == 0:
            if rank == 0:
                print(f"saving checkpoint at iteration {it:7d} to {state}", flush=True)
                time.sleep(save_s)
                tmp = state.with_suffix(".tmp")
                tmp.write_text(json.dumps({"iteration": it}))
                tmp.replace(state)
                print(f"  successfully saved checkpoint from iteration {it:7d} to {state}", flush=True)
            dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
    dist.destroy_process_group()
'''

RAY_TRAIN_DRIVER = r'''
import json, sys, time
import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

cfg = json.loads(sys.argv[1])
ray.init(address=cfg["address"], log_to_driver=False)


def loop(config):
    import runpy
    import ray.train.torch
    runpy.run_path(config["program"], run_name="soak")["main"](config["argv"], device=ray.train.torch.get_device())


t0 = time.time()
trainer = TorchTrainer(
    loop, train_loop_config={"program": cfg["program"], "argv": cfg["argv"]},
    torch_config=TorchConfig(timeout_s=int(cfg["pg_timeout_s"])),
    scaling_config=ScalingConfig(num_workers=cfg["workers"], use_gpu=cfg["gpu"], resources_per_worker=cfg["resources"]),
    run_config=RunConfig(storage_path=cfg["storage"], name=cfg["name"],
                         failure_config=FailureConfig(max_failures=cfg["max_failures"])))
error = None
try:
    result = trainer.fit()
    error = str(result.error) if result.error else None
except Exception as e:  # Ray Train v2 raises when the run fails
    error = f"{type(e).__name__}: {e}"
print("SOAK-RESULT " + json.dumps({"wall": time.time() - t0, "error": error}), flush=True)
'''


# ------------------------------------------------------------------------------------------- the records
def progress(work: Path) -> list[tuple[float, int, int, float]]:
    """(when, iteration, rank 0's pid, its step time) of every iteration rank 0 finished, in order."""
    path = work / "progress.log"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:
            out.append((float(parts[0]), int(parts[1]), int(parts[2]), float(parts[3])))
    return out


def incarnation(work: Path) -> dict[int, int]:
    """rank -> pid of the ranks now running (each rank's latest start)."""
    ranks: dict[int, int] = {}
    path = work / "ranks.log"
    for line in (path.read_text().splitlines() if path.exists() else []):
        _, rank, pid = line.split()
        ranks[int(rank)] = int(pid)
    return ranks


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def step_time(work: Path) -> float | None:
    steps = [s for _, it, _, s in progress(work)][2:]  # the first steps warm up
    return statistics.median(steps) if steps else None


class Fault(threading.Thread):
    """Injects `kind` into rank VICTIM once rank 0 has passed iteration `at` and the run has trained `settle_s` since
    its first iteration (then at the first iteration past both that is `at`'s place between checkpoints, so that
    every launcher redoes as many iterations), then times what follows."""

    def __init__(self, kind: str, at: int, every: int, settle_s: float, work: Path, lose_node, done: threading.Event):
        super().__init__(daemon=True)
        self.kind, self.at, self.every, self.settle_s = kind, at, every, settle_s
        self.work, self.lose_node, self.done = work, lose_node, done
        self.figures: dict[str, float | int | None] = {}
        self.victim: int | None = None

    def due(self, seen: list[tuple[float, int, int, float]]) -> bool:
        if not seen:
            return False
        it = seen[-1][1]
        return (it >= self.at and seen[-1][0] - seen[0][0] >= self.settle_s
                and (it - self.at) % self.every == 0)

    def run(self) -> None:
        while not self.done.is_set():
            if self.due(progress(self.work)):
                break
            time.sleep(0.005)
        else:
            return
        ranks = incarnation(self.work)
        self.victim, rank0 = ranks[VICTIM], ranks[0]
        at_fault = progress(self.work)[-1][1]
        if self.kind == "sigkill":
            os.kill(self.victim, signal.SIGKILL)
        elif self.kind == "sigstop":
            os.kill(self.victim, signal.SIGSTOP)
        elif self.kind == "early":
            (self.work / f"end-rank{VICTIM}").touch()
        elif self.kind == "node":
            self.lose_node(self.victim)
        t_fault = time.time()
        gone = first = None
        while not self.done.is_set() and (gone is None or first is None):
            now = time.time()
            if gone is None and not any(alive(pid) for pid in ranks.values()):
                gone = now
            if first is None:
                new = [p for p in progress(self.work) if p[0] > t_fault and p[2] != rank0]
                if new:
                    first = new[0]
            time.sleep(0.01)
        # the furthest the faulted ranks got (rank 0 may finish an iteration or two after the fault: NCCL's
        # collectives are queued, and a stopped peer had joined the last one)
        reached = max([it for _, it, pid, _ in progress(self.work) if pid == rank0] + [at_fault])
        self.figures = {"fault_at": t_fault, "iteration": reached,
                        "gone": gone - t_fault if gone else None,
                        "first": first[0] - t_fault if first else None,
                        "resumed_from": first[1] - 1 if first else None}

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)
        if self.kind == "sigstop" and self.victim and alive(self.victim):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(self.victim, sig)
                except OSError:
                    pass


# -------------------------------------------------------------------------------------------- launchers
class Soak:
    def __init__(self, args, root: Path):
        self.args, self.root = args, root
        self.gpu = args.gpus_per_node_real
        self.cluster = None
        self.nodes = 2  # the cluster's size
        self.legs = 0

    def argv(self, work: Path) -> list[str]:
        a = self.args
        return [str(work), str(a.iterations), str(a.every), str(a.size), str(a.save_s), str(a.pg_timeout_s),
                "gpu" if self.gpu else "cpu"]

    def leg(self, launcher: str, fault: str | None, at: int | None) -> dict:
        self.legs += 1
        work = self.root / f"{self.legs:02d}-{launcher}-{fault or 'none'}"
        work.mkdir(parents=True)
        program = work / "train.py"
        program.write_text(PROGRAM)
        done = threading.Event()
        injector = Fault(fault, at, self.args.every, self.args.settle_s, work, lambda pid: self.lose_node(launcher, pid),
                         done) if fault else None
        self.loops: dict[int, subprocess.Popen] = {}
        if injector:
            injector.start()
        t0 = time.time()
        try:
            own = getattr(self, launcher)(work, program)
        finally:
            wall = time.time() - t0
            if injector:
                injector.stop()
            self.clean(work)
            while len(self.cluster.workers) < self.nodes:  # a lost node replaced for the next leg
                self.cluster.add_node()
        seen = progress(work)
        out = {"launcher": launcher, "fault": fault, "at": at, "wall": own.pop("wall", wall),
               "iterations": seen[-1][1] if seen else 0, "step": step_time(work), **own}
        if injector:
            out.update(injector.figures)
        print(f"  leg {self.legs}: {launcher:9s} {fault or 'fault-free':10s} wall {out['wall']:6.1f}s, reached "
              f"iteration {out['iterations']}/{self.args.iterations}" + (f", {own['note']}" if own.get("note") else ""),
              flush=True)
        return out

    def clean(self, work: Path) -> None:
        """Whatever of this leg still runs (a stopped rank, a loop past its cap)."""
        import psutil

        for loop in self.loops.values():
            try:
                os.killpg(loop.pid, signal.SIGKILL)
            except OSError:
                pass
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if str(work) in " ".join(proc.info["cmdline"] or []):
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
            except psutil.Error:
                pass
        for pid in incarnation(work).values():  # Ray Train's ranks are Ray workers: their command lines name no leg
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    # a4ray -------------------------------------------------------------------------------------------
    def a4ray(self, work: Path, program: Path) -> dict:
        from a4ray.driver.execute import run
        from a4ray.spec import load_job

        a = self.args
        spec = load_job(None, [
            "cluster.nodes=2", f"cluster.gpus_per_node={a.gpus_per_node}", "command.torchrun=true",
            f"storage.local_workspace={work / 'ws'}", f"command.argv=[{program}, {', '.join(self.argv(work))}]",
            "restart.max_restarts=2", "restart.backoff_s=0", "cluster.stop_grace_s=5", f"timeout_s={a.cap_s}",
            # the third node stands by as a4ray's spare, ranks warm, in every leg (what a user who keeps one pays)
            f"cluster.spare_nodes={self.nodes - 2}",
            f"observe.watchdog.pace_floor_s={a.pace_floor_s}", f"observe.watchdog.record_timeout_s={a.record_timeout_s}",
            f"observe.summary_every={a.iterations}", *a.set], kind="command")
        result = run(spec)
        g = result.goodput
        incident = g.incidents[0] if g and g.incidents else None
        return {"ok": result.ok, "note": g.line() if g else result.verdict, "goodput": g.goodput if g else None,
                "verdict_at": incident.verdict_at if incident else None}

    # torchrun in a retry loop ---------------------------------------------------------------------------------
    def torchrun(self, work: Path, program: Path) -> dict:
        from a4ray.core import ports

        a = self.args
        self.torchrun_cmd = lambda node: (
            f"until {sys.executable} -m torch.distributed.run --nnodes=2 --node-rank={node} "
            f"--nproc-per-node={a.gpus_per_node} --master-addr=127.0.0.1 --master-port={self.port} --max-restarts=0 "
            f"{program} {' '.join(self.argv(work))}; do :; done")
        self.port = ports.free_port("127.0.0.1")
        self.torchrun_log = open(work / "torchrun.log", "a")
        for node in range(2):
            self.start_loop(node)
        deadline = time.time() + a.cap_s
        while time.time() < deadline and any(loop.poll() is None for loop in list(self.loops.values())):
            time.sleep(0.05)
        finished = all(loop.poll() == 0 for loop in self.loops.values())
        return {"ok": finished and bool(progress(work)) and progress(work)[-1][1] == a.iterations,
                "note": "" if finished else f"not done within --cap-s {a.cap_s:g}"}

    def start_loop(self, node: int) -> None:
        env = {**os.environ, "SOAK_NODE": str(node)}
        if self.gpu:  # each node its own GPUs, as the gang's nodes have
            g = self.args.gpus_per_node
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * g + i) for i in range(g))
        self.loops[node] = subprocess.Popen(["bash", "-c", self.torchrun_cmd(node)], env=env, stdout=self.torchrun_log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    # Ray Train ------------------------------------------------------------------------------------------------
    def ray_train(self, work: Path, program: Path) -> dict:
        a = self.args
        ranks = 2 * a.gpus_per_node
        cfg = {"address": self.cluster.address, "program": str(program), "argv": self.argv(work),
               "pg_timeout_s": a.pg_timeout_s, "workers": ranks, "gpu": bool(self.gpu),
               "resources": {"GPU": 1} if self.gpu else {"CPU": a.cpus_per_node // a.gpus_per_node},
               "storage": str(work / "ray-train"), "name": work.name, "max_failures": 2}
        with open(work / "ray_train.log", "w") as log:
            driver = subprocess.Popen([sys.executable, "-c", RAY_TRAIN_DRIVER, json.dumps(cfg)], stdout=subprocess.PIPE,
                                      stderr=log, text=True, start_new_session=True)
            self.loops[0] = driver
            try:
                out, _ = driver.communicate(timeout=a.cap_s)
            except subprocess.TimeoutExpired:
                return {"ok": False, "note": f"not done within --cap-s {a.cap_s:g}"}
        said = [line for line in out.splitlines() if line.startswith("SOAK-RESULT ")]
        if not said:
            return {"ok": False, "note": f"the driver ended with {driver.returncode}, no result (see {log.name})"}
        record = json.loads(said[-1].split(" ", 1)[1])
        return {"ok": record["error"] is None, "wall": record["wall"],
                "note": (record["error"] or "")[:160]}

    # the node fault ---------------------------------------------------------------------------------------------
    def lose_node(self, launcher: str, victim: int) -> None:
        import psutil

        ancestors = {p.pid for p in psutil.Process(victim).parents()}
        if launcher == "torchrun":
            node = next(n for n, loop in self.loops.items() if loop.pid in ancestors)
            os.killpg(self.loops[node].pid, signal.SIGKILL)
            for proc in psutil.process_iter(["environ"]):  # the node's ranks, which left the loop's group
                try:
                    if (proc.info["environ"] or {}).get("SOAK_NODE") == str(node):
                        proc.kill()
                except psutil.Error:
                    pass
            self.start_loop(node)  # the pod recreated, at once
            return
        index = next(i for i, node in self.cluster.workers.items()
                     if any(info.process.pid in ancestors for info in node.all_processes.get("raylet", [])))
        self.cluster.remove_node(index)  # the spare node takes its place; `leg` restores the size (Ray's main thread)


# ---------------------------------------------------------------------------------------------- the report
def fmt(x, unit="s", width=7) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.2f}{unit}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launchers", default=",".join(LAUNCHERS))
    parser.add_argument("--faults", default=None, help=f"comma-separated, of {','.join(FAULTS)} (default: all that fit; "
                        "none: only the fault-free rounds)")
    parser.add_argument("--rounds", type=int, default=6, help="fault-free rounds, alternating the launchers")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--every", type=int, default=5, help="checkpoint interval, iterations")
    parser.add_argument("--size", type=int, default=0, help="matmul size (default: 384 on CPU, 8192 on GPUs)")
    parser.add_argument("--save-s", type=float, default=0.2, help="a checkpoint save's blocking time")
    parser.add_argument("--settle-s", type=float, default=0, help="no fault before the run has trained this long: a "
                        "fault comes hours into a run, and what a launcher does with that time (a4ray: the next "
                        "attempt's ranks warm) counts")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="ranks a node (default: 2 on CPU, 1 on GPUs)")
    parser.add_argument("--cpus-per-node", type=int, default=4)
    parser.add_argument("--cpu", action="store_true", help="the CPU shape (gloo, a spare node) where GPUs are too: "
                        "a machine of many cores measures launchers' step times with less noise than this one's 2")
    parser.add_argument("--pg-timeout-s", type=float, default=60, help="the program's process-group timeout")
    parser.add_argument("--pace-floor-s", type=float, default=5, help="a4ray's observe.watchdog.pace_floor_s")
    parser.add_argument("--record-timeout-s", type=float, default=3, help="a4ray's observe.watchdog.record_timeout_s")
    parser.add_argument("--cap-s", type=float, default=150, help="a leg's limit")
    parser.add_argument("--seed", type=int, default=35)
    parser.add_argument("--json", default=None, help="write every leg's figures here (after each leg)")
    parser.add_argument("--report", default=None, help="only print the report of a --json file of an earlier run")
    parser.add_argument("--set", action="append", default=[], help="another a4ray spec override (repeatable)")
    parser.add_argument("--faults-first", action="store_true", help="the fault legs before the fault-free rounds")
    parser.add_argument("--budget-s", type=float, default=None, help="start no leg after this many seconds; report "
                        "what ran")
    args = parser.parse_args()

    if args.report:
        legs = json.loads(Path(args.report).read_text())
        launchers = [m for m in LAUNCHERS if any(leg["launcher"] == m for leg in legs)]
        faults = [f for f in FAULTS if any(leg["fault"] == f for leg in legs)]
        args.rounds = len({leg["round"] for leg in legs if leg.get("round") is not None})
        args.iterations = max(leg["iterations"] for leg in legs)
        report(legs, launchers, faults, args, f"from {args.report}")
        return 0

    import torch

    args.gpus_per_node_real = not args.cpu and torch.cuda.device_count() >= 2
    args.gpus_per_node = args.gpus_per_node or (1 if args.gpus_per_node_real else 2)
    args.size = args.size or (8192 if args.gpus_per_node_real else 384)
    launchers = args.launchers.split(",")
    if args.faults == "none":
        faults: list[str] | None = []
    elif args.faults:
        faults = args.faults.split(",")
    else:
        faults = None  # all that fit: decided below, once it is known whether there is a spare node
    for given, known, option in ((launchers, LAUNCHERS, "--launchers"), (faults or [], FAULTS, "--faults")):
        if unknown := [name for name in given if name not in known]:
            parser.error(f"{option}: no {', '.join(unknown)}; choose from {','.join(known)}"
                         + (" (or none: only the fault-free rounds)" if option == "--faults" else ""))
    if "ray_train" in launchers:
        try:
            import ray.train.torch  # noqa: F401
        except ImportError as e:
            print(f"Ray Train left out: {e}")
            launchers.remove("ray_train")
    spare = not args.gpus_per_node_real  # logical GPUs: a third node costs nothing; real ones are all in use
    if faults is None:
        faults = [f for f in FAULTS if f != "node" or spare]
    rng = random.Random(args.seed)
    low, high = args.every + 2, args.iterations - args.every  # past the first checkpoint, before the last
    if high < low:
        parser.error(f"--iterations {args.iterations} leaves no room for a fault after the first checkpoint "
                     f"(--every {args.every}): need at least {2 * args.every + 2}")
    schedule = {f: rng.randint(low, high) for f in faults}
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="r", dir="/tmp"))

    import ray

    from a4ray.observe.goodput import project_ettr, projection_table
    from a4ray.runtime.connect import NAMESPACE
    from a4ray.runtime.simulated import SimulatedCluster

    root = Path(tempfile.mkdtemp(prefix="goodput-soak-"))
    soak = Soak(args, root)
    soak.nodes = 3 if spare else 2
    soak.cluster = SimulatedCluster(soak.nodes, args.gpus_per_node, cpus_per_node=args.cpus_per_node)
    legs: list[dict] = []
    device = torch.cuda.get_device_name(0) if args.gpus_per_node_real else f"CPU ({os.cpu_count()} cores)"
    print(f"goodput soak: 2 nodes x {args.gpus_per_node} ranks on {device}, {args.iterations} iterations, a checkpoint "
          f"every {args.every} (+{args.save_s:g}s), faults {schedule} (seed {args.seed}); work in {root}", flush=True)
    try:
        soak.cluster.start()
        ray.init(address=soak.cluster.address, namespace=NAMESPACE, log_to_driver=False)
        planned = [(launcher, None, None, r) for r in range(args.rounds)
                   for launcher in launchers[r % len(launchers):] + launchers[:r % len(launchers)]]
        faulty = [(launcher, f, schedule[f], None) for f in faults for launcher in launchers]
        planned = faulty + planned if args.faults_first else planned + faulty
        started = time.time()
        for launcher, fault, at, r in planned:
            if args.budget_s is not None and time.time() - started > args.budget_s:
                print(f"  --budget-s {args.budget_s:g} spent: {len(planned) - len(legs)} leg(s) not run", flush=True)
                break
            legs.append({**soak.leg(launcher, fault, at), "round": r})
            if args.json:
                Path(args.json).write_text(json.dumps(legs, indent=1))
    finally:
        ray.shutdown()
        soak.cluster.shutdown()
    report(legs, launchers, faults, args, device)
    a4 = [leg for leg in legs if leg["launcher"] == "a4ray"]
    overheads = [leg["first"] for leg in a4 if leg.get("first") is not None]  # the fault -> its first new iteration
    steps = [leg["step"] for leg in a4 if leg["step"]]
    if overheads and steps:
        u0, w, dt = statistics.median(overheads), args.save_s, args.every * statistics.median(steps)
        print(f"\nMeta's ETTR model at A4 scale, from this run's a4ray figures: u0 = {u0:.1f}s (median fault -> first "
              f"new iteration), w = {w:g}s (the save), dt = {dt:.2f}s (the interval), and at the best interval dt*:")
        print(projection_table(project_ettr(u0, w, dt)))
    return 0


def report(legs: list[dict], launchers: list[str], faults: list[str], args, device: str) -> None:
    step = {m: statistics.median([leg["step"] for leg in legs if leg["launcher"] == m and leg["fault"] is None
                                  and leg["step"]] or [float("nan")]) for m in launchers}
    print(f"\nfault-free step time (median of {args.rounds} rounds, each the median step of its leg), {device}:")
    for m in launchers:
        print(f"  {m:9s} {step[m] * 1000:8.2f} ms")
    for other in launchers[1:]:
        ratios = []
        for r in range(args.rounds):
            mine = [leg["step"] for leg in legs if leg.get("round") == r and leg["launcher"] == "a4ray"]
            theirs = [leg["step"] for leg in legs if leg.get("round") == r and leg["launcher"] == other]
            if mine and theirs and mine[0] and theirs[0]:
                ratios.append(mine[0] / theirs[0])
        if ratios:
            print(f"  a4ray / {other}: {statistics.median(ratios):.3f} (median of {len(ratios)} rounds: "
                  f"{', '.join(f'{x:.3f}' for x in ratios)})")
    print("\nper fault (seconds; detection: the fault -> every faulted process gone; recovery: -> the first new "
          "iteration; lost work: iterations redone x step time):")
    print(f"  {'fault':8s} {'launcher':9s} {'at':>3s} {'detection':>10s} {'recovery':>9s} {'redone':>6s} "
          f"{'lost work':>10s} {'time lost':>10s} {'wall':>7s} {'ETTR':>6s}  note (a4ray: its own verdict after the fault)")
    lost: dict[tuple[str, str], float | None] = {}
    for f in faults:
        for m in launchers:
            leg = next((x for x in legs if x["launcher"] == m and x["fault"] == f), None)
            if leg is None:
                continue
            first, gone = leg.get("first"), leg.get("gone")
            redone = max(0, leg["iteration"] - leg["resumed_from"]) if leg.get("resumed_from") is not None else None
            per = step[m] if step[m] == step[m] else leg["step"]  # no fault-free leg ran: the leg's own
            work = redone * per if redone is not None and per is not None else None
            total = first + work if first is not None and work is not None else None
            lost[(f, m)] = total
            capped = f"> {leg['wall']:.0f}s"
            recovery = first - gone if first is not None and gone is not None else None
            ettr = args.iterations * per / leg["wall"] if leg["iterations"] == args.iterations and per else None
            note = leg.get("note", "")
            if leg.get("verdict_at") and leg.get("fault_at"):
                note = f"verdict {leg['verdict_at'] - leg['fault_at']:.2f}s; " + note
            print(f"  {f:8s} {m:9s} {leg['at']:>3d} {fmt(gone, width=9)} {fmt(recovery, width=8)} "
                  f"{'-' if redone is None else redone:>6} {fmt(work, width=9)} "
                  f"{fmt(total, width=9) if total is not None else capped:>10} {leg['wall']:6.1f}s "
                  f"{'-' if ettr is None else f'{ettr:.3f}':>6}  {note[:130]}")
    print("\ngoals: a4ray's time lost per fault <= 1/3 of torchrun's and <= 1/2 of Ray Train's; fault-free step time "
          "<= 1.01x torchrun's")
    for f in faults:
        mine = lost.get((f, "a4ray"))
        for other, share in (("torchrun", 1 / 3), ("ray_train", 1 / 2)):
            if (f, other) not in lost:
                continue
            theirs = lost[(f, other)]
            theirs_s = f"{theirs:.2f}s" if theirs is not None else "not recovered within its leg"
            met = mine is not None and (theirs is None or mine <= share * theirs)
            print(f"  {f:8s} a4ray {fmt(mine, width=6)} vs {other} {theirs_s}: {'met' if met else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
