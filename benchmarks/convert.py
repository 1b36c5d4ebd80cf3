"""Native conversion throughput against a raw copy of the same bytes, measured in the same run.

    python benchmarks/convert.py                 # ~2.6 GB bf16 Qwen3-MoE, 1 and 2 simulated nodes
    python benchmarks/convert.py --layers 4      # smaller, quicker

Generates a random Qwen3-MoE HF checkpoint (transformers, sharded safetensors) once, then times:
  baseline   `cat <shards> > file && sync file`  (read + write + fsync of the same bytes)
  native     `a4ray convert` with the native backend, verification off, on an embedded cluster of
             simulated A4 nodes, with 1 node and with 2 nodes (end to end: fingerprint, plan, placement,
             Ray tasks, fsync, commit)
and prints each throughput and its ratio to the baseline. Goal: >= 0.6x on one node, more on two.
Both sides run with warm page caches (the checkpoint was just written or read).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def generate(path: Path, args: argparse.Namespace) -> Path:
    from a4ray.staging.tiny import write_tiny

    marker = path / ".complete"
    if marker.is_file() and marker.read_text() == repr(vars(args)):
        return path
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.monotonic()
    write_tiny(path, moe=True, layers=args.layers, hidden=args.hidden, heads=16, kv_heads=4, head_dim=64,
               ffn=4 * args.hidden, experts=args.experts, topk=8, moe_ffn=args.moe_ffn, vocab=args.vocab,
               dtype=torch.bfloat16, shard_size="512MB")
    marker.write_text(repr(vars(args)))
    print(f"generated {path} in {time.monotonic() - t0:.0f}s", flush=True)
    return path


def shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def baseline(files: list[Path], scratch: Path) -> float:
    target = scratch / "copy.bin"
    t0 = time.monotonic()
    subprocess.run(f"cat {' '.join(map(str, files))} > {target} && sync {target}", shell=True, check=True)
    seconds = time.monotonic() - t0
    target.unlink()
    return seconds


def native(model: Path, scratch: Path, nodes: int, tasks_per_node: int, run: int) -> tuple[float, int]:
    from a4ray.driver.execute import run as convert
    from a4ray.spec import load_job

    output = scratch / f"native-{nodes}-{run}"
    spec = load_job(None, [f"convert.input={model}", f"convert.output={output}", f"cluster.nodes={nodes}",
                           "cluster.gpus_per_node=1", f"convert.tasks_per_node={tasks_per_node}",
                           "convert.verify.enabled=false", f"storage.local_workspace={scratch / 'ws'}"],
                    kind="convert")
    t0 = time.monotonic()
    result = convert(spec)
    seconds = time.monotonic() - t0
    assert result.status == "ran", result.verdict
    shutil.rmtree(output)
    return seconds, len(result.parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=48)
    p.add_argument("--moe-ffn", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tasks-per-node", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3, help="rounds of measurements; the best of each counts")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "a4ray-bench-convert"))
    args = p.parse_args()

    import ray

    from a4ray.runtime.connect import NAMESPACE
    from a4ray.runtime.simulated import SimulatedCluster

    work = Path(args.workdir)
    model = generate(work / "hf", argparse.Namespace(**{k: v for k, v in vars(args).items()
                                                         if k in ("layers", "hidden", "experts", "moe_ffn", "vocab")}))
    files = shards(model)
    nbytes = sum(f.stat().st_size for f in files)
    scratch = work / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    print(f"checkpoint: {len(files)} shards, {nbytes / 1e9:.2f} GB", flush=True)

    cluster = SimulatedCluster(2, 1)
    cluster.start()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    # Rounds of (copy, 1 node, 2 nodes) back to back, so that each ratio compares runs made under the
    # same load of the machine; the best time of each counts.
    times: dict[str, list[float]] = {"copy": [], "1": [], "2": []}
    parts: dict[str, int] = {}
    try:
        baseline(files, scratch)  # warm the page cache for both sides
        for run in range(args.repeat):
            times["copy"].append(baseline(files, scratch))
            for nodes in (1, 2):
                seconds, parts[str(nodes)] = native(model, scratch, nodes, args.tasks_per_node, run)
                times[str(nodes)].append(seconds)
            print(f"round {run + 1}: copy {times['copy'][-1]:.2f}s, native 1 node {times['1'][-1]:.2f}s, "
                  f"2 nodes {times['2'][-1]:.2f}s", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()

    copy_s = min(times["copy"])
    rows = [("cat + sync (baseline)", copy_s, "")]
    rows += [(f"native, {n} node(s) x {args.tasks_per_node} tasks", min(times[n]), f"{parts[n]} parts") for n in "12"]
    print(f"\n{'':36} {'seconds':>8} {'GB/s':>7} {'ratio':>6}")
    for name, seconds, note in rows:
        print(f"{name:36} {seconds:8.2f} {nbytes / 1e9 / seconds:7.3f} {copy_s / seconds:6.2f}  {note}")
    one, two = copy_s / rows[1][1], copy_s / rows[2][1]
    print(f"\nratio to the raw copy: {one:.2f}x on 1 node (goal >= 0.6), {two:.2f}x on 2 nodes (goal: more)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
