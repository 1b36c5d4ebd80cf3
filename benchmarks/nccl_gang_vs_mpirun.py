"""nccl-tests through the a4ray gang (built on the nodes if need be) against the same binaries under bare mpirun.

    python benchmarks/nccl_gang_vs_mpirun.py --nodes 2 --gpus-per-node 1 [-b 1G -e 8G] [--iters 20] [--rounds 3]
        [--source git+file:///path/nccl-tests.git@<commit>] [--out DIR]

1. gang: `python -m a4ray.nccl_test --local-nodes N --gpus-per-node G` with nccl.implementation=nccl-tests:
   an embedded cluster of simulated nodes (each with its own GPUs), nccl-tests from the image or built from
   its pinned source by a4ray (`nccl.build`), one process per GPU through mpirun over Ray, the gIB env where
   the node has it; every collective of the spec.
2. bare: the binaries the gang ran, `mpirun -np N*G` on this machine, every GPU visible to every rank (the
   rank's GPU is its local rank, as nccl-tests picks it), the same sizes and iterations.
The two alternate for --rounds rounds (gang, then bare, each round), so that drift of the machine falls on both.
Prints busbw at the largest size per collective and round, and gang/bare of the medians (goal: >= 0.97). With
--out, the result JSON and the raw outputs (gang: node 0's log; bare: mpirun's stdout) are written there, one file
per collective and round.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from a4ray.parsers import nccl_tests  # noqa: E402
from a4ray.spec.nccl import COLLECTIVES, parse_size  # noqa: E402
from bare import env  # noqa: E402


def size_args(args) -> list[str]:
    return ["-b", args.b, "-e", args.e, "-f", "2", "-n", str(args.iters), "-w", str(args.warmup), "-c", "1",
            "-d", "float", "-g", "1"]


def gang(args, out: Path, tag: str) -> dict:
    result_file = out / f"gang-result{tag}.json"
    cmd = [sys.executable, "-m", "a4ray.nccl_test", "--local-nodes", str(args.nodes), "--gpus-per-node",
           str(args.gpus_per_node), "--result", str(result_file), "--set", "nccl.implementation=nccl-tests",
           "--set", f"nccl.collectives=[{','.join(args.collectives)}]", "--set", f"nccl.min_bytes={args.b}",
           "--set", f"nccl.max_bytes={args.e}", "--set", f"nccl.iters={args.iters}", "--set",
           f"nccl.warmup={args.warmup}", "--set", f"storage.local_workspace={args.workspace}"]
    if args.source:
        cmd += ["--set", f"nccl.build.source={args.source}"]
    for given in args.set:
        cmd += ["--set", given]
    done = subprocess.run(cmd, env=env(RAY_TMPDIR=tempfile.mkdtemp(prefix="r", dir="/tmp")), capture_output=True,
                          text=True, cwd=REPO)
    (out / f"gang-stdout{tag}.txt").write_text(done.stdout + done.stderr)
    if not result_file.is_file():
        print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
        return {}
    result = json.loads(result_file.read_text())
    print(f"gang verdict: {result.get('verdict') or result.get('error')}")
    logs = Path(result["gang"]["log_dir"]) if result.get("gang") else None
    if logs and (logs / "node-00.log").is_file():
        shutil.copyfile(logs / "node-00.log", out / f"gang-node-00{tag}.log")
        for build in logs.glob("builds/*.log"):
            shutil.copyfile(build, out / f"build-{build.name}")
    return result


def bare(args, binaries: str, collective: str, out: Path, tag: str) -> float | None:
    cmd = ["mpirun", "--allow-run-as-root", "-np", str(args.nodes * args.gpus_per_node), "--bind-to", "none",
           f"{binaries}/{collective}_perf", *size_args(args)]
    done = subprocess.run(cmd, env=env(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET"), capture_output=True,
                          text=True)
    (out / f"bare-{collective}{tag}.txt").write_text(done.stdout + done.stderr)
    run = next(iter(nccl_tests.parse(done.stdout.splitlines(), binary=f"{collective}_perf")), None)
    return run.largest.busbw if run and run.largest else None


def median(values: list[float | None]) -> float | None:
    """The median of the rounds that gave a figure; None if none did (a round without one fails the goal anyway)."""
    got = [v for v in values if v]
    return statistics.median(got) if got and len(got) == len(values) else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("-b", default="1G")
    p.add_argument("-e", default="8G")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1, help="gang and bare alternate this many times; medians compared")
    p.add_argument("--source", default="", help="nccl.build.source (e.g. a local git mirror where there is no network)")
    p.add_argument("--workspace", default=str(REPO / ".a4ray"), help="where builds are cached (storage.local_workspace)")
    p.add_argument("--set", action="append", default=[], help="more spec overrides for the gang's run")
    p.add_argument("--out", default="", help="keep the result JSON and the raw outputs here")
    args = p.parse_args()
    args.collectives = [c for c in args.collectives.split(",") if c]
    for size in (args.b, args.e):
        parse_size(size)
    out = Path(args.out or tempfile.mkdtemp(prefix="nccl-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    gang_busbw: dict[str, list[float | None]] = {c: [] for c in args.collectives}
    bare_busbw: dict[str, list[float | None]] = {c: [] for c in args.collectives}
    for round_ in range(args.rounds):
        tag = f"-r{round_}" if args.rounds > 1 else ""
        result = gang(args, out, tag)
        if not result.get("binaries_dir"):
            print("the gang ran no nccl-tests binaries: nothing to compare", file=sys.stderr)
            return 1
        through = {c["collective"]: c["busbw"] for c in result.get("collectives", [])}
        for collective in args.collectives:
            gang_busbw[collective].append(through.get(collective))
            bare_busbw[collective].append(bare(args, result["binaries_dir"], collective, out, tag))
        builds = ", ".join(f"node {b['node']}: {b['status']}" for b in result.get("builds", []))
        print(f"round {round_}: binaries {result['binaries_dir']} ({builds or 'the image'})")
    rows = []
    for collective in args.collectives:
        g, plain = median(gang_busbw[collective]), median(bare_busbw[collective])
        rows.append({"collective": collective, "gang_busbw": g, "bare_busbw": plain,
                     "gang_rounds": gang_busbw[collective], "bare_rounds": bare_busbw[collective],
                     "ratio": round(g / plain, 4) if g and plain else None})
    print(f"busbw GB/s at {args.e}, {args.nodes} nodes x {args.gpus_per_node} GPU(s), {args.iters} iterations "
          f"after {args.warmup}, median of {args.rounds} alternating round(s) (each round's in brackets)")
    for r in rows:
        each = lambda xs: ", ".join(f"{x:.2f}" if x else "-" for x in xs)  # noqa: E731
        print(f"  {r['collective']:<16s} gang {r['gang_busbw'] or float('nan'):9.2f} [{each(r['gang_rounds'])}]   "
              f"bare mpirun {r['bare_busbw'] or float('nan'):9.2f} [{each(r['bare_rounds'])}]   "
              f"gang/bare {r['ratio'] if r['ratio'] is not None else '-'}")
    (out / "comparison.json").write_text(json.dumps({"rows": rows, "builds": result.get("builds", []),
                                                      "verdict": result.get("verdict")}, indent=2))
    return 0 if all(r["ratio"] is not None and r["ratio"] >= 0.97 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
