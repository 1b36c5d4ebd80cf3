"""The verdicts a4ray reaches about a gang's nodes, as typed records: which rank hung a collective (and on
which node), which node is a straggler. They go in the printed failure or progress line, the launch's
`GangResult` (and so `result.json`), the restart decision and the node history; nothing here runs."""

from __future__ import annotations

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
        name = self.group_desc or ("default" if self.group == "0" else self.group)
        sizes = f", sizes {self.input_sizes}" if self.input_sizes else ""
        return f"{self.op or 'collective'} #{self.seq} of process group {name}{sizes}"


class Culprit(BaseModel):
    rank: int  # global rank
    node: NodeRef
    where: str = ""  # what its stack shows, "exited", or what NCCL's RAS said of it
    why: str = ""  # the evidence about this rank: "its flight record", "its stack", "its process is gone", "NCCL RAS"


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

    collective: Collective | None = None
    culprits: list[Culprit] = []
    waiting: list[int] = []  # ranks inside the collective (or blocked in a collective, from the stacks)
    evidence: list[str] = []  # what the verdict rests on: "flight recorder", "stacks", "NCCL RAS"
    analyzer: str = ""  # who matched the flight-recorder dumps
    undetermined: bool = False
    candidates: list[Candidate] = []
    ras: str = ""  # one line: what NCCL's RAS said, or why it was not heard
    note: str = ""

    def line(self) -> str:
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
            f" while ranks {ranges(self.waiting)} wait in one" if self.waiting else "")
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

