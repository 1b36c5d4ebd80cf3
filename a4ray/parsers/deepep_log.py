"""DeepEP's test output: `tests/test_intranode.py`, `tests/test_internode.py` and `tests/test_low_latency.py`.

Local rank 0 of every node prints (intranode and internode): `[config] ...`, `[layout] Kernel performance: X ms`,
one line per correctness case `[testing] Running with BF16, with top-k (async=.., previous=..) ...` followed
by ` passed` (a separate write, `end=''`), tuning lines, and the best configurations:
  intranode (8a07e7e): `[tuning] Best dispatch (BF16): SMs 24, NVL chunk 4, 339.12 GB/s (NVL), t: 54.3 us`
                       `[tuning] Best combine: SMs 24, NVL chunk 1: 293.10 GB/s (NVL), t: 62.9 us`
  internode v1.2.1:    `[tuning] Best dispatch (FP8): SMs 24, NVL chunk 4, RDMA chunk 8, transmit: 1.2 us, notify:
                       0.3 us, BW: 45.1 GB/s (RDMA), 147.2 GB/s (NVL)` (one line)
  internode later:     `[tuning] Best dispatch (FP8): SMs 24, NVL chunk 4, RDMA chunk 8: 45.10 GB/s (RDMA), ...`
The low-latency test has no cases: every rank prints its bandwidths, `[rank 0] Dispatch + combine bandwidth:
X GB/s, avg_t=...` and `[rank 0] Dispatch bandwidth: X GB/s, avg_t=... | Combine bandwidth: Y GB/s, ...`; it
passes when it exits 0 (a failed check is an assert in a spawned process). DeepEP's own failures (`DeepEP
timeout for dispatch receivers`, a CUDA or NVSHMEM error, an assert) are kept as they were printed.
Through mpirun with `--tag-output`, every chunk a rank writes is tagged `[job,rank]<stdout>:`, so a
physical line may hold several nodes' chunks: each tagged piece is read as its rank's (one process per
node, so the MPI rank is the node).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from pydantic import BaseModel

MPI_TAG = re.compile(r"\[\d+,(\d+)\]<(?:stdout|stderr)>:")
_TESTING = re.compile(r"\[testing\] Running with (\w+), (with|without) top-k")
_PASSED = re.compile(r"(?:^|\.\.\.)\s*passed\b")  # " passed" ends the case's line, or is its own chunk
_LAYOUT = re.compile(r"\[layout\] Kernel performance: ([\d.]+) ms")
_BEST = re.compile(r"\[tuning\] Best (dispatch \((FP8|BF16)\)|combine): SMs (\d+), NVL chunk (\d+)"
                   r"(?:, RDMA chunk (\d+))?.*?(?:([\d.]+) GB/s \(RDMA\), )?([\d.]+) GB/s \(NVL\)")
_LL_BOTH = re.compile(r"\[rank (\d+)\] Dispatch \+ combine bandwidth: ([\d.]+) GB/s")
_LL_EACH = re.compile(r"\[rank (\d+)\] Dispatch bandwidth: ([\d.]+) GB/s.*\| Combine bandwidth: ([\d.]+) GB/s")
# DeepEP's own words for a failure (csrc/kernels/exception.cuh, its host asserts), NVSHMEM's and CUDA's, and
# Python's end of a spawned process.
_FAILURE = re.compile(r"DeepEP timeout|DeepEP error|Failed: Assertion|AssertionError|CUDA error"
                      r"|NVSHMEM.*(?:ERROR|error)|RuntimeError:|ProcessRaisedException|Rank \d+ failed")


class Best(BaseModel):
    sms: int
    nvl_chunk: int
    rdma_chunk: int | None = None  # internode only
    rdma_gbps: float | None = None
    nvl_gbps: float


class LowLatency(BaseModel):
    dispatch_combine_gbps: float | None = None
    dispatch_gbps: float | None = None
    combine_gbps: float | None = None


class NodeReport(BaseModel):
    node: int
    cases: int = 0  # `[testing]` lines
    passed: int = 0
    layout_ms: float | None = None
    best: dict[str, Best] = {}  # "dispatch FP8", "dispatch BF16", "combine"
    low_latency: dict[int, LowLatency] = {}  # by global rank: every rank prints its own
    errors: list[str] = []  # DeepEP's, CUDA's or Python's words for what went wrong, first few

    @property
    def all_passed(self) -> bool:
        return self.cases > 0 and self.passed == self.cases

    def figures(self) -> dict[str, float]:
        """GB/s by name: `<best> NVL`, `<best> RDMA`, and the low-latency ones at the slowest rank."""
        out: dict[str, float] = {}
        for name, b in self.best.items():
            out[f"{name} NVL"] = b.nvl_gbps
            if b.rdma_gbps is not None:
                out[f"{name} RDMA"] = b.rdma_gbps
        for field, name in (("dispatch_gbps", "dispatch"), ("combine_gbps", "combine"),
                            ("dispatch_combine_gbps", "dispatch+combine")):
            values = [getattr(r, field) for r in self.low_latency.values() if getattr(r, field) is not None]
            if values:
                out[name] = min(values)
        return out


def pieces(node: int, line: str) -> list[tuple[int, str]]:
    """(node, text) pieces of a line: split at mpirun's tags (which name the node), else the whole line."""
    tags = list(MPI_TAG.finditer(line))
    if not tags:
        return [(node, line)]
    out = [(node, line[:tags[0].start()])] if tags[0].start() else []
    for tag, following in zip(tags, [*tags[1:], None]):
        out.append((int(tag.group(1)), line[tag.end():following.start() if following else len(line)]))
    return out


def parse(lines: Iterable[tuple[int, str]]) -> list[NodeReport]:
    """`lines` as (node, text); mpirun's tags, where present, say the node instead."""
    nodes: dict[int, NodeReport] = {}
    for line_node, raw in lines:
        for node, text in pieces(line_node, raw):
            report = nodes.setdefault(node, NodeReport(node=node))
            report.cases += len(_TESTING.findall(text))
            report.passed += len(_PASSED.findall(text))
            if m := _LAYOUT.search(text):
                report.layout_ms = float(m.group(1))
            if m := _BEST.search(text):
                name = f"dispatch {m.group(2)}" if m.group(2) else "combine"
                report.best[name] = Best(sms=int(m.group(3)), nvl_chunk=int(m.group(4)),
                                         rdma_chunk=int(m.group(5)) if m.group(5) else None,
                                         rdma_gbps=float(m.group(6)) if m.group(6) else None,
                                         nvl_gbps=float(m.group(7)))
            if m := _LL_BOTH.search(text):
                report.low_latency.setdefault(int(m.group(1)), LowLatency()).dispatch_combine_gbps = float(m.group(2))
            if m := _LL_EACH.search(text):
                ll = report.low_latency.setdefault(int(m.group(1)), LowLatency())
                ll.dispatch_gbps, ll.combine_gbps = float(m.group(2)), float(m.group(3))
            if _FAILURE.search(text) and len(report.errors) < 5 and text.strip() not in report.errors:
                report.errors.append(text.strip())
    return [nodes[k] for k in sorted(nodes)]
