"""What a simulated cluster costs while it waits: Ray's idle-worker and log-monitor defaults against a4ray's.

    python benchmarks/idle_cluster.py                 # 2 rounds, 60 s idle each
    python benchmarks/idle_cluster.py --rounds 1 --idle-s 30

Each round starts, for each setting in turn, a fresh embedded cluster of 3 simulated nodes x 2 GPUs in a process of
its own, and in it:
  busy  4 times: a 3-node `ddp_test` gang (a4ray.run), then a burst of 12 one-CPU Ray tasks (what a test suite or a
        notebook does between waits), timed;
  idle  nothing for `--idle-s`: the CPU-seconds every process of the cluster spent meanwhile (its GCS, raylets,
        agents, log monitor and workers), per minute, and how many idle workers were left.
The settings:
  ray    Ray's defaults: up to a node's CPU count of idle workers kept for the cluster's life, and its log monitor
         globbing the log directory 10 times a second below 1000 files;
  a4ray  what `a4ray.runtime.rayenv` gives a simulated cluster: no worker idle past 10 s, the log monitor's glob twice
         a second (SIMULATED_IDLE_CONFIG, SIMULATED_HEAD_ENV).
Prints each round's figures, then the medians and the ratios a4ray / ray (idle CPU: lower is better; busy time: the
reuse of workers within a burst is kept, so about 1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SETTINGS = ("ray", "a4ray")


def one(setting: str, idle_s: float) -> dict:
    """One cluster of `setting`, busy then idle, in this process (a fresh one: Ray's config is per process)."""
    import psutil
    import ray

    import a4ray
    from a4ray.runtime import rayenv, simulated
    from a4ray.spec.loader import load_job

    if setting == "ray":  # the settings a4ray adds for idle cost, taken out; the rest (health checks) kept
        simulated.SIMULATED_SYSTEM_CONFIG = {k: v for k, v in rayenv.SIMULATED_SYSTEM_CONFIG.items()
                                             if k not in rayenv.SIMULATED_IDLE_CONFIG}
        simulated.SIMULATED_HEAD_ENV = {}
    cluster = simulated.SimulatedCluster(3, 2)
    cluster.start()
    workspace = tempfile.mkdtemp(prefix="idle-cluster-")
    try:
        a4ray.connect(cluster.address)

        @ray.remote(num_cpus=1)
        def task(i: int) -> int:
            return i

        spec = load_job(None, [f"storage.local_workspace={workspace}", "cluster.nodes=3", "cluster.gpus_per_node=1",
                               "ddp_test.steps=3", "ddp_test.hidden=64"], kind="ddp_test")
        start = time.monotonic()
        for _ in range(4):
            assert a4ray.run(spec).ok
            ray.get([task.remote(i) for i in range(12)])
        busy_s = time.monotonic() - start

        def cpu() -> dict[int, tuple[str, float]]:
            out = {}
            for proc in psutil.Process().children(recursive=True):
                try:
                    times = proc.cpu_times()
                    out[proc.pid] = (" ".join(proc.cmdline()), times.user + times.system)
                except psutil.Error:
                    pass
            return out

        before = cpu()
        time.sleep(idle_s)
        after = cpu()
        spent = sum(c - before[pid][1] for pid, (_, c) in after.items() if pid in before)
        idle_workers = sum(1 for cmd, _ in after.values() if cmd.startswith("ray::IDLE"))
        return {"busy_s": busy_s, "idle_cpu_per_min": spent * 60 / idle_s, "idle_workers": idle_workers}
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(workspace, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=60.0)
    parser.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)  # a single cluster, in this process
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args.idle_s)), flush=True)
        return
    results: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for setting in SETTINGS if r % 2 == 0 else reversed(SETTINGS):
            out = subprocess.run([sys.executable, __file__, "--one", setting, "--idle-s", str(args.idle_s)],
                                 capture_output=True, text=True, check=True).stdout
            result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            results[setting].append(result)
            print(f"round {r + 1} {setting:6s}: busy {result['busy_s']:5.1f} s, idle {result['idle_cpu_per_min']:5.2f} "
                  f"CPU-s a minute, {result['idle_workers']} idle worker(s) left", flush=True)
    med = {s: {k: statistics.median(x[k] for x in results[s]) for k in results[s][0]} for s in SETTINGS}
    for s in SETTINGS:
        print(f"median {s:6s}: busy {med[s]['busy_s']:5.1f} s, idle {med[s]['idle_cpu_per_min']:5.2f} CPU-s a minute, "
              f"{med[s]['idle_workers']:.0f} idle worker(s)")
    print(f"a4ray / ray: idle CPU {med['a4ray']['idle_cpu_per_min'] / med['ray']['idle_cpu_per_min']:.2f}, "
          f"busy time {med['a4ray']['busy_s'] / med['ray']['busy_s']:.2f}")


if __name__ == "__main__":
    main()
