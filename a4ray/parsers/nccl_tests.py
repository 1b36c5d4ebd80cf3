"""nccl-tests' output (`all_reduce_perf` & co., v2.13 to v2.19+; a4ray's torch benchmark prints the same).

One run of a binary is a header (`# nThread ...`, `# Using devices`, one `#  Rank ...` line per rank),
data rows of 13 columns (size count type redop root, then time algbw busbw #wrong out-of-place and
in-place; `N/A` where a value was not measured or checked), and a footer (`# Out of bounds values`,
`# Avg bus bandwidth`). Since 2025 a run is framed by `# Collective test starting: <binary>` and
`# Collective test concluded: <binary>`; older versions are split at their `# nThread` header.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from pydantic import BaseModel

_STARTING = re.compile(r"^#\s*Collective test starting:\s*(\S+)")
_CONCLUDED = re.compile(r"^#\s*Collective test concluded:\s*(\S+)")
_VERSION = re.compile(r"^#\s*nccl-tests version\s+(\S+)")
_HEADER = re.compile(r"^#\s*nThread\s+(\d+)\s+nGpus\s+(\d+)\s+minBytes\s+(\d+)\s+maxBytes\s+(\d+)")
_DEVICE = re.compile(r"^#\s*Rank\s+(\d+)\s+Group\s+\d+\s+Pid\s+(\d+)\s+on\s+(\S+)\s+"
                     r"device\s+(\d+)\s+(\[[^\]]*\])\s*(.*)$")
_OOB = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)\s*(\w+)?")
_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([-\d.eE+]+)\s*(\w+)?")
# nccl-tests' own words for a failure (src/common.h: CUDACHECK, NCCLCHECK, TESTCHECK), e.g.
# `vm: Test NCCL failure common.cu:1041 'unhandled system error / ...'`.
FAILURE = re.compile(r"Test (?:CUDA |NCCL )?failure\b")
# a4ray's torch benchmark says which torch.distributed backend it measured.
_BACKEND = re.compile(r"^#\s*a4ray torch.distributed benchmark: backend (\w+)")


class Timing(BaseModel):
    time_us: float
    algbw: float  # GB/s (1e9)
    busbw: float
    wrong: int | None = None  # None: not checked (-c 0)


class PerfRow(BaseModel):
    size: int  # bytes
    count: int
    dtype: str
    redop: str
    root: int
    out_of_place: Timing | None
    in_place: Timing | None

    @property
    def busbw(self) -> float | None:
        """The better of the two placements (a link-speed figure)."""
        values = [t.busbw for t in (self.out_of_place, self.in_place) if t is not None]
        return max(values) if values else None

    @property
    def wrong(self) -> int:
        return sum(t.wrong or 0 for t in (self.out_of_place, self.in_place) if t is not None)


class Device(BaseModel):
    rank: int
    pid: int
    host: str
    device: int
    bus: str
    name: str


class PerfRun(BaseModel):
    """One run of one nccl-tests binary (or one collective of the torch benchmark)."""

    binary: str = ""
    version: str | None = None
    backend: str = "nccl"  # nccl-tests always; the torch benchmark says (nccl | gloo)
    min_bytes: int | None = None
    max_bytes: int | None = None
    devices: list[Device] = []
    rows: list[PerfRow] = []
    out_of_bounds: int | None = None  # `# Out of bounds values`: how many sizes had wrong results
    avg_busbw: float | None = None  # nccl-tests' own: the mean over every row and placement
    concluded: bool = False

    @property
    def collective(self) -> str:
        """`all_reduce_perf` / `all_reduce_perf_mpi` -> `all_reduce`."""
        return re.sub(r"_perf(_mpi)?$", "", self.binary.rsplit("/", 1)[-1])

    @property
    def largest(self) -> PerfRow | None:
        return max(self.rows, key=lambda r: r.size) if self.rows else None

    @property
    def wrong(self) -> int:
        return sum(r.wrong for r in self.rows)

    def check_problem(self) -> str | None:
        """What nccl-tests' own check found wrong (the #wrong column, the `Out of bounds values` count), or None."""
        sizes = f" in {self.out_of_bounds} size(s)" if self.out_of_bounds else ""
        if self.wrong:
            return f"{self.wrong} wrong elements{sizes}"
        if self.out_of_bounds:
            return f"wrong results{sizes} (# Out of bounds values: {self.out_of_bounds})"
        return None


def _number(text: str) -> float | None:
    return None if text.upper() == "N/A" else float(text)


def _timing(time: str, algbw: str, busbw: str, wrong: str) -> Timing | None:
    t, a, b = _number(time), _number(algbw), _number(busbw)
    if t is None or a is None or b is None:
        return None
    # #wrong is printed with %6g (nccl-tests src/util.cu): a million wrong elements read `1e+06`.
    return Timing(time_us=t, algbw=a, busbw=b, wrong=None if wrong.upper() == "N/A" else round(float(wrong)))


def parse_row(line: str) -> PerfRow | None:
    fields = line.split()
    if len(fields) != 13 or not fields[0].isdigit() or not fields[1].isdigit():
        return None
    try:
        return PerfRow(size=int(fields[0]), count=int(fields[1]), dtype=fields[2], redop=fields[3],
                       root=int(fields[4]), out_of_place=_timing(*fields[5:9]), in_place=_timing(*fields[9:13]))
    except ValueError:
        return None


def parse(lines: Iterable[str], binary: str = "") -> list[PerfRun]:
    """Every run in `lines` (other lines, e.g. NCCL INFO or MPI noise, are skipped). `binary` names a run
    that does not name itself (versions before the `Collective test starting` line)."""
    runs: list[PerfRun] = []
    current: PerfRun | None = None
    version = None

    def begin(name: str = "") -> PerfRun:
        run = PerfRun(binary=name or binary, version=version)
        runs.append(run)
        return run

    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        if m := _VERSION.match(line):
            version = m.group(1)
            if current is not None:
                current.version = current.version or version
        elif m := _STARTING.match(line):
            current = begin(m.group(1))
        elif m := _HEADER.match(line):
            if current is None or current.rows or current.min_bytes is not None:
                current = begin()
            current.min_bytes, current.max_bytes = int(m.group(3)), int(m.group(4))
        elif current is None:
            continue
        elif m := _BACKEND.match(line):
            current.backend = m.group(1)
        elif m := _DEVICE.match(line):
            current.devices.append(Device(rank=int(m.group(1)), pid=int(m.group(2)), host=m.group(3),
                                          device=int(m.group(4)), bus=m.group(5), name=m.group(6).strip()))
        elif m := _OOB.match(line):
            current.out_of_bounds = int(m.group(1))
        elif m := _AVG.match(line):
            current.avg_busbw = float(m.group(1))
        elif m := _CONCLUDED.match(line):
            current.concluded = True
            current.binary = current.binary or m.group(1)
        elif not line.startswith("#") and (row := parse_row(line)) is not None:
            current.rows.append(row)
    return [run for run in runs if run.rows or run.devices]
