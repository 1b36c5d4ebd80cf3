"""The straggler check under expert parallelism: a4ray's Megatron trainer on 2 simulated nodes x G GPUs with EP
over every rank (the token dispatch crosses the nodes), once with the last rank's process duty-cycled from outside
(SIGSTOP / SIGCONT, running `--share` of each 100 ms) and once even. Printed: each run's straggler verdicts and
the compute-time windows they rest on. The slowed node must be flagged, the even run must flag none.

    python benchmarks/straggler_ep.py [--gpus-per-node 2] [--iters 60] [--share 0.3] [--model qwen3-moe-tiny]

One embedded cluster serves both runs; the model and data are the rehearsal's stand-ins (NCCL on GPUs, else gloo).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from a4ray.api import load, run  # noqa: E402
from embedded import embedded_cluster  # noqa: E402
from a4ray.staging.standins import make_all  # noqa: E402


def duty_cycle(save: Path, rank: str, share: float, stop: threading.Event) -> None:
    """Stop and continue the trainer of `rank` (saving to `save`) so it runs `share` of each 100 ms."""
    victim = None
    while victim is None and not stop.is_set():
        for proc in psutil.process_iter(["cmdline"]):
            cmd = " ".join(proc.info["cmdline"] or [])
            with contextlib.suppress(psutil.Error):
                if "a4ray.mcore" in cmd and str(save) in cmd and "a4ray.runtime.ranks" not in cmd \
                        and proc.environ().get("RANK") == rank:
                    victim = proc
        time.sleep(0.05)
    while not stop.is_set():
        with contextlib.suppress(psutil.Error):
            victim.send_signal(signal.SIGSTOP)
            time.sleep(0.1 * (1 - share))
            victim.send_signal(signal.SIGCONT)
        time.sleep(0.1 * share)
    with contextlib.suppress(psutil.Error):
        victim.send_signal(signal.SIGCONT)


def train(work: Path, standins: dict, args, slow: bool) -> tuple[list[str], list[str]]:
    world = 2 * args.gpus_per_node
    save = work / ("slow" if slow else "even")
    spec = load(None, "cluster.nodes=2", f"cluster.gpus_per_node={args.gpus_per_node}", "command.torchrun=true",
                f"storage.local_workspace={work}", "command.argv=[x]", "observe.straggler.windows=2",
                kind="command")
    spec = spec.set("command.argv", [
        "-m", "a4ray.mcore", "--model", str(standins[args.model]), "--save", str(save), "--data-path",
        str(standins["qwen-datasets"] / "mmap_qwen3_datasets_text_document"), "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", str(2 * world), "--ep", str(world),
        "--log-interval", "5", "--save-interval", "100000", "--train-iters", str(args.iters)])
    stop = threading.Event()
    slower = threading.Thread(target=duty_cycle, args=(save, str(world - 1), args.share, stop), daemon=True)
    if slow:
        slower.start()
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            result = run(spec)
    finally:
        stop.set()
    if not result.ok:
        print(said.getvalue()[-3000:])
        raise SystemExit(f"the run failed: {result.verdict}")
    windows = [line.split("A4RAY_COMPUTE ", 1)[1][:300] for log in sorted(Path(result.gang.log_dir).glob("rank-*.log"))
               for line in log.read_text().splitlines() if "A4RAY_COMPUTE" in line]
    return [s.line() for s in result.gang.stragglers], windows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--share", type=float, default=0.3)
    p.add_argument("--model", default="qwen3-moe-tiny", choices=("qwen3-moe-tiny", "qwen3-next-tiny"))
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="a4ray-straggler-"))
    standins = make_all(work / "standins")
    with embedded_cluster(2, args.gpus_per_node):
        verdicts = {}
        for slow in (True, False):
            flagged, windows = train(work, standins, args, slow)
            name = f"rank {2 * args.gpus_per_node - 1} running {args.share:.0%} of the time" if slow else "even"
            verdicts[name] = flagged
            print(f"{name}: {len(flagged)} flagged" + "".join(f"\n  {line}" for line in flagged), flush=True)
            print("  windows (the last rank's):\n    " + "\n    ".join(windows[-3:]), flush=True)
    slow_ok = any("node 1 " in line for line in next(iter(verdicts.values())))
    even_ok = not list(verdicts.values())[1]
    print(f"slowed node flagged: {slow_ok}; even run flags none: {even_ok}")
    return 0 if slow_ok and even_ok else 1


if __name__ == "__main__":
    sys.exit(main())
