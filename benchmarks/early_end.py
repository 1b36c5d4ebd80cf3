"""Ranks that end early, call a different collective, or stop joining, on the A4 shape (NCCL on GPUs, gloo
without), judged with NOTHING configured (the watchdog's defaults): how long from the event to a4ray's verdict,
and what the verdict says. A plain user program (no a4ray code in the ranks), 2 simulated nodes x G GPUs:

  uneven  the odd rank runs out of data after 3 all-reduces and ends with exit 0; its peers wait in the 4th
          (on NCCL they block without an error): the verdict names it with the last collective it completed
  desync  the odd rank calls all_gather_into_tensor where its peers call all_reduce, as their 4th collective
  hang    the odd rank stops joining (sleeps outside any collective) from the 4th all-reduce on

    python benchmarks/early_end.py [--gpus-per-node 1] [--cases uneven:1,uneven:0,desync:0,hang:1]

Printed per case: seconds from the event (the program's own time stamp) to the verdict, the verdict's kind and
line, and whether it named only the odd rank (a tie in a desync names no one): an innocent rank named is a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import tempfile
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from a4ray.api import load, run  # noqa: E402
from embedded import embedded_cluster  # noqa: E402

PROGRAM = """
import os, sys, time
import torch, torch.distributed as dist
mode, odd = sys.argv[1], int(sys.argv[2])
nccl = torch.cuda.is_available()
if nccl:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if nccl else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.ones(1 << 20, device="cuda" if nccl else "cpu")
for i in range(1, 1000):
    if rank == odd and i == 4:
        print(f"event at {time.time():.3f}: rank {rank} {mode}", flush=True)
        if mode == "uneven":
            sys.exit(0)
        if mode == "hang":
            time.sleep(3600)
    if mode == "desync" and rank == odd and i == 4:
        dist.all_gather_into_tensor(torch.empty(world * x.numel(), device=x.device), x)
    else:
        dist.all_reduce(x)
    if nccl:
        torch.cuda.synchronize()
    time.sleep(0.1)
"""


def case(work: Path, gpus: int, mode: str, odd: int) -> dict:
    script = work / "program.py"
    script.write_text(PROGRAM)
    spec = load(None, "cluster.nodes=2", f"cluster.gpus_per_node={gpus}", "command.torchrun=true",
                f"storage.local_workspace={work}", f"command.argv=[{script}, {mode}, '{odd}']",
                "cluster.stop_grace_s=5", kind="command")
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        result = run(spec)
    text = said.getvalue()
    gang = result.gang
    verdict = gang.hang_verdict if gang else None
    event = re.search(r"event at ([\d.]+)", text)
    took = gang.times.verdict_at - float(event.group(1)) if gang and event and gang.times.verdict_at else None
    named = sorted(c.rank for c in verdict.culprits) if verdict else []
    return {"mode": mode, "odd": odd, "kind": verdict.kind if verdict else None, "failure": gang.failure_kind,
            "seconds": took, "named": named, "line": verdict.line() if verdict else gang.failure,
            "innocent": [r for r in named if r != odd],
            "stream": [line for line in text.splitlines() if line.startswith("a4ray: verdict")]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--cases", default="uneven:1,uneven:0,desync:0,hang:1")
    args = p.parse_args()
    results = []
    with embedded_cluster(2, args.gpus_per_node):
        for spec in args.cases.split(","):
            mode, odd = spec.split(":")
            with tempfile.TemporaryDirectory() as d:
                r = case(Path(d), args.gpus_per_node, mode, int(odd))
            results.append(r)
            took = f"{r['seconds']:.1f}s" if r["seconds"] is not None else "?"
            print(f"{mode} (rank {odd}): {'INNOCENT NAMED ' if r['innocent'] else ''}verdict {took} after the event; "
                  f"{r['failure']}/{r['kind']}; {r['line'][:400]}", flush=True)
    wrong = [r for r in results if r["innocent"]]
    print(f"{len(results)} cases: {sum(r['named'] == [r['odd']] for r in results)} named only the odd rank, "
          f"{sum(not r['named'] for r in results)} named no one, {len(wrong)} named an innocent rank; "
          f"event to verdict: " + ", ".join(f"{r['mode']}:{r['odd']} {r['seconds']:.1f}s" for r in results
                                            if r["seconds"] is not None))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
