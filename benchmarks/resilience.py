"""How fast a4ray notices a hung job and how fast it survives a lost node, on an embedded cluster.

    python benchmarks/resilience.py [--no-progress-s 10] [--step-s 0.5]

hang       2 simulated nodes x 2 ranks (torchrun, gloo); at iteration 3 rank 1 blocks in its data loader
           while the others wait in all_reduce. The watchdog (observe.watchdog.no_progress_s) ends the launch.
           Reported: last iteration line -> "hang detected" (the window plus the watchdog's lag), the time
           to collect every rank's py-spy stack, and last iteration line -> the gang stopped.
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
dist.init_process_group("gloo")
rank = dist.get_rank()
start = json.loads(state.read_text())["step"] if state.exists() else 0
for it in range(start + 1, total + 1):
    if mode == "hang" and rank == 1 and it == 3:
        time.sleep(3600)  # a data loader that never returns
    dist.all_reduce(torch.ones(4))
    time.sleep(step_s)
    if rank == 0:
        print(f" iteration {it:8d}/{total:8d} | elapsed time per iteration (ms): {step_s * 1000:.1f} |"
              f" lm loss: {1 / it:.4E} |", flush=True)
        if mode == "ckpt" and it % 2 == 0:
            state.with_suffix(".tmp").write_text(json.dumps({"step": it}))
            state.with_suffix(".tmp").replace(state)
"""


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
    return load_job(None, ["cluster.gpus_per_node=1", "command.torchrun=true", f"storage.local_workspace={work}",
                           f"command.argv=[{script}, {mode}, {work / 'state.json'}, {step_s}]", *sets],
                    kind="command")


def hang(stamped: Stamped, work: Path, window_s: float, step_s: float) -> dict[str, float]:
    from a4ray.driver.execute import run

    spec = spec_for("hang", work, step_s, "cluster.nodes=2", "cluster.gpus_per_node=2",
                    f"observe.watchdog.no_progress_s={window_s}")
    result = run(spec)
    ended = time.monotonic()
    assert result.gang and result.gang.failure_kind == "hang", result.verdict
    last = stamped.last(r"\] +iteration +2/")
    detected = stamped.first(r"a4ray: hang detected", after=last)
    reported = stamped.first(r"a4ray: hang report:", after=detected)
    return {"window_s": window_s, "last iteration -> hang detected": detected - last,
            "watchdog lag beyond the window": detected - last - window_s,
            "stacks of every rank collected": reported - detected, "last iteration -> gang stopped": ended - last}


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
    first = stamped.first(r"\] +iteration +\d+/", after=placed)
    resumed = int(re.search(r"\] +iteration +(\d+)/", next(line for t, line in stamped.lines if t == first)).group(1))
    return {"removal -> node named lost": lost - t_kill, "removal -> new gang placed": placed - t_kill,
            "removal -> first iteration of the new gang": first - t_kill,
            "checkpoint at the removal (iteration)": checkpoint[0], "new gang's first iteration": resumed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-progress-s", type=float, default=10.0, help="the watchdog's window (default %(default)s)")
    parser.add_argument("--step-s", type=float, default=0.5, help="seconds per training iteration (default %(default)s)")
    args = parser.parse_args()
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="r", dir="/tmp"))
    stamped = Stamped(sys.stdout)
    sys.stdout = stamped
    try:
        with tempfile.TemporaryDirectory() as d:
            figures = {"hang": hang(stamped, Path(d) / "hang", args.no_progress_s, args.step_s)}
        with tempfile.TemporaryDirectory() as d:
            figures["node loss"] = node_loss(stamped, Path(d), args.step_s)
    finally:
        sys.stdout = stamped.out
    print("\nresilience (seconds unless said otherwise):")
    for case, values in figures.items():
        for name, value in values.items():
            print(f"  {case:9s}  {name:45s} {value:8.2f}" if isinstance(value, float) else
                  f"  {case:9s}  {name:45s} {value:8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
