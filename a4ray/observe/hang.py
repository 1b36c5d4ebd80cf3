"""Hangs, on the driver's side: the watchdog that decides a launch is hung, the report of where every rank
was when it did (each node's flight records, stacks and NCCL RAS's word, from `flight.py`, `stacks.py` and
`ras.py` through its node actor, and a summary), and the verdict: which rank, on which node, the hang waits for,
named only on evidence about that rank.

The supervisor feeds the watchdog what it streams (output, iteration lines) and asks it every second.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

import ray

from a4ray.core.console import say
from a4ray.observe import flight, ras
from a4ray.observe.flight import NoRecord
from a4ray.observe.stacks import StackDump, ranges, summarize
from a4ray.observe.verdicts import Candidate, Culprit, HangVerdict, NodeRef
from a4ray.spec.resilience import WatchdogSpec

_STACKS_TIMEOUT_S = 120
# Lines that say a run is busy between iterations, so its pace does not apply until it says it is done (or the
# next iteration comes): Megatron-LM's checkpoint save and evaluation (checkpointing.py's "saving checkpoint at
# iteration", training.py's "Evaluating on"/"Evaluating iter"), and any program's own `a4ray: busy ...` line.
_BUSY = re.compile(r"saving checkpoint at iteration|\bEvaluating (on|iter)\b|\ba4ray: busy\b", re.IGNORECASE)
# ... and the lines that say it is done: Megatron-LM's "successfully saved checkpoint", "validation loss at",
# a4ray's trainer's "saved checkpoint iteration", `a4ray: done ...`.
_DONE = re.compile(r"successfully saved checkpoint|validation loss at|\bsaved checkpoint iteration\b|"
                   r"\ba4ray: done\b", re.IGNORECASE)
_PACE_SAMPLES = 50  # the median of the latest gaps between iteration lines


class Watchdog:
    """When a launch is hung (observe.watchdog, `WatchdogSpec.rule()` says it in words):
      * no iteration line in the first `startup_s`;
      * once training runs (two iteration lines seen), no new iteration for the run's own pace:
        max(`pace_floor_s`, `pace_multiple` x the median time per iteration x the iterations between its
        lines), at most `no_progress_s`; a line saying the run is busy (a checkpoint being saved, an evaluation,
        `a4ray: busy`) leaves only `no_progress_s` until it says it is done or the next iteration comes;
      * after the first iteration line and before the second, `no_progress_s`;
      * no output from any node for `no_output_s`.
    `clock` is for tests (monotonic seconds)."""

    def __init__(self, spec: WatchdogSpec, clock: Callable[[], float] = time.monotonic):
        self.spec = spec
        self.clock = clock
        self.started_at = self.last_output_at = clock()
        self.last_progress_at: float | None = None  # when the latest new iteration came, or a busy spell ended
        self.last_iteration: int | None = None
        self.busy: str | None = None  # the line that said the run is busy, until it is done
        self._resumed = False  # a busy spell ended since the latest iteration: the next gap is no sample of the pace
        self._per_iteration: deque[float] = deque(maxlen=_PACE_SAMPLES)  # seconds per iteration, line to line
        self._stride: deque[int] = deque(maxlen=_PACE_SAMPLES)  # iterations from one line to the next

    def output(self, lines: Iterable[str] = ()) -> None:
        now = self.last_output_at = self.clock()
        for text in lines:
            if _BUSY.search(text):
                self.busy = text.strip()[:120]
            elif _DONE.search(text) and self.busy is not None:
                self.busy = None
                self.last_progress_at, self._resumed = now, True  # the pace counts again from here

    def progress(self, iteration: int | None = None) -> None:
        """An iteration line (`iteration`: its number; several ranks print the same one)."""
        now = self.clock()
        if iteration is not None and self.last_iteration is not None:
            if iteration <= self.last_iteration:
                return
            if self.last_progress_at is not None and self.busy is None and not self._resumed:
                stride = iteration - self.last_iteration
                self._per_iteration.append((now - self.last_progress_at) / stride)
                self._stride.append(stride)
        self.last_iteration = iteration if iteration is not None else self.last_iteration
        self.last_progress_at = now
        self.busy, self._resumed = None, False

    def window(self) -> tuple[float | None, str]:
        """How long, from the latest iteration, the run may go without a new one; and what says so."""
        w = self.spec
        bound = (w.no_progress_s, f"observe.watchdog.no_progress_s={w.no_progress_s:g}") if w.no_progress_s \
            else (None, "")
        if self.busy is not None or not w.pace_multiple or not self._per_iteration:
            why = f"busy since {self.busy!r}; " if self.busy is not None else ""
            return bound[0], why + bound[1]
        per_iteration = statistics.median(self._per_iteration)
        stride = statistics.median(self._stride)
        pace = w.pace_multiple * per_iteration * stride
        limit = max(w.pace_floor_s, pace)
        if bound[0] is not None and bound[0] <= limit:
            return bound
        every = f" x {stride:g} iterations a line" if stride != 1 else ""
        said = (f"the run's pace: {w.pace_multiple:g} x its median {per_iteration:.3g}s per iteration{every}"
                + (f" ({pace:.0f}s), under observe.watchdog.pace_floor_s={w.pace_floor_s:g}" if pace < limit else ""))
        return limit, said

    def why(self, last_iteration: int | None = None) -> str | None:
        """Why the launch looks hung, or None."""
        w = self.spec
        if not w.enabled:
            return None
        now = self.clock()
        last = self.last_iteration if self.last_iteration is not None else last_iteration
        if self.last_progress_at is not None:
            limit, said = self.window()
            if limit is not None and now - self.last_progress_at > limit:
                return f"no new iteration for {now - self.last_progress_at:.0f}s (after iteration {last}; {said})"
        elif w.startup_s and now - self.started_at > w.startup_s:
            return f"no iteration line in the first {w.startup_s:g}s (observe.watchdog.startup_s)"
        if w.no_output_s and now - self.last_output_at > w.no_output_s:
            return f"no output from any node for {now - self.last_output_at:.0f}s (observe.watchdog.no_output_s)"
        return None


def report(why: str, actors: list, nodes: list[NodeRef], nproc: list[int], report_dir: Path, *, py_spy: bool,
           flight_recorder: bool, record_timeout_s: float) -> tuple[str, HangVerdict]:
    """Every rank's flight record and stack dump on every node, and what each node's NCCL RAS says (`actors`: the
    launch's node actors; `nodes`: who they are; `nproc`: each one's ranks), the stacks written to `report_dir`
    with `summary.txt`; returns the one-line stack summary and the verdict."""
    say(f"hang detected: {why}; collecting the flight records and stacks of every rank")
    report_dir.mkdir(parents=True, exist_ok=True)
    # Asked of every node at once: each answer is bounded on its node (RAS ~3 s, records `record_timeout_s`, py-spy
    # 30 s).
    asked = {"ras": [a.ras_status.remote() for a in actors]}
    if flight_recorder:
        asked["records"] = [a.flight_records.remote(record_timeout_s) for a in actors]
    if py_spy:
        asked["stacks"] = [a.stacks.remote() for a in actors]
    ray.wait([ref for refs in asked.values() for ref in refs], num_returns=sum(map(len, asked.values())),
             timeout=_STACKS_TIMEOUT_S)
    answers = {what: _answers(nodes, refs, what) for what, refs in asked.items()}
    records: dict[int, dict] = {}
    missing: dict[int, NoRecord] = {}
    by_rank = rank_nodes(nodes, nproc)
    for node, answer in zip(nodes, answers.get("records", [])):
        if answer is None:
            missing.update({r: NoRecord(reason="no answer from its node") for r, n in by_rank.items()
                            if n.node == node.node})
        for rank, record in (answer or {}).items():
            if isinstance(record, dict):
                records[int(rank)] = record
            else:
                missing[int(rank)] = record
    dumps: list[StackDump] = [d for answer in answers.get("stacks", []) for d in answer or []]
    findings, ras_line = ras.attribute([a for a in answers["ras"] if a is not None])
    for d in dumps:
        name = f"rank-{int(d.rank):04d}.txt" if d.rank.isdigit() else f"{d.rank.replace(':', '-')}.txt"
        (report_dir / name).write_text(d.text + (f"\n# py-spy error: {d.error}\n" if d.error else ""))
    summary = summarize(dumps) if dumps else "no stacks collected (observe.watchdog.py_spy is off)"
    verdict = judge(records, missing, dumps, nodes, nproc, findings)
    verdict.ras = ras_line
    (report_dir / "summary.txt").write_text(f"{why}\n{summary}\n{ras_line}\n{verdict.line()}\n")
    (report_dir / "verdict.json").write_text(verdict.model_dump_json(indent=2))
    say(f"stacks: {summary}")
    say(ras_line)
    say(f"hang verdict: {verdict.line()}")
    say(f"hang report: {report_dir}")
    return summary, verdict


def _answers(nodes: list[NodeRef], refs: list, what: str) -> list:
    """Each node's answer; a node that cannot answer in time gives None (and is named)."""
    answers = []
    for node, ref in zip(nodes, refs):
        try:
            answers.append(ray.get(ref, timeout=0))
        except Exception as e:  # noqa: BLE001 - a node that cannot answer is named, and is evidence of nothing
            say(f"  {node.describe()}: no answer for its {what} ({type(e).__name__})")
            answers.append(None)
    return answers


def rank_nodes(nodes: list[NodeRef], nproc: list[int]) -> dict[int, NodeRef]:
    """Global rank -> its node: a launch's ranks are numbered node by node (node i: sum(nproc[:i]) + local)."""
    out, first = {}, 0
    for node, n in zip(nodes, nproc):
        for local in range(n):
            out[first + local] = node
        first += n
    return out


def judge(records: dict[int, dict], missing: dict[int, NoRecord], dumps: list[StackDump], nodes: list[NodeRef],
          nproc: list[int], findings: dict[int, ras.Finding] | None = None) -> HangVerdict:
    """Who the hang waits for. A rank is named only on evidence about that rank:
      * its own flight record stops before collective #N that its group's other members entered;
      * its process is gone (it exited, or a signal ended it: `missing[rank].evidence`);
      * NCCL's RAS calls it dead, or behind its communicator's operation counts (`findings`, by global rank);
      * its stack is outside any collective while other members of its group are inside one.
    A rank that gave no record and no stack (`missing`: why) is evidence of nothing: a rank only slow to answer,
    or frozen inside the collective, is silent as the culprit is. Where the ranks that answered wait in a
    collective that some rank never joined and nothing says which, the verdict is undetermined and names the
    candidates, each with why it gave no evidence."""
    by_rank = rank_nodes(nodes, nproc)
    world = sorted(by_rank)
    if not world:
        return HangVerdict(note="not a launch of ranks (no torchrun ranks to compare)")
    findings = findings or {}
    stacks = {int(d.rank): d for d in dumps if d.rank.isdigit() and int(d.rank) in by_rank}
    inside = sorted(r for r, d in stacks.items() if _inside(d))
    outside = sorted(r for r, d in stacks.items() if _known(d) and not _inside(d))
    named: dict[int, Culprit] = {}
    evidence: list[str] = []
    notes: list[str] = []

    def name(ranks: list[int], where: Callable[[int], str], why: str, said: str | None) -> None:
        """Name `ranks` on `why`; `said`: the evidence line ("{}": the ranks), None where one says it already."""
        ranks = [r for r in ranks if r not in named]
        for r in ranks:
            named[r] = Culprit(rank=r, node=by_rank[r], where=where(r), why=why)
        if ranks and said:
            evidence.append(said.format(ranges(ranks)))

    def at(r: int) -> str:
        return stacks[r].where if r in stacks and _known(stacks[r]) else ""

    def verdict(**fields) -> HangVerdict:
        return HangVerdict(culprits=sorted(named.values(), key=lambda c: c.rank), evidence=evidence,
                           note="; ".join(n for n in notes if n), **fields)

    if records:
        evidence.append(f"flight recorder of rank(s) {ranges(sorted(records))}")
        m = flight.match(records, world)
        members = [r for r in m.members if r in by_rank] or world
        _gone_and_ras(name, missing, findings, members)
        if m.collective is None:
            notes.append(m.note)
            return verdict(analyzer=m.analyzer, waiting=inside)
        name(m.never_joined, at, f"its flight record stops before #{m.collective.seq}", None)
        silent = [r for r in members if r not in records and r not in named]
        if set(m.waiting) | (set(inside) & set(members)):  # others are inside: a silent rank outside is the one
            name([r for r in silent if r in outside], at, "its stack is outside any collective",
                 "stacks of rank(s) {}")
        undecided = [r for r in silent if r not in named]
        notes.append(m.note)
        for r in m.never_joined:
            if r in inside:
                notes.append(f"rank {r} waits in a different collective than #{m.collective.seq} (a desync)")
        fields = {"collective": m.collective, "waiting": m.waiting, "analyzer": m.analyzer}
    else:
        _gone_and_ras(name, missing, findings, world)
        if not stacks and not named:
            why = "; ".join(sorted({m.line() for m in missing.values()})) or "the flight recorder is off"
            notes.append(f"no flight record ({why}) and no stacks")
            return verdict()
        if stacks:
            why = "; ".join(sorted({m.line() for m in missing.values()})) or "the flight recorder is off"
            evidence.insert(0, f"stacks of rank(s) {ranges(sorted(stacks))} (no flight record: {why})")
        if inside:
            name(outside, at, "its stack is outside any collective", None)
        elif stacks and not named:
            notes.append("no rank is inside a collective: the hang is not a collective's")
            return verdict()
        undecided = [r for r in world if r not in named and r not in inside and r not in outside]
        fields = {"waiting": inside}
    if named:
        if undecided:
            whys = sorted({missing[r].reason for r in undecided if r in missing}) or ["no record"]
            notes.append(f"rank(s) {ranges(undecided)} not judged: no evidence either way ({', '.join(whys)})")
        return verdict(**fields)
    if undecided:
        return verdict(undetermined=True, candidates=[_candidate(r, by_rank, missing, stacks, findings)
                                                      for r in undecided], **fields)
    where = f"#{fields['collective'].seq}" if fields.get("collective") else "a collective"
    notes.append(f"every member of the group is inside {where}: a desync or the fabric, not one rank")
    return verdict(**fields)


def _gone_and_ras(name, missing: dict[int, NoRecord], findings: dict[int, ras.Finding], ranks: list[int]) -> None:
    """Evidence that holds with or without records: a rank's process gone, NCCL's RAS on a rank."""
    name(sorted(r for r in ranks if r in missing and missing[r].evidence), lambda r: "exited",
         "its process is gone", "exit of rank(s) {}")
    name(sorted(r for r in ranks if r in findings and findings[r].evidence), lambda r: findings[r].detail,
         "NCCL RAS", "NCCL RAS on rank(s) {}")


def _candidate(rank: int, by_rank: dict[int, NodeRef], missing: dict[int, NoRecord], stacks: dict[int, StackDump],
               findings: dict[int, ras.Finding]) -> Candidate:
    parts = [f"no flight record: {missing[rank].line()}" if rank in missing else "no flight record"]
    d = stacks.get(rank)
    if d is not None and _inside(d):
        parts.append(f"its stack ({d.where}) is inside a collective, which says it entered one, not which")
    elif d is not None and d.error:
        parts.append(f"no stack ({d.error})")
    elif d is None:
        parts.append("no stack")
    if rank in findings:
        parts.append(f"NCCL RAS: {findings[rank].detail} (not evidence)")
    return Candidate(rank=rank, node=by_rank[rank], why="; ".join(parts))


_STOPPED = "a stopped process (state T) in "


def _inside(d: StackDump) -> bool:
    """Its main thread is in a collective, running or stopped there (a rank frozen inside the collective
    entered it)."""
    return d.model_copy(update={"stopped": False, "where": d.where.removeprefix(_STOPPED)}).in_collective


def _known(d: StackDump) -> bool:
    """The stack says where the rank is."""
    place = d.where.removeprefix(_STOPPED)
    return bool(place) and not place.startswith(("unknown", "a stopped process"))
