"""A stand-in for an nccl-tests binary (`all_reduce_perf`) on machines without CUDA, for the tests of
a4ray's nccl-tests path: same flags (-b -e -f -n -w -c -d -g), same MPI launch (one rank per slot),
same output format, with a real MPI_Allreduce over host buffers timed the nccl-tests way. Tests install
it as `<dir>/all_reduce_perf` (see tests/test_nccl_test.py)."""

import argparse
import os
import sys
import time
from array import array

from mpi4py import MPI

from a4ray.spec.nccl import parse_size


def say(text: str) -> None:
    os.write(1, (text + "\n").encode())


p = argparse.ArgumentParser()
for flag, default in (("-b", "8"), ("-e", "8"), ("-f", "2"), ("-n", "20"), ("-w", "5"), ("-c", "1"), ("-g", "1")):
    p.add_argument(flag, default=default)
p.add_argument("-d", default="float")
args = p.parse_args()
comm, binary = MPI.COMM_WORLD, os.path.basename(sys.orig_argv[1])  # the installed name, e.g. all_reduce_perf
n, rank = comm.size, comm.rank
lo, hi, factor, iters, warmup = parse_size(args.b), parse_size(args.e), int(args.f), int(args.n), int(args.w)
if rank == 0:
    say(f"# Collective test starting: {binary}")
    say(f"# nThread 1 nGpus {args.g} minBytes {lo} maxBytes {hi} step: {factor}(factor) warmup iters: {warmup} "
        f"iters: {iters} agg iters: 1 validation: {args.c} graph: 0")
    say("#\n# Using devices")
devices = comm.gather(f"#  Rank {rank:2d} Group  0 Pid {os.getpid():6d} on {MPI.Get_processor_name():>10s} "
                      f"device  0 [cpu] host memory (stand-in)", root=0)
if rank == 0:
    for line in devices:
        say(line)
    say("#\n#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong")
size, total = lo, []
while size <= hi:
    send, recv = array("f", [rank + 1]) * (size // 4), array("f", [0]) * (size // 4)
    cells = []
    for placement in ("out", "in"):
        buf = recv if placement == "out" else send
        for _ in range(warmup):
            comm.Allreduce(send if placement == "out" else MPI.IN_PLACE, buf)
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.Allreduce(send if placement == "out" else MPI.IN_PLACE, buf)
        t = comm.allreduce((time.perf_counter() - t0) / iters) / n
        send = array("f", [rank + 1]) * (size // 4)
        comm.Allreduce(MPI.IN_PLACE, send)
        wrong = comm.allreduce(sum(v != n * (n + 1) / 2 for v in send))
        send = array("f", [rank + 1]) * (size // 4)
        algbw = size / t / 1e9
        total.append(algbw * 2 * (n - 1) / n)
        cells.append(f"{t * 1e6:8.2f} {algbw:7.2f} {algbw * 2 * (n - 1) / n:7.2f} {wrong:7d}")
    if rank == 0:
        say(f"{size:>12d}  {size // 4:>12d}     float     sum      -1  {cells[0]}  {cells[1]}")
    size *= factor
if rank == 0:
    say(f"# Out of bounds values : 0 OK\n# Avg bus bandwidth    : {sum(total) / len(total):.4f}\n#")
    say(f"# Collective test concluded: {binary}")
