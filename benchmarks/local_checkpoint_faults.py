"""What a fault costs with and without local checkpoints, at a realistic persistent interval: the rehearsal's
training (`python -m a4ray.qwen3_next`: a4ray's Megatron trainer on 2 simulated nodes, from the converted
checkpoint, async persistent saves), rank 1's trainer SIGKILLed at the same iterations in both runs, a4ray's restart
bringing it back. The figures are the run's own goodput record (result.json's train step): per incident, detection,
recovery, the iterations redone and their time, and the run's goodput.

    python benchmarks/local_checkpoint_faults.py [--every 20] [--local 2] [--iterations 60] [--kill-at 17,37]

`--every` is the persistent interval (iterations), `--local` the local one in the second run (the first has none).
A kill lands once the stream's progress line of that iteration is out (observe.summary_every=1), mid-interval of
the persistent saves: without local checkpoints the restart resumes from the persistent one before it, with them
from the local one. Warm ranks are off in both runs (restart.warm_ranks=false): a warm rank's process does not show
the trainer's command line, by which the kill finds rank 1 after a restart; recovery is a cold start's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bare import env  # noqa: E402

PROGRESS = re.compile(r"progress: iteration (\d+)/")


def kill_rank_1(save: str) -> int | None:
    """SIGKILL rank 1's trainer (not its async writer: a child with its RANK and command line); its pid."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "a4ray.mcore" not in cmd or save not in cmd or "a4ray.runtime.ranks" in cmd:
            continue
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("RANK") == "1" and "RANK" not in proc.parent().environ():
                proc.kill()
                return proc.pid
    return None


def run(work: Path, args, local: int) -> dict:
    """One run of the rehearsal's training with rank 1 killed at each of `args.kill_at`; its train step's result."""
    output = f"logs/faults-local-{local}"
    save = str((work / ".a4ray" / output / "checkpoint").resolve())
    cmd = [sys.executable, "-u", "-m", "a4ray.qwen3_next", "--skip", "preflight", "--result", f"local-{local}.json"]
    for s in (f"train.output={output}", f"train.iterations={args.iterations}", f"train.save_interval={args.every}",
              f"train.local_save_interval={local}", f"restart.max_restarts={len(args.kill_at)}", "restart.backoff_s=0",
              "observe.summary_every=1", "observe.straggler.enabled=false", "restart.warm_ranks=false"):
        cmd += ["--set", s]
    ray_tmp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's socket paths have a limit
    proc = subprocess.Popen(cmd, cwd=work, env=env(RAY_TMPDIR=ray_tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    pending, lines = sorted(args.kill_at), []
    for line in proc.stdout:
        lines.append(line)
        if pending and (m := PROGRESS.search(line)) and int(m[1]) >= pending[0]:
            if kill_rank_1(save) is not None:
                pending.pop(0)
    proc.wait()
    shutil.rmtree(ray_tmp, ignore_errors=True)
    (work / f"local-{local}.log").write_text("".join(lines))
    if proc.returncode:
        raise SystemExit(f"the run with local={local} failed:\n{''.join(lines)[-4000:]}")
    result = json.loads((work / f"local-{local}.json").read_text())
    return next(s for s in result["steps"] if s["name"] == "train")["result"]


def report(args, results: dict[int, dict]) -> None:
    def between(a, b) -> float:
        return b - a if a is not None and b is not None else 0.0

    print(f"rehearsal training, 2 simulated nodes x 1 rank, {args.iterations} iterations, persistent checkpoint every "
          f"{args.every}; rank 1 SIGKILLed at iterations {', '.join(map(str, args.kill_at))}")
    print(f"{'local checkpoints':<18} {'incident':>8} {'at':>4} {'resumed from':>12} {'redone':>6} {'lost work':>9} "
          f"{'detection':>9} {'recovery':>8} {'cost':>7}")
    for local, train in results.items():
        goodput = train["goodput"]
        for i, incident in enumerate(goodput["incidents"]):
            detection = between(incident["last_progress_at"], incident["verdict_at"])
            recovery = between(incident["verdict_at"], incident["first_iteration_at"])
            cost = detection + recovery + incident["lost_work_s"]
            print(f"{'every ' + str(local) if local else 'none':<18} {i + 1:>8} {incident['last_iteration']!s:>4} "
                  f"{incident['resumed_from']!s:>12} {incident['redone_iterations']:>6} "
                  f"{incident['lost_work_s']:>8.2f}s {detection:>8.2f}s {recovery:>7.2f}s {cost:>6.2f}s")
        print(f"{'':<18} goodput {goodput['goodput']:.3f} of {goodput['wall_s']:.1f}s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--local", type=int, default=2)
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--kill-at", type=lambda s: [int(x) for x in s.split(",")], default=[17, 37])
    p.add_argument("--dir", help="work directory (default: a temporary one, removed)")
    args = p.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="a4ray-local-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = {local: run(work, args, local) for local in (0, args.local)}
        (work / "results.json").write_text(json.dumps(results, indent=1))
        report(args, results)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.pop("RAY_ADDRESS", None)
    main()
