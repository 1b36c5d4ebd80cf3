"""Staging throughput against `cp -r`, and the time of a cache hit, measured in the same run.

Generates a model-like artifact (safetensors-sized shards of random bytes, ~2 GB by default) and stages
it from a file source into a target on the same disk, through the real path: the staging service, one
Ray task, copy into the partial directory, size verification, manifest, atomic rename. `cp -r` copies
the same data alongside. Each is run `--repeat` times, with the page cache flushed to disk (`sync`) and
the outputs deleted between runs; the best of each is compared.

    python benchmarks/staging.py [--gb 2] [--files 16] [--repeat 3] [--dir /tmp]

Goals: staging >= 0.9x the throughput of cp; a cache hit < 1 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def generate(src: Path, total_bytes: int, files: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    src.mkdir(parents=True)
    per_file = total_bytes // files
    for i in range(files):
        (src / f"model-{i + 1:05d}-of-{files:05d}.safetensors").write_bytes(rng.bytes(per_file))
    (src / "config.json").write_text('{"model_type": "qwen3_moe"}')


def settle() -> None:
    os.sync()  # the previous copy's dirty pages go to disk now, not during the next measurement


def timed(fn) -> float:
    settle()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0, help="artifact size in GB (default: %(default)s)")
    parser.add_argument("--files", type=int, default=16, help="number of shards (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each copy (default: %(default)s)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where source and targets live (one disk)")
    args = parser.parse_args()

    import ray

    from a4ray.runtime.connect import connect
    from a4ray.spec import ArtifactSpec, ClusterSpec
    from a4ray.staging import stage
    from a4ray.staging.display import Display

    root = Path(tempfile.mkdtemp(prefix="a4ray-bench-", dir=args.dir))
    quiet = Display(every_s=3600, tty=False)
    try:
        src, ws = root / "src", root / "ws"
        total = int(args.gb * 1e9)
        print(f"generating {total / 1e9:.2f} GB in {args.files} files under {src} ...", flush=True)
        generate(src, total, args.files)
        size = sum(f.stat().st_size for f in src.iterdir())
        artifact = ArtifactSpec(name="bench-model", source=f"file://{src}", target="ckpts/bench-model")

        with connect(cluster=ClusterSpec(nodes=1, gpus_per_node=1)):
            warm = ArtifactSpec(name="warm", source=str(src / "config.json"), target="warm")
            stage([warm], workspace=ws, display=quiet)  # starts the staging service and a worker
            cp_times, stage_times, hits = [], [], []
            for _ in range(args.repeat):
                cp_times.append(timed(lambda: subprocess.run(["cp", "-r", str(src), str(root / "cp")], check=True)))
                shutil.rmtree(root / "cp")
                stage_times.append(timed(lambda: stage([artifact], workspace=ws, display=quiet)))
                hits += [timed(lambda: stage([artifact], workspace=ws, display=quiet)) for _ in range(5)]
                result = stage([artifact], workspace=ws, display=quiet)
                assert result.artifacts[0].status == "cached"
                shutil.rmtree(ws / "ckpts")
            ray.shutdown()

        best_cp, best_stage = min(cp_times), min(stage_times)
        ratio = best_cp / best_stage
        hit = statistics.median(hits)
        print(f"data: {size / 1e9:.2f} GB in {args.files + 1} files, source and target on {args.dir}")
        print(f"cp -r      : best {best_cp:.2f}s  {size / best_cp / 1e9:.2f} GB/s   (runs: "
              + ", ".join(f"{t:.2f}" for t in cp_times) + ")")
        print(f"a4ray stage: best {best_stage:.2f}s  {size / best_stage / 1e9:.2f} GB/s   (runs: "
              + ", ".join(f"{t:.2f}" for t in stage_times) + ")")
        print(f"throughput ratio stage/cp: {ratio:.2f}x (goal >= 0.9x) {'OK' if ratio >= 0.9 else 'BELOW GOAL'}")
        print(f"cache hit: median {hit * 1000:.0f} ms, max {max(hits) * 1000:.0f} ms over {len(hits)} calls "
              f"(goal < 1 s) {'OK' if max(hits) < 1 else 'BELOW GOAL'}")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
