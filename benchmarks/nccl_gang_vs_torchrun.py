"""Busbw through the a4ray gang against plain torchrun (and plain mpirun), same benchmark, same call.

    python benchmarks/nccl_gang_vs_torchrun.py --nodes 2 --gpus-per-node 1 [-b 1G -e 8G] [--collective all_reduce]
        [--nccl-tests-dir /path/to/nccl-tests/build]

Runs, one after another on this machine:
  gang        python -m a4ray.nccl_test --local-nodes N --gpus-per-node G (embedded cluster of simulated
              nodes; each gets its own GPUs where the machine has enough), the torch benchmark
  torchrun    the same benchmark without Ray, the same shape: N torchrun "nodes" on 127.0.0.1, node i
              seeing the same GPUs as simulated node i (so NCCL picks the same transports)
  torchrun-1  the same benchmark, one torchrun with N x G processes, every GPU visible to every rank
and with --nccl-tests-dir, nccl-tests' binary through the gang (mpirun over Ray) and under plain mpirun.
Prints busbw at the largest size for each and its ratio to the gang's. On a machine without GPUs the
benchmark runs over gloo with the CPU sizes (a check that the comparison runs, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from a4ray.parsers import nccl_tests  # noqa: E402
from a4ray.runtime.simulated import physical_gpu_ids  # noqa: E402
from bare import env, torchrun_as_nodes  # noqa: E402
from a4ray.spec.nccl import parse_size  # noqa: E402


def _busbw(text: str, collective: str) -> float | None:
    run = next((r for r in nccl_tests.parse(text.splitlines(), binary=f"{collective}_perf")
                if r.collective == collective), None)
    return run.largest.busbw if run and run.largest else None


def gang(args, implementation: str, extra: list[str] = ()) -> float | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "a4ray.nccl_test", "--local-nodes", str(args.nodes), "--gpus-per-node",
               str(args.gpus_per_node), "--result", str(out), "--set", f"nccl.collectives=[{args.collective}]",
               "--set", f"nccl.min_bytes={args.b}", "--set", f"nccl.max_bytes={args.e}", "--set",
               f"nccl.cpu_min_bytes={args.cpu_b}", "--set", f"nccl.cpu_max_bytes={args.cpu_e}", "--set",
               f"nccl.implementation={implementation}", "--set", f"storage.local_workspace={tmp}", *extra]
        done = subprocess.run(cmd, env=env(RAY_TMPDIR=tempfile.mkdtemp(prefix="r", dir="/tmp")), capture_output=True,
                              text=True, cwd=REPO)
        if not out.is_file():
            print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
            return None
        result = json.loads(out.read_text())
        print(f"  gang verdict: {result.get('verdict') or result.get('error')}")
        return next((c["busbw"] for c in result.get("collectives", []) if c["collective"] == args.collective), None)


def bench_args(args) -> list[str]:
    return ["-m", "a4ray.programs.collectives", "--collectives", args.collective, "-b", args.b, "-e", args.e,
            "-f", "2", "-n", str(args.iters), "-w", str(args.warmup), "--cpu-min-bytes", args.cpu_b,
            "--cpu-max-bytes", args.cpu_e]


def torchrun_nodes(args, gpus: list[str]) -> float | None:
    """N torchrun processes as N nodes on 127.0.0.1, node i with simulated node i's GPUs."""
    outputs = torchrun_as_nodes(args.nodes, args.gpus_per_node, gpus, 29517, bench_args(args), cwd=REPO)
    return _busbw(outputs[0], args.collective)


def torchrun_one(args) -> float | None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nodes * args.gpus_per_node}",
           *bench_args(args)]
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, cwd=REPO)
    return _busbw(done.stdout, args.collective)


def mpirun_plain(args) -> float | None:
    binary = str(Path(args.nccl_tests_dir) / f"{args.collective}_perf")
    cmd = ["mpirun", "--allow-run-as-root", "-np", str(args.nodes * args.gpus_per_node), "--bind-to", "none",
           binary, "-b", args.b, "-e", args.e, "-f", "2", "-n", str(args.iters), "-w", str(args.warmup), "-g", "1"]
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    return _busbw(done.stdout, args.collective)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--collective", default="all_reduce")
    p.add_argument("-b", default="1G")
    p.add_argument("-e", default="8G")
    p.add_argument("--cpu-b", default="4M", help="sizes where the benchmark runs on CPU (gloo)")
    p.add_argument("--cpu-e", default="16M")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--nccl-tests-dir", help="also compare nccl-tests' binary through the gang and under mpirun")
    args = p.parse_args()
    for size in (args.b, args.e, args.cpu_b, args.cpu_e):
        parse_size(size)
    gpus = physical_gpu_ids()
    gpus = gpus if len(gpus) >= args.nodes * args.gpus_per_node else []
    shape = f"{args.nodes} nodes x {args.gpus_per_node} {'GPUs' if gpus else 'CPU processes (gloo)'}"
    print(f"{args.collective}, busbw GB/s at the largest size, {shape}:")
    rows = [("gang (a4ray, torch benchmark)", gang(args, "torch"))]
    rows.append(("torchrun, same nodes, no Ray", torchrun_nodes(args, gpus)))
    rows.append(("torchrun, one node", torchrun_one(args)))
    if args.nccl_tests_dir:
        rows.append(("gang (a4ray, nccl-tests via mpirun over Ray)",
                     gang(args, "nccl-tests", ["--set", f"nccl.binaries_dir={args.nccl_tests_dir}"])))
        rows.append(("mpirun, nccl-tests, no Ray", mpirun_plain(args)))
    base = rows[0][1]
    for name, busbw in rows:
        ratio = f"{busbw / base:.3f}" if busbw and base else "-"
        print(f"  {name:<46s} {busbw if busbw is not None else float('nan'):10.2f}   ratio to gang {ratio}")
    print(f"  sizes {args.b if gpus else args.cpu_b}..{args.e if gpus else args.cpu_e}, factor 2, "
          f"{args.iters} timed iterations after {args.warmup}")
    return 0 if all(v is not None for _, v in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
