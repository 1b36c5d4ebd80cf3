"""DeepEP's internode test output (`tests/test_internode.py`, tags v1.2.1 and later).

Local rank 0 of every node prints: `[config] ...`, `[layout] Kernel performance: X ms`, one line per
correctness case `[testing] Running with BF16, with top-k (async=.., previous=..) ... passed` (the
number of cases changed between versions; " passed" is printed on the same line), tuning lines, and
the best configurations, in either format:
  v1.2.1: `[tuning] Best dispatch (FP8): SMs 24, NVL chunk 4, RDMA chunk 8, transmit: 1.2 us, notify: 0.3 us,
           BW: 45.1 GB/s (RDMA), 147.2 GB/s (NVL)` (one line)
  later:  `[tuning] Best dispatch (FP8): SMs 24, NVL chunk 4, RDMA chunk 8: 45.10 GB/s (RDMA), 147.20 GB/s (NVL)`
  and `[tuning] Best combine: SMs 24, NVL chunk 1, RDMA chunk 16, ... GB/s (RDMA), ... GB/s (NVL)`.
Through mpirun with `--tag-output`, every chunk a rank writes is tagged `[job,rank]<stdout>:`, so a
physical line may hold several nodes' chunks (`print(..., end='')` and `print(' passed')` are separate
writes): each tagged piece is read as its rank's (one process per node, so the MPI rank is the node).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from pydantic import BaseModel

MPI_TAG = re.compile(r"\[\d+,(\d+)\]<(?:stdout|stderr)>:")
_TESTING = re.compile(r"\[testing\] Running with (\w+), (with|without) top-k")
_PASSED = re.compile(r"(?:^|\.\.\.)\s*passed\b")  # " passed" ends the case's line, or is its own chunk
_LAYOUT = re.compile(r"\[layout\] Kernel performance: ([\d.]+) ms")
_BEST = re.compile(
    r"\[tuning\] Best (dispatch \((FP8|BF16)\)|combine): SMs (\d+), NVL chunk (\d+), RDMA chunk (\d+)"
    r".*?([\d.]+) GB/s \(RDMA\), ([\d.]+) GB/s \(NVL\)"
)


class Best(BaseModel):
    sms: int
    nvl_chunk: int
    rdma_chunk: int
    rdma_gbps: float
    nvl_gbps: float


class NodeReport(BaseModel):
    node: int
    cases: int = 0  # `[testing]` lines
    passed: int = 0
    layout_ms: float | None = None
    best: dict[str, Best] = {}  # "dispatch FP8", "dispatch BF16", "combine"

    @property
    def all_passed(self) -> bool:
        return self.cases > 0 and self.passed == self.cases


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
                report.best[name] = Best(sms=int(m.group(3)), nvl_chunk=int(m.group(4)), rdma_chunk=int(m.group(5)),
                                         rdma_gbps=float(m.group(6)), nvl_gbps=float(m.group(7)))
    return [nodes[k] for k in sorted(nodes)]
