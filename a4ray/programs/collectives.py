"""The built-in collective benchmark: nccl-tests' measurement with torch.distributed, run by torchrun.

Where the image has no nccl-tests binaries, `python -m a4ray.nccl_test` runs this on every GPU of every
node (NCCL), or on CPU processes (gloo) in a rehearsal. It measures what nccl-tests measures, the same
way: per size, `warmup` untimed then `iters` timed calls between a barrier and a device synchronize;
time = the mean over ranks of each rank's mean per call; algbw = bytes / time; busbw = algbw x 2(n-1)/n
for all_reduce and x (n-1)/n for all_gather, reduce_scatter and alltoall (nccl-tests doc/PERFORMANCE.md),
where `size` is the whole buffer (all ranks' chunks for all_gather, reduce_scatter and alltoall). A
separate call on known data counts wrong elements. Rank 0 prints nccl-tests' own output format, so
one parser (`a4ray.parsers.nccl_tests`) reads both. Placements torch has no call for (out-of-place
all_reduce, in-place alltoall) print N/A.

Without Ray, for a comparison on one machine:
    python -m torch.distributed.run --nproc-per-node 8 -m a4ray.programs.collectives -b 1G -e 8G -f 2 -n 5 -w 5
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from a4ray.programs.distributed import exit_distributed, init_distributed
from a4ray.spec.nccl import COLLECTIVES, format_size, parse_size

# torch 2.13 renamed the tensor-in, tensor-out collectives; older images have only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
DTYPES = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
REDOP = {"all_reduce": "sum", "reduce_scatter": "sum", "all_gather": "none", "alltoall": "none"}


def bus_factor(collective: str, n: int) -> float:
    return 2 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size)
        size *= factor
    return out


class Bench:
    def __init__(self, backend: str, dtype: torch.dtype, device: torch.device):
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.backend, self.dtype, self.device = backend, dtype, device
        self.tolerance = 0.0 if dtype == torch.float32 else 1e-2  # half types round the sums

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, op: Callable[[], object], iters: int, warmup: int) -> float:
        """Seconds per call, averaged over ranks (nccl-tests' default, -a 1)."""
        for _ in range(warmup):
            op()
        self.sync()
        dist.barrier()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            op()
        self.sync()
        elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=self.device)
        dist.all_reduce(elapsed)
        return float(elapsed) / self.n

    def wrong(self, got: torch.Tensor, expected: torch.Tensor) -> int:
        """Elements off by more than the dtype's tolerance, summed over ranks."""
        err = (got.float() - expected).abs() > self.tolerance * expected.abs()
        count = torch.tensor([int(err.sum())], dtype=torch.int64, device=self.device)
        dist.all_reduce(count)
        return int(count)

    def ops(self, collective: str, count: int) -> tuple[Callable | None, Callable | None, Callable[[], int]]:
        """(out-of-place op, in-place op, check) for `count` elements in all; the check fills known data,
        runs the out-of-place op (else the in-place one) once, and returns the wrong count."""
        n, r, chunk = self.n, self.rank, count // self.n
        # Zeroed, not empty: garbage may hold NaNs or denormals, which slow CPU reductions down.
        new = lambda k: torch.zeros(k, dtype=self.dtype, device=self.device)  # noqa: E731
        full = lambda value: torch.full((1,), float(value), device=self.device)  # noqa: E731
        chunks = torch.arange(n, device=self.device, dtype=torch.float32)[:, None]  # chunk index j
        # Per collective: its buffers, then (out-of-place op, in-place op, fill the input, what to check
        # against what). The same data and expectations as nccl-tests' own checks.
        if collective == "all_reduce":
            buf = new(count)
            case = (None, lambda: dist.all_reduce(buf), lambda: buf.fill_(r + 1), lambda: (buf, full(n * (n + 1) / 2)))
        elif collective == "all_gather":
            out, src = new(chunk * n), new(chunk)
            case = (lambda: _all_gather(out, src), lambda: _all_gather(out, out[r * chunk:(r + 1) * chunk]),
                    lambda: src.fill_(r), lambda: (out.view(n, chunk), chunks))
        elif collective == "reduce_scatter":  # chunk j (for rank j) holds j + 1 on every rank
            src, out = new(chunk * n), new(chunk)
            case = (lambda: _reduce_scatter(out, src), lambda: _reduce_scatter(src[r * chunk:(r + 1) * chunk], src),
                    lambda: src.view(n, chunk).copy_(chunks + 1), lambda: (out, full(n * (r + 1))))
        elif collective == "alltoall":  # every chunk this rank sends holds its rank
            src, out = new(chunk * n), new(chunk * n)
            case = (lambda: dist.all_to_all_single(out, src), None, lambda: src.fill_(r),
                    lambda: (out.view(n, chunk), chunks))
        else:
            raise ValueError(f"unknown collective {collective!r}")
        oop, inplace, fill, compare = case

        def check() -> int:
            fill()
            (oop or inplace)()
            return self.wrong(*compare())

        return oop, inplace, check


def _fmt(value: float) -> str:
    return f"{value:.2f}" if value < 1e6 else f"{value:.2e}"


def _timing(seconds: float | None, size: int, factor: float, wrong: str) -> str:
    if seconds is None:
        return f"{'N/A':>8s} {'N/A':>7s} {'N/A':>7s} {'N/A':>7s}"
    algbw = size / seconds / 1e9
    return f"{_fmt(seconds * 1e6):>8s} {_fmt(algbw):>7s} {_fmt(algbw * factor):>7s} {wrong:>7s}"


def run_collective(bench: Bench, collective: str, args: argparse.Namespace, devices: list[str]) -> int:
    """Measure one collective over every size; rank 0 prints nccl-tests' format. Returns #wrong."""
    n, say = bench.n, (print if bench.rank == 0 else (lambda *a, **k: None))
    itemsize = torch.tensor([], dtype=bench.dtype).element_size()
    dtype_name = next(k for k, v in DTYPES.items() if v == bench.dtype)
    binary = f"{collective}_perf"
    say(f"# Collective test starting: {binary}")
    say(f"# a4ray torch.distributed benchmark: backend {bench.backend}, torch {torch.__version__}")
    say(f"# nThread 1 nGpus 1 minBytes {args.min_bytes} maxBytes {args.max_bytes} step: {args.factor}(factor) "
        f"warmup iters: {args.warmup} iters: {args.iters} agg iters: 1 validation: {int(args.check)} graph: 0")
    say("#\n# Using devices")
    for line in devices:
        say(line)
    say("#")
    say(f"# {'':>58s}out-of-place                       in-place")
    say("#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong")
    say("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)")
    factor, total_wrong, busbws = bus_factor(collective, n), 0, []
    for size in sizes(args.min_bytes, args.max_bytes, args.factor):
        count = size // itemsize
        if collective != "all_reduce":
            count = count // n * n  # whole chunks per rank, as nccl-tests rounds
        if count == 0:
            continue
        nbytes = count * itemsize
        oop, inplace, check = bench.ops(collective, count)
        wrong = check() if args.check else None
        total_wrong += wrong or 0
        mark = "N/A" if wrong is None else str(wrong)
        t_oop = bench.timed(oop, args.iters, args.warmup) if oop else None
        t_ip = bench.timed(inplace, args.iters, args.warmup) if inplace else None
        busbws += [nbytes / t / 1e9 * factor for t in (t_oop, t_ip) if t]
        say(f"{nbytes:>12d}  {count:>12d}  {dtype_name:>8s}  {REDOP[collective]:>6s}  {-1:>6d}  "
            f"{_timing(t_oop, nbytes, factor, mark)}  {_timing(t_ip, nbytes, factor, mark)}", flush=True)
        del oop, inplace, check
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()  # sizes double: cached smaller blocks would only fragment the next
    say(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
    say(f"# Avg bus bandwidth    : {sum(busbws) / max(1, len(busbws)):.4f} ")
    say("#")
    say(f"# Collective test concluded: {binary}\n", flush=True)
    return total_wrong


def _device_line(rank: int, device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        ids = [getattr(p, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]  # torch >= 2.6
        bus = f"[{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}]" if None not in ids else "[?]"
        return (f"#  Rank {rank:2d} Group  0 Pid {os.getpid():6d} on {socket.gethostname():>10s} device "
                f"{device.index:2d} {bus} {p.name}")
    return f"#  Rank {rank:2d} Group  0 Pid {os.getpid():6d} on {socket.gethostname():>10s} device  0 [cpu] CPU (gloo)"


def _gather_lines(line: str, device: torch.device, width: int = 256) -> list[str]:
    """Every rank's `line`, in rank order (all_gather_object would need numpy, which torch does not)."""
    raw = line.encode()[:width]
    mine = torch.zeros(width, dtype=torch.uint8, device=device)
    mine[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    every = torch.empty(width * dist.get_world_size(), dtype=torch.uint8, device=device)
    _all_gather(every, mine)
    return [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in every.view(-1, width).cpu()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m a4ray.programs.collectives", description=__doc__.split("\n")[0])
    p.add_argument("--collectives", default="all_reduce",
                   help=f"comma-separated, of {', '.join(COLLECTIVES)}")
    p.add_argument("-b", "--min-bytes", type=parse_size, default=parse_size("1G"))
    p.add_argument("-e", "--max-bytes", type=parse_size, default=parse_size("8G"))
    p.add_argument("-f", "--factor", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=5)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("-c", "--check", type=int, default=1)
    p.add_argument("-d", "--dtype", choices=sorted(DTYPES), default="float")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    p.add_argument("--cpu-min-bytes", type=parse_size, help="-b instead, where the backend is gloo (a rehearsal)")
    p.add_argument("--cpu-max-bytes", type=parse_size, help="-e instead, where the backend is gloo")
    args = p.parse_args(argv)
    collectives = [c.strip() for c in args.collectives.split(",") if c.strip()]
    unknown = [c for c in collectives if c not in COLLECTIVES]
    if unknown or args.factor < 2 or args.min_bytes > args.max_bytes:
        p.error(f"unknown collectives {unknown}" if unknown else
                f"need -f >= 2 and -b <= -e (got -b {format_size(args.min_bytes)} -e {format_size(args.max_bytes)})")

    device, backend = init_distributed(args.backend)
    if backend == "gloo":
        args.min_bytes = args.cpu_min_bytes or args.min_bytes
        args.max_bytes = max(args.min_bytes, args.cpu_max_bytes or args.max_bytes)
    devices = _gather_lines(_device_line(dist.get_rank(), device), device)
    bench = Bench(backend, DTYPES[args.dtype], device)
    wrong = sum(run_collective(bench, c, args, devices) for c in collectives)
    exit_distributed(1 if wrong else 0)


if __name__ == "__main__":
    sys.exit(main())
