"""The hang verdict on the A4 shape: a plain user program on NCCL (no a4ray code in the ranks), 2 simulated nodes x
G GPUs, whose culprit rank does not enter the 4th all-reduce while every other rank waits in it. Once for a culprit
at each rank (so at each local rank position on each node), then with the culprit frozen (SIGSTOP: its NCCL threads
stop too, so it can answer nothing). Every rank has a data-loader worker, as a Megatron rank with num_workers > 0
does: it inherits the rank's RANK, and its pid must not be taken for the rank's (flight record, RAS, stack). Printed per case: the verdict line, what it rests on, and whether it names only
the culprit (or is undetermined, naming no one): an innocent rank named is a failure.

    python benchmarks/hang_verdicts.py [--gpus-per-node 2] [--window-s 15] [--culprits 3,2,1,0]

The watchdog judges the hang after `--window-s` seconds without output (observe.watchdog.no_output_s); the program
prints nothing once its culprit has stopped. One embedded cluster serves every case. Without GPUs the program
runs on gloo, where a4ray's verdict comes from the stacks alone (user programs serve no flight record on gloo).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from a4ray.api import load, run  # noqa: E402
from embedded import embedded_cluster  # noqa: E402

PROGRAM = """
import os, signal, sys, time
import torch, torch.distributed as dist
culprit, how = int(sys.argv[1]), sys.argv[2]


class Prefetched(torch.utils.data.Dataset):  # each rank's data-loader worker waits here the whole run
    def __len__(self):
        return 1

    def __getitem__(self, i):
        time.sleep(3600)


worker = iter(torch.utils.data.DataLoader(Prefetched(), num_workers=1))  # forked before CUDA: it inherits RANK
nccl = torch.cuda.is_available()
if nccl:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if nccl else "gloo")
rank = dist.get_rank()
x = torch.ones(1 << 20, device="cuda" if nccl else "cpu")
for i in range(1, 5):
    if i == 4 and rank == culprit:
        print(f"rank {rank}: not entering all-reduce #4 ({how})", flush=True)
        if how == "frozen":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    dist.all_reduce(x)
    if nccl:
        torch.cuda.synchronize()
    print(f"rank {rank}: all-reduce #{i} done", flush=True)
"""


def case(work: Path, gpus: int, window_s: float, culprit: int, how: str) -> dict:
    script = work / "hang.py"
    script.write_text(PROGRAM)
    spec = load(None, "cluster.nodes=2", f"cluster.gpus_per_node={gpus}", "command.torchrun=true",
                f"storage.local_workspace={work}", f"command.argv=[{script}, '{culprit}', {how}]",
                f"observe.watchdog.no_output_s={window_s}", "cluster.stop_grace_s=5", kind="command")
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        result = run(spec)
    gang = result.gang
    verdict = gang.hang_verdict if gang else None
    named = sorted(c.rank for c in verdict.culprits) if verdict else []
    nodes = [line for line in said.getvalue().splitlines() if " gpus=" in line]
    return {"culprit": culprit, "how": how, "kind": gang.failure_kind if gang else None,
            "verdict": verdict.line() if verdict else None, "named": named,
            "undetermined": bool(verdict and getattr(verdict, "undetermined", False)),
            "innocent named": [r for r in named if r != culprit], "node lines": nodes}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--window-s", type=float, default=15)
    p.add_argument("--culprits", default=None, help="ranks to make the culprit (default: every rank, last first)")
    args = p.parse_args()
    world = 2 * args.gpus_per_node
    culprits = [int(c) for c in args.culprits.split(",")] if args.culprits else list(range(world - 1, -1, -1))
    results = []
    with embedded_cluster(2, args.gpus_per_node):
        for culprit, how in [(c, "skips") for c in culprits] + [(world - 1, "frozen")]:
            with tempfile.TemporaryDirectory() as d:
                r = case(Path(d), args.gpus_per_node, args.window_s, culprit, how)
            results.append(r)
            ok = not r["innocent named"] and (r["named"] == [culprit] or not r["named"])
            print(f"culprit rank {culprit} ({how}): {'OK' if ok else 'INNOCENT NAMED'}; {r['kind']}; {r['verdict']}",
                  flush=True)
            if results[0] is r:
                print("  " + "\n  ".join(r["node lines"]), flush=True)
    wrong = [r for r in results if r["innocent named"]]
    print(f"{len(results)} cases: {sum(r['named'] == [r['culprit']] for r in results)} named only the culprit, "
          f"{sum(not r['named'] for r in results)} named no one, {len(wrong)} named an innocent rank")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
