"""How fast a4ray notices a hung job, a dead rank and a lost node, and how fast it is training again.

    python benchmarks/resilience.py [--no-progress-s 10] [--step-s 0.5] [--gpus-per-node 2] [--only dead_rank]

hang       2 simulated nodes x 2 ranks (torchrun, gloo); at iteration 3 rank 1 blocks in its data loader
           while the others wait in all_reduce. The watchdog (observe.watchdog.no_progress_s) ends the launch.
           Reported: last iteration line -> "hang detected" (the window plus the watchdog's lag), the time
           to collect every rank's py-spy stack, and last iteration line -> the gang stopped.
dead rank  2 nodes x G ranks (NCCL on GPUs, one GPU a rank; else gloo), a checkpoint every 2 iterations; rank 1
           is SIGKILLed at iteration 4. Reported, from the kill: the death seen (the driver stops the gang
           naming the rank), every process of the launch gone (the trainer's processes, polled every 20 ms),
           the new gang placed, its first iteration (resumed from the checkpoint); and the cold start (the run's
           start -> its first iteration) that the restart is held to (goal: restart <= cold start + 10 s). Then the
           same program and kill under bare torchrun (one agent a node, as a user of plain torchrun runs it): when
           the agents see the death and when every process is gone. On NCCL the other node's ranks block in the
           collective with the dead rank until NCCL's own timeout: the figure is capped at --torchrun-cap-s.
node loss  2 nodes of a 3-node cluster, a checkpoint every 2 iterations; a node of the gang is removed
           (its raylet and every process on it killed) at iteration 4. Reported: removal -> the driver
           naming the lost node (detection), -> the replacement gang placed, -> its first iteration
           (recovery), and that it resumed from the checkpoint the removal left.

Times come from the driver's own output lines, stamped as they are printed. Needs py-spy (a4ray[test]).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TRAINER = """
import json, os, pathlib, sys, time
import torch, torch.distributed as dist
mode, state, step_s, total = sys.argv[1], pathlib.Path(sys.argv[2]), float(sys.argv[3]), 20
nccl = torch.cuda.is_available()
if nccl:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if nccl else "gloo")
rank = dist.get_rank()
start = json.loads(state.read_text())["step"] if state.exists() else 0
for it in range(start + 1, total + 1):
    if mode == "hang" and rank == 1 and it == 3:
        time.sleep(3600)  # a data loader that never returns
    dist.all_reduce(torch.ones(4, device="cuda" if nccl else "cpu"))
    time.sleep(step_s)
    if rank == 0:
        print(f" iteration {it:8d}/{total:8d} | elapsed time per iteration (ms): {step_s * 1000:.1f} |"
              f" lm loss: {1 / it:.4E} |", flush=True)
        if mode == "ckpt" and it % 2 == 0:
            state.with_suffix(".tmp").write_text(json.dumps({"step": it}))
            state.with_suffix(".tmp").replace(state)
dist.destroy_process_group()
"""


def trainer_processes(script: Path, **env: str) -> list:
    """Live processes running `script` whose environment has every `env` item (a rank, an attempt)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if str(script) not in (proc.info["cmdline"] or []) or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            mine = proc.environ()
        except psutil.Error:
            continue
        if all(mine.get(k) == v for k, v in env.items()):
            found.append(proc)
    return found


def kill_rank_at(state: Path, script: Path, step: int, **env: str) -> tuple[float, float]:
    """SIGKILL rank 1 (of the processes with `env`) once the checkpoint of `step` exists; returns (when it was
    killed, when the last of those processes was gone)."""
    while not state.exists() or json.loads(state.read_text())["step"] < step:
        time.sleep(0.02)
    [victim] = trainer_processes(script, RANK="1", **env)
    victim.kill()
    killed = time.monotonic()
    while trainer_processes(script, **env):
        time.sleep(0.02)
    return killed, time.monotonic()


class Stamped:
    """stdout that remembers when each line was printed."""

    def __init__(self, out):
        self.out, self.lines, self._partial = out, [], ""

    def write(self, text: str) -> int:
        now = time.monotonic()
        self._partial += text
        *done, self._partial = self._partial.split("\n")
        self.lines += [(now, line) for line in done]
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def first(self, pattern: str, after: float = 0.0) -> float | None:
        regex = re.compile(pattern)
        return next((t for t, line in self.lines if t >= after and regex.search(line)), None)

    def last(self, pattern: str, before: float = float("inf")) -> float | None:
        regex = re.compile(pattern)
        return max((t for t, line in self.lines if t <= before and regex.search(line)), default=None)


def spec_for(mode: str, work: Path, step_s: float, *sets: str):
    from a4ray.spec import load_job

    work.mkdir(parents=True, exist_ok=True)
    script = work / "trainer.py"
    script.write_text(TRAINER)
    # observe.summary_every=1: the stream says every iteration (it shows `progress:` lines, not the ranks' own)
    return load_job(None, ["cluster.gpus_per_node=1", "command.torchrun=true", f"storage.local_workspace={work}",
                           "observe.summary_every=1",
                           f"command.argv=[{script}, {mode}, {work / 'state.json'}, {step_s}]", *sets],
                    kind="command")


def hang(stamped: Stamped, work: Path, window_s: float, step_s: float) -> dict[str, float]:
    from a4ray.driver.execute import run

    spec = spec_for("hang", work, step_s, "cluster.nodes=2", "cluster.gpus_per_node=2",
                    f"observe.watchdog.no_progress_s={window_s}")
    result = run(spec)
    ended = time.monotonic()
    assert result.gang and result.gang.failure_kind == "hang", result.verdict
    last = stamped.last(r"a4ray: progress: iteration 2/")
    detected = stamped.first(r"a4ray: hang detected", after=last)
    reported = stamped.first(r"a4ray: hang report:", after=detected)
    return {"window_s": window_s, "last iteration -> hang detected": detected - last,
            "watchdog lag beyond the window": detected - last - window_s,
            "stacks of every rank collected": reported - detected, "last iteration -> gang stopped": ended - last}


def dead_rank(stamped: Stamped, work: Path, step_s: float, gpus: int) -> dict[str, float]:
    from a4ray.driver.execute import run

    spec = spec_for("ckpt", work, step_s, "cluster.nodes=2", f"cluster.gpus_per_node={gpus}", "restart.max_restarts=1",
                    "restart.backoff_s=0", "cluster.stop_grace_s=5")
    times: list[tuple[float, float]] = []
    killer = threading.Thread(target=lambda: times.append(kill_rank_at(work / "state.json", work / "trainer.py", 4,
                                                                       A4RAY_ATTEMPT="0")), daemon=True)
    killer.start()
    started = time.monotonic()
    result = run(spec)
    assert result.ok and result.gang.attempt == 1, result.verdict
    killer.join()
    [(t_kill, t_gone)] = times
    cold = stamped.first(r"a4ray: progress: iteration \d+/", after=started)
    seen = stamped.first(r"a4ray: stopping \d+ node\(s\): rank 1 ", after=t_kill)
    placed = stamped.first(r"a4ray: gang .* placed in", after=seen)
    first = stamped.first(r"a4ray: progress: iteration \d+/", after=placed)
    return {"cold start (run -> first iteration)": cold - started, "kill -> death seen (gang stopping)": seen - t_kill,
            "kill -> every process of the launch gone": t_gone - t_kill, "kill -> new gang placed": placed - t_kill,
            "kill -> first iteration after resume": first - t_kill,
            "restart - cold start (goal <= 10)": (first - t_kill) - (cold - started)}


def dead_rank_torchrun(work: Path, step_s: float, gpus: int, cap_s: float) -> dict[str, float]:
    """The same program and kill under bare torchrun: one agent per node, static rendezvous, no restarts."""
    import subprocess

    from a4ray.core import ports

    work.mkdir(parents=True, exist_ok=True)
    script = work / "trainer.py"
    script.write_text(TRAINER)
    port = ports.free_port("127.0.0.1")
    agents = []
    for node in range(2):
        env = {**os.environ, "A4RAY_BENCH": "torchrun"}
        if _cuda():  # each simulated node its own GPUs, as the gang's nodes have
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * gpus + i) for i in range(gpus))
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
             f"--nproc-per-node={gpus}", "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0",
             str(script), "ckpt", str(work / "state.json"), str(step_s)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True))
    state = work / "state.json"
    while not state.exists() or json.loads(state.read_text())["step"] < 4:
        time.sleep(0.02)
    [victim] = trainer_processes(script, RANK="1", A4RAY_BENCH="torchrun")
    victim.kill()
    t_kill = time.monotonic()
    seen = gone = None
    while time.monotonic() - t_kill < cap_s:
        if seen is None and any(a.poll() is not None for a in agents):
            seen = time.monotonic()
        if gone is None and not trainer_processes(script, A4RAY_BENCH="torchrun") and all(
                a.poll() is not None for a in agents):
            gone = time.monotonic()
            break
        time.sleep(0.02)
    for agent in agents:  # what is still blocked after the cap
        try:
            os.killpg(agent.pid, 9)
        except OSError:
            pass
    for proc in trainer_processes(script, A4RAY_BENCH="torchrun"):
        proc.kill()
    return {"kill -> an agent exits (death seen)": (seen - t_kill) if seen else float("nan"),
            f"kill -> every process gone (capped at {cap_s:g} s)": (gone - t_kill) if gone else float("inf")}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def node_loss(stamped: Stamped, work: Path, step_s: float) -> dict[str, float]:
    import ray

    from a4ray.driver.execute import run
    from a4ray.runtime.connect import NAMESPACE
    from a4ray.runtime.simulated import SimulatedCluster

    state = work / "state.json"
    cluster = SimulatedCluster(3, 1)
    cluster.start()
    ray.init(address=cluster.address, namespace=NAMESPACE)
    killed: list[float] = []
    checkpoint: list[int] = []

    def kill_at(step: int) -> None:
        from ray.util.placement_group import placement_group_table

        while not state.exists() or json.loads(state.read_text())["step"] < step:
            time.sleep(0.05)
        in_gang = {n for pg in placement_group_table().values() if pg["name"].startswith("a4ray-")
                   and pg["state"] == "CREATED" for n in pg["bundles_to_node_id"].values()}
        victim = next(i for i, node in cluster.workers.items() if node.node_id in in_gang)
        killed.append(time.monotonic())
        checkpoint.append(json.loads(state.read_text())["step"])
        cluster.remove_node(victim)

    try:
        killer = threading.Thread(target=kill_at, args=(4,), daemon=True)
        killer.start()
        result = run(spec_for("ckpt", work, step_s, "cluster.nodes=2", "restart.max_restarts=1",
                              "restart.backoff_s=0"))
        assert result.ok and result.gang.attempt == 1, result.verdict
    finally:
        ray.shutdown()
        cluster.shutdown()
    t_kill = killed[0]
    lost = stamped.first(r"was lost", after=t_kill)
    placed = stamped.first(r"a4ray: gang .* placed in", after=lost)
    first = stamped.first(r"a4ray: progress: iteration \d+/", after=placed)
    resumed = int(re.search(r"a4ray: progress: iteration (\d+)/", next(line for t, line in stamped.lines if t == first)).group(1))
    return {"removal -> node named lost": lost - t_kill, "removal -> new gang placed": placed - t_kill,
            "removal -> first iteration of the new gang": first - t_kill,
            "checkpoint at the removal (iteration)": checkpoint[0], "new gang's first iteration": resumed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-progress-s", type=float, default=10.0, help="the watchdog's window (default %(default)s)")
    parser.add_argument("--step-s", type=float, default=0.5, help="seconds per training iteration (default %(default)s)")
    parser.add_argument("--gpus-per-node", type=int, default=2, help="ranks a node in the dead-rank case (default 2)")
    parser.add_argument("--torchrun-cap-s", type=float, default=90.0, help="how long bare torchrun is waited for")
    parser.add_argument("--only", default="hang,dead_rank,node_loss", help="cases to run, comma-separated")
    args = parser.parse_args()
    cases = set(args.only.split(","))
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="r", dir="/tmp"))
    stamped = Stamped(sys.stdout)
    sys.stdout = stamped
    figures: dict[str, dict] = {}
    try:
        if "hang" in cases:
            with tempfile.TemporaryDirectory() as d:
                figures["hang"] = hang(stamped, Path(d) / "hang", args.no_progress_s, args.step_s)
        if "dead_rank" in cases:
            with tempfile.TemporaryDirectory() as d:
                figures["dead rank"] = dead_rank(stamped, Path(d) / "gang", args.step_s, args.gpus_per_node)
            with tempfile.TemporaryDirectory() as d:
                figures["torchrun"] = dead_rank_torchrun(Path(d), args.step_s, args.gpus_per_node, args.torchrun_cap_s)
        if "node_loss" in cases:
            with tempfile.TemporaryDirectory() as d:
                figures["node loss"] = node_loss(stamped, Path(d), args.step_s)
    finally:
        sys.stdout = stamped.out
    print("\nresilience (seconds unless said otherwise):")
    for case, values in figures.items():
        for name, value in values.items():
            print(f"  {case:9s}  {name:50s} {value:8.2f}" if isinstance(value, float) else
                  f"  {case:9s}  {name:50s} {value:8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
