"""What the Megatron trainer's ranks cost to start, with and without the tokenizer kept in the data cache.

    python benchmarks/rank_start.py                 # 3 rounds, 4 ranks, 2 iterations
    python benchmarks/rank_start.py --rounds 5 --ranks 2

`python -m a4ray.mcore` under torchrun on this machine (gloo), the tiny Qwen3-MoE stand-in, a few iterations into one
save directory (its index caches built once, before), in three settings, in turn within each round:
  every  every rank loads megatron-core's tokenizer (importing transformers), as before a4ray kept what the dataset
         reads of it: the ranks run the trainer with `a4ray.mcore.dataset.tokenizer` told to keep nothing;
  first  a launch's first run: rank 0 loads it and keeps it in the data cache, the other ranks read that;
  kept   a restart: what an earlier run kept is there, no rank loads it.
Each run's CPU-seconds are torchrun's and its ranks' (getrusage of the children); its wall time too. Prints each round,
then the medians and the ratios to `every` (lower is better).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from a4ray.core.ports import free_port

SETTINGS = ("every", "first", "kept")


def one(setting: str, standins: dict[str, Path], save: Path, ranks: int, iterations: int) -> dict:
    if setting != "kept":
        for kept in save.glob("data_cache/tokenizer-*.json"):
            kept.unlink()
    data = standins["qwen-datasets"] / "mmap_qwen3_datasets_text_document"
    target = [__file__, KEEP_NOTHING] if setting == "every" else ["-m", "a4ray.mcore"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={ranks}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", *target,
           "--model", str(standins["qwen3-moe-tiny"]), "--data-path", str(data), "--save", str(save),
           "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", str(ranks),
           "--train-iters", str(iterations), "--ep", str(ranks), "--naming", "local", "--save-interval", "1000"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "OMP_NUM_THREADS": "1",
           "TMPDIR": str(save.parent)}  # torchrun's torchelastic_* directories go with the benchmark's
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"{setting}: the trainer failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    for old in save.glob("iter_*"):  # every run starts from the beginning: only the data cache is kept
        shutil.rmtree(old)
    (save / "latest_checkpointed_iteration.txt").unlink(missing_ok=True)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"cpu_s": cpu, "wall_s": wall}


KEEP_NOTHING = "--rank-keeping-nothing"


def rank_keeping_nothing() -> None:
    """A rank of the `every` setting: the trainer, its tokenizer loaded in every rank and kept nowhere."""
    import runpy

    from a4ray.mcore import dataset

    load = dataset.tokenizer
    dataset.tokenizer = lambda model_dir, keep_in=None: load(model_dir)
    sys.argv = ["a4ray.mcore", *sys.argv[2:]]
    runpy.run_module("a4ray.mcore", run_name="__main__", alter_sys=True)


def main() -> int:
    if sys.argv[1:2] == [KEEP_NOTHING]:
        rank_keeping_nothing()
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=4, help="ranks on this machine (expert parallelism over all)")
    parser.add_argument("--iterations", type=int, default=2)
    args = parser.parse_args()
    from a4ray.staging.standins import make_all

    root = Path(tempfile.mkdtemp(prefix="rank-start-"))
    try:
        standins = make_all(root / "standins")
        save = root / "save"
        one("kept", standins, save, args.ranks, args.iterations)  # the first run keeps it; untimed
        runs = {s: [] for s in SETTINGS}
        for r in range(args.rounds):
            for setting in SETTINGS[r % 3:] + SETTINGS[:r % 3]:  # each goes first once in 3 rounds
                runs[setting].append(one(setting, standins, save, args.ranks, args.iterations))
                got = runs[setting][-1]
                print(f"round {r + 1} {setting:5s}: {got['cpu_s']:6.2f} CPU-s, {got['wall_s']:5.2f} s wall", flush=True)
        med = {s: {k: statistics.median(run[k] for run in runs[s]) for k in ("cpu_s", "wall_s")} for s in SETTINGS}
        for s in SETTINGS:
            print(f"median {s:5s}: {med[s]['cpu_s']:6.2f} CPU-s ({med[s]['cpu_s'] / args.ranks:.2f} a rank), "
                  f"{med[s]['wall_s']:5.2f} s wall")
        for s in ("first", "kept"):
            print(f"{s} / every: CPU {med[s]['cpu_s'] / med['every']['cpu_s']:.2f}x, "
                  f"wall {med[s]['wall_s'] / med['every']['wall_s']:.2f}x ({args.ranks} ranks, {args.rounds} rounds)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
