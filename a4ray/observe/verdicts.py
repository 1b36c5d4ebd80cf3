"""The verdicts a4ray reaches about a gang's nodes, as typed records: which rank hung a collective (and on
which node), which node is a straggler. They go in the printed failure or progress line, the launch's
`GangResult` (and so `result.json`), the restart decision and the node history; nothing here runs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from a4ray.observe.stacks import ranges


_SHOWN = 8  # candidates spelled out in a verdict's line


class NodeRef(BaseModel):
    """A node of the gang as a person finds it: gang rank, host, IP and topology block."""

    node: int  # gang rank
    host: str  # the host label where the node has one (a machine), else its hostname
    hostname: str = ""
    ip: str = ""
    location: str = ""  # block/subblock/host, as the topology labels say

    def describe(self) -> str:
        return f"node {self.node} ({self.host}, {self.ip}{', ' + self.location if self.location else ''})"


class Collective(BaseModel):
    """One collective of one process group, as the flight recorder saw it."""

    group: str  # the process group's id in the flight recorder ("0" is the default group)
    group_desc: str = ""
    seq: int  # collective_seq_id within the group (1 = its first collective)
    op: str = ""  # profiling name, e.g. "gloo:all_reduce", "nccl:all_reduce"
    input_sizes: list = []
    output_sizes: list = []

    def describe(self) -> str:
        sizes = f", sizes {self.input_sizes}" if self.input_sizes else ""
        return f"{self.op or 'collective'} #{self.seq} of process group {self.group_name}{sizes}"

    @property
    def group_name(self) -> str:
        return self.group_desc or ("default" if self.group == "0" else self.group)

    def short(self) -> str:
        """"all_reduce #4 of group default": the op as the user called it (no backend prefix)."""
        return f"{self.op.split(':')[-1] or 'collective'} #{self.seq} of group {self.group_name}"


class Culprit(BaseModel):
    rank: int  # global rank
    node: NodeRef
    where: str = ""  # what its stack shows, "exited", or what NCCL's RAS said of it
    why: str = ""  # the evidence about this rank: "its flight record", "its stack", "its process is gone", "NCCL RAS"


class EndedRank(BaseModel):
    """A rank whose process ended while others of its launch still ran: seen by its node's launcher (or its node's
    command ending), with what its record says it did last."""

    rank: int
    node: NodeRef
    exit_code: int
    at: float  # wall clock, when its launcher saw it end
    last: Collective | None = None  # the last collective its record (left at exit) shows it completed

    def describe(self) -> str:
        after = f" after {self.last.short()}" if self.last else " (no record of its last collective)"
        return f"rank {self.rank} ({self.node.describe()}) ended with exit {self.exit_code}{after}"


class DesyncSide(BaseModel):
    """The ranks that called one collective at a sequence number where others called another."""

    ranks: list[int]
    call: str  # "all_gather_into_tensor #4 ([4096] float32)", or from a stack "all_gather_into_tensor"

    def describe(self) -> str:
        return f"{'ranks' if len(self.ranks) > 1 else 'rank'} {ranges(self.ranks)} called {self.call}"


class Candidate(BaseModel):
    """A rank an undetermined verdict could not clear or name, and why it gave no evidence either way."""

    rank: int
    node: NodeRef
    why: str  # e.g. "no flight record: timed out (its flight-record server did not answer in 10s); no stack"

    def describe(self) -> str:
        return f"rank {self.rank} on node {self.node.node} ({self.node.host}): {self.why}"


class HangVerdict(BaseModel):
    """Who a hang waits for. A rank is named only on evidence about that rank (its own flight record, its
    process gone, its stack, NCCL's RAS); a rank that did not answer is not named for that. `undetermined`: the
    ranks that answered show someone did not join, and nothing says who; `candidates` are those who could be
    it, each with why it gave no evidence. `culprits` is empty then, and wherever the evidence is missing or
    disagrees (`note` says which)."""

    kind: Literal["hang", "ended", "desync"] = "hang"  # a rank never joined; a rank ended early; ranks disagree
    collective: Collective | None = None
    culprits: list[Culprit] = []
    waiting: list[int] = []  # ranks inside the collective (or blocked in a collective, from the stacks)
    evidence: list[str] = []  # what the verdict rests on: "flight recorder", "stacks", "NCCL RAS"
    analyzer: str = ""  # who matched the flight-recorder dumps
    undetermined: bool = False
    candidates: list[Candidate] = []
    ras: str = ""  # one line: what NCCL's RAS said, or why it was not heard
    note: str = ""
    ended: list[EndedRank] = []  # ranks that had ended when it was judged (kind "ended": the culprits among them)
    sides: list[DesyncSide] = []  # kind "desync": who called what, the minority first
    waiting_in: str = ""  # where the waiting ranks' stacks are, when no flight record names the collective
    waiting_since: float | None = None  # wall clock: when the first waiting rank entered the collective (records)

    def line(self) -> str:
        tail = f" (evidence: {', '.join(self.evidence) or 'none'})" + (f"; {self.note}" if self.note else "")
        if self.kind == "desync":
            if self.culprits:
                minority, rest = self.sides[0], self.sides[1:]
                said = f"{minority.describe()} while " + "; ".join(s.describe() for s in rest)
            else:
                said = "; ".join(s.describe() for s in self.sides) + ": no side is the minority, no one is blamed"
            return f"desync: {said}{tail}"
        if self.kind == "ended":
            blamed = {c.rank for c in self.culprits}
            who = "; ".join(e.describe() for e in self.ended if e.rank in blamed)
            where = self.collective.short() if self.collective else (self.waiting_in or "a collective")
            waiting = (f"ranks {ranges(self.waiting)} wait in {where}" if len(self.waiting) > 1 else
                       f"rank {ranges(self.waiting)} waits in {where}"
                       if self.waiting else f"its peers wait in {where}")
            return f"{who}; {waiting}, which {'it' if len(blamed) == 1 else 'they'} never joined{tail}"
        if self.undetermined:
            waiting = f"ranks {ranges(self.waiting)} wait in {self.collective.describe()}" if self.collective and \
                self.waiting else "ranks wait in a collective"
            shown = [c.describe() for c in self.candidates[:_SHOWN]]
            more = len(self.candidates) - len(shown)
            candidates = "; ".join(shown) + (f"; and {more} more (in verdict.json)" if more > 0 else "")
            return (f"undetermined: {waiting} and some rank never joined, but nothing says which; no culprit named "
                    f"(evidence: {', '.join(self.evidence) or 'none'}); candidates: {candidates}"
                    + (f"; {self.note}" if self.note else ""))
        if not self.culprits:
            return f"no culprit named: {self.note or 'no evidence'}"
        ranks = ", ".join(f"rank {c.rank} on {c.node.describe()}" + (f" [{c.where}]" if c.where else "")
                          for c in self.culprits)
        what = f" never joined {self.collective.describe()}" if self.collective else " is not inside a collective"
        waiting = f" that ranks {ranges(self.waiting)} wait in" if self.waiting and self.collective else (
            f" while ranks {ranges(self.waiting)} wait in {self.waiting_in or 'one'}" if self.waiting else "")
        return (f"culprit: {ranks}{what}{waiting} (evidence: {', '.join(self.evidence)})"
                + (f"; {self.note}" if self.note else ""))


class Straggler(BaseModel):
    """A node whose ranks computed slower than the gang's median for `windows` windows in a row."""

    node: NodeRef
    iteration: int  # the last iteration of the window that flagged it
    step_time_s: float  # the node's median rank compute time per step in that window
    gang_median_s: float
    slower_pct: float
    windows: int
    times: int = 1  # how often it was flagged in the launch (again after it caught up in between); the latest figures

    def line(self) -> str:
        again = f" (flagged {self.times} times in this launch)" if self.times > 1 else ""
        return (f"straggler: {self.node.describe()} computes {self.slower_pct:.0f}% slower than the gang's median "
                f"({self.step_time_s:.3f}s vs {self.gang_median_s:.3f}s per step) for {self.windows} window(s), "
                f"up to iteration {self.iteration}{again}")

