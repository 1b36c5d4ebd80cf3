"""A rank of the Qwen3-Next rehearsal SIGKILLed mid-run, timed from the kill: the gang stopped, every trainer
process of the killed attempt gone, the new gang placed, its first iteration, and where it resumed from.

    python benchmarks/rank_kill.py [--when after|during] [--nodes 2 --gpus-per-node 2] [--dir DIR] [-- --set ...]

after   rank 1 is killed once iteration 10's checkpoint is complete: the relaunch resumes from iteration 10
during  rank 1 is killed the moment a later checkpoint starts to be written (its `.iter_NNNNNNN.tmp` appears): the
        partial checkpoint is named and skipped, the relaunch resumes from the one before

The rehearsal runs as a user runs it (`python -m a4ray.qwen3_next --local-nodes N`, its own embedded cluster; NCCL
and one GPU a rank where the machine has N x G GPUs, else gloo), with `restart.max_restarts=1`. Its output lines
are stamped as they arrive; the trainer processes are polled every 20 ms. Also printed: what each node's log says
of its GPUs' memory after the stop (a stopped node waits until they hold < 512 MiB before it reports).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import a4ray  # noqa: E402


def trainers(save: Path, **env: str) -> list[psutil.Process]:
    """Live trainer processes (`python -m a4ray.mcore` saving to `save`) whose env has every `env` item."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "a4ray.mcore" not in cmd or str(save) not in cmd or "a4ray.runtime.ranks" in cmd:
            continue
        try:
            mine = proc.environ()
        except psutil.Error:
            continue
        if proc.info["status"] != psutil.STATUS_ZOMBIE and all(mine.get(k) == v for k, v in env.items()):
            found.append(proc)
    return found


def kill(save: Path, when: str, rank: int, out: dict) -> None:
    victim = None
    while victim is None or not (save / "iter_0000010" / "metadata.json").is_file():
        victims = trainers(save, RANK=str(rank), A4RAY_ATTEMPT="0")
        victim = victims[0] if victims else None
        time.sleep(0.02)
    if when == "during":
        while not (writing := sorted(p.name for p in save.glob(".iter_*.tmp"))):
            time.sleep(0.002)
        out["writing"] = writing[0]
    victim.kill()
    out["killed"], out["killed_at"] = time.monotonic(), time.time()
    while trainers(save, A4RAY_ATTEMPT="0"):
        time.sleep(0.02)
    out["gone"] = time.monotonic()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--when", choices=("after", "during"), default="after")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--victim", type=int, default=1, help="the rank killed (0 where the run has one rank)")
    p.add_argument("--dir", help="work directory (default: a temporary one); a second run in it reuses the staging")
    p.add_argument("extra", nargs="*", help="more arguments for the rehearsal, after --")
    args = p.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="a4ray-kill-"))
    work.mkdir(parents=True, exist_ok=True)
    output = f"logs/killed-{args.when}-{int(time.time())}"
    save = (work / ".a4ray" / output / "checkpoint").resolve()
    cmd = [sys.executable, "-m", "a4ray.qwen3_next", "--local-nodes", str(args.nodes), "--gpus-per-node",
           str(args.gpus_per_node), "--set", "restart.max_restarts=1", "--set", "restart.backoff_s=0",
           "--set", f"train.output={output}", "--result", str(work / f"{args.when}.json"), *args.extra]
    times: dict = {}
    killer = threading.Thread(target=kill, args=(save, args.when, args.victim, times), daemon=True)
    killer.start()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    log = open(work / f"{args.when}.log", "w")
    for line in proc.stdout:
        lines.append((time.monotonic(), line.rstrip("\n")))
        log.write(line)
    code = proc.wait()
    log.close()
    killer.join(5)
    print(f"rehearsal exit {code}; output in {work / (args.when + '.log')}")
    if "killed" not in times:
        print("the rank was not killed (the run ended first, or never saved iteration 10)")
        return 1

    def first(pattern: str, after: float) -> tuple[float, str] | tuple[None, None]:
        regex = re.compile(pattern)
        return next(((t, s) for t, s in lines if t >= after and regex.search(s)), (None, None))

    t_kill = times["killed"]
    seen, seen_line = first(r"a4ray: stopping \d+ node\(s\): ", t_kill)
    placed, _ = first(r"a4ray: gang .* placed in", seen or t_kill)
    resumed, resumed_line = first(r"a4ray\.mcore: resuming from checkpoint iteration", placed or t_kill)
    # the first progress summary after the resume; the run's own record has the first iteration itself
    step, step_line = first(r"a4ray: progress: iteration (1[1-9]|[2-9]\d)/", placed or t_kill)
    records = sorted((work / ".a4ray" / "runs").glob("*/result.json"), key=lambda f: f.stat().st_mtime)
    incidents = a4ray.goodput(records[-1].parent).incidents if records else []
    first_at = incidents[0].first_iteration_at if incidents else None
    cold, _ = first(r"a4ray: progress: iteration \d+/", started)
    placements = [t for t, s in lines if cold and t <= cold and re.search(r"a4ray: gang .* placed in", s)]
    train_started = placements[-1] if placements else None  # the train step's first gang
    skipped = [s for _, s in lines if "not loading checkpoint iteration" in s]
    gpus = sorted({s.split("# ", 1)[1] for f in (work / ".a4ray").glob("runs/*/logs/train/node-*.log")
                   for s in f.read_text().splitlines() if s.startswith("# GPUs")})
    figures = {
        "killed": f"rank {args.victim}, {'while writing ' + times['writing'] if args.when == 'during' else 'after iteration 10 was saved'}",
        "kill -> death seen (the gang stopping)": seen and round(seen - t_kill, 2),
        "the stop's line": seen_line,
        "kill -> every trainer process of the attempt gone": round(times["gone"] - t_kill, 2),
        "kill -> new gang placed": placed and round(placed - t_kill, 2),
        "kill -> first iteration after resume (the run's record)":
            first_at and round(first_at - times["killed_at"], 2),
        "kill -> first progress summary after resume": step and round(step - t_kill, 2),
        "cold start: the train step's first gang placed -> its first iteration": cold and train_started and round(cold - train_started, 2),
        "resumed": resumed_line, "first progress summary after resume": step_line, "skipped": skipped,
        "the restart's ranks": first(r"a4ray: launch \S+: .*ranks (warm|cold)", t_kill)[1],
        "goodput": first(r"a4ray: goodput ", t_kill)[1],
        "nodes' GPU memory after each stop": gpus,
        "result": json.loads((work / f"{args.when}.json").read_text())["steps"][-1].get("detail", "")
        if (work / f"{args.when}.json").is_file() else None,
    }
    for name, value in figures.items():
        print(f"  {name}: {value}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
