"""Hangs, on the driver's side: the watchdog that decides a launch is hung, the report of where every rank
was when it did (each node's flight records, stacks and NCCL RAS's word, from `flight.py`, `stacks.py` and
`ras.py` through its node actor, and a summary), and the verdict: which rank, on which node, the hang waits for,
named only on evidence about that rank.

The supervisor feeds the watchdog what it streams (output, iteration lines) and asks it every second.
"""

from __future__ import annotations

import pickle
import re
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import ray

from a4ray.core.console import say
from a4ray.observe import flight, ras
from a4ray.observe.flight import NoRecord
from a4ray.observe.stacks import StackDump, ranges, summarize
from a4ray.observe.verdicts import Candidate, Collective, Culprit, DesyncSide, EndedRank, HangVerdict, NodeRef
from a4ray.spec.resilience import WatchdogSpec

_STACKS_TIMEOUT_S = 120
# Lines that say a run is busy between iterations, so its pace does not apply until it says it is done (or the
# next iteration comes): Megatron-LM's checkpoint save and evaluation (checkpointing.py's "saving checkpoint at
# iteration", training.py's "Evaluating on"/"Evaluating iter"), and any program's own `a4ray: busy ...` line.
_BUSY = re.compile(r"saving checkpoint at iteration|\bEvaluating (on|iter)\b|\ba4ray(\.\w+)?: busy\b", re.IGNORECASE)
# ... and the lines that say it is done: Megatron-LM's "successfully saved checkpoint", "validation loss at",
# a4ray's trainer's "saved checkpoint iteration", `a4ray: done ...`.
_DONE = re.compile(r"successfully saved checkpoint|validation loss at|\bsaved checkpoint iteration\b|"
                   r"\ba4ray(\.\w+)?: done\b", re.IGNORECASE)
_BUSY_HINTS = ("checkpoint", "valuat", "validation loss", "a4ray")  # in every line _BUSY or _DONE matches
_PACE_SAMPLES = 50  # the median of the latest gaps between iteration lines


class Alarm(NamedTuple):
    """What the watchdog saw: `why` in words; `window_s`, the quiet time that raised it; `bound`: an upper bound
    (`no_progress_s`), after which the launch ends whatever an inspection finds. Any other alarm is a suspicion:
    it starts an inspection, and the launch ends only on evidence of a collective that cannot complete."""

    why: str
    window_s: float | None  # None: a look (`look_after_s`), which settles only an ended rank or a desync
    bound: bool = False


class Watchdog:
    """When a launch looks hung (observe.watchdog, `WatchdogSpec.rule()` says it in words):
      * no iteration line in the first `startup_s`;
      * once training runs (two iteration lines seen), no new iteration for the run's own pace:
        max(`pace_floor_s`, `pace_multiple` x the median time per iteration x the iterations between its
        lines); a line saying the run is busy (a checkpoint being saved, an evaluation, `a4ray: busy`) leaves only
        `no_progress_s` until it says it is done or the next iteration comes;
      * no news from any node for `no_output_s`: a line held back as a repeat, or torch's own heartbeat and
        TCPStore warnings (which a blocked rank prints every second), is no news;
    each a suspicion; and the upper bound, no new iteration for `no_progress_s`. After an inspection that found
    no hang (`rearm`), each suspicion counts its window again from then. `clock` is for tests (monotonic seconds)."""

    def __init__(self, spec: WatchdogSpec, clock: Callable[[], float] = time.monotonic):
        self.spec = spec
        self.clock = clock
        self.started_at = self.last_output_at = clock()
        self.last_progress_at: float | None = None  # when the latest new iteration came, or a busy spell ended
        self.last_iteration: int | None = None
        self.rearmed_at: float | None = None  # the latest inspection that found every rank computing
        self.looked_at: float | None = None  # the latest look of a quiet spell (`look_after_s`)
        self.finishing = False  # the final iteration has come: no pace (saves, exits and evaluations follow)
        self.busy: str | None = None  # the line that said the run is busy, until it is done
        self._resumed = False  # a busy spell ended since the latest iteration: the next gap is no sample of the pace
        self._per_iteration: deque[float] = deque(maxlen=_PACE_SAMPLES)  # seconds per iteration, line to line
        self._stride: deque[int] = deque(maxlen=_PACE_SAMPLES)  # iterations from one line to the next

    def output(self, lines: Iterable[str] = (), news: bool = True) -> None:
        """Lines from the nodes; `news`: some of them say something new (not only repeats and torch's noise)."""
        now = self.clock()
        if news:
            self.last_output_at = now
        for text in lines:
            lowered = text.lower()
            if not any(hint in lowered for hint in _BUSY_HINTS):  # a substring test first: most lines are neither
                continue
            if _BUSY.search(text):
                self.busy = text.strip()[:120]
            elif _DONE.search(text) and self.busy is not None:
                self.busy = None
                self.last_progress_at, self._resumed = now, True  # the pace counts again from here

    def progress(self, iteration: int | None = None, last: bool = False) -> None:
        """An iteration line (`iteration`: its number; several ranks print the same one; `last`: the run's final
        iteration: the ranks are finishing, and their pace no longer says anything)."""
        now = self.clock()
        self.finishing = self.finishing or last
        if iteration is not None and self.last_iteration is not None:
            if iteration <= self.last_iteration:
                return
            if self.last_progress_at is not None and self.busy is None and not self._resumed:
                stride = iteration - self.last_iteration
                self._per_iteration.append((now - self.last_progress_at) / stride)
                self._stride.append(stride)
        self.last_iteration = iteration if iteration is not None else self.last_iteration
        self.last_progress_at = self.last_output_at = now
        self.busy, self._resumed = None, False

    def rearm(self) -> None:
        """An inspection found no hang: every suspicion waits a whole window again from now."""
        self.rearmed_at = self.clock()

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

    def alarm(self, last_iteration: int | None = None) -> Alarm | None:
        """What makes the launch look hung now, or None."""
        w = self.spec
        if not w.enabled:
            return None
        now = self.clock()
        last = self.last_iteration if self.last_iteration is not None else last_iteration

        def quiet(since: float) -> float:  # how long a suspicion's window has run
            return now - max(since, self.rearmed_at or since)

        if self.last_progress_at is not None:
            stalled = now - self.last_progress_at
            if w.no_progress_s and stalled > w.no_progress_s:
                return Alarm(f"no new iteration for {stalled:.0f}s (after iteration {last}; "
                             f"observe.watchdog.no_progress_s={w.no_progress_s:g}, the upper bound)", w.no_progress_s,
                             bound=True)
            limit, said = self.window()
            if limit is not None and limit != w.no_progress_s and quiet(self.last_progress_at) > limit and \
                    not self.finishing:
                return Alarm(f"no new iteration for {stalled:.0f}s (after iteration {last}; {said})", limit)
        elif w.startup_s and quiet(self.started_at) > w.startup_s:
            return Alarm(f"no iteration line in the first {now - self.started_at:.0f}s (observe.watchdog.startup_s="
                         f"{w.startup_s:g})", w.startup_s)
        if w.no_output_s and self.busy is None and quiet(self.last_output_at) > w.no_output_s:
            return Alarm(f"no news from any node for {now - self.last_output_at:.0f}s (observe.watchdog.no_output_s="
                         f"{w.no_output_s:g})", w.no_output_s)
        if w.look_after_s and self.busy is None and now - self.last_output_at > w.look_after_s and \
                (self.looked_at is None or self.looked_at < self.last_output_at):
            self.looked_at = now
            return Alarm(f"no news from any node for {now - self.last_output_at:.0f}s (observe.watchdog.look_after_s="
                         f"{w.look_after_s:g})", None)
        return None


@dataclass
class Evidence:
    """What every node said when asked where its ranks are: flight records (or why none), stacks, NCCL RAS."""

    records: dict[int, dict] = field(default_factory=dict)
    missing: dict[int, NoRecord] = field(default_factory=dict)
    dumps: list[StackDump] = field(default_factory=list)
    findings: dict[int, ras.Finding] = field(default_factory=dict)
    ras_line: str = ""

    @property
    def summary(self) -> str:
        return summarize(self.dumps) if self.dumps else "no stacks (no rank processes, or observe.watchdog.py_spy is off)"


def collect(actors: list, nodes: list[NodeRef], nproc: list[int], *, py_spy: bool, flight_recorder: bool,
            record_timeout_s: float) -> Evidence:
    """Every rank's flight record and stack dump on every node, and what each node's NCCL RAS says (`actors`: the
    launch's node actors; `nodes`: who they are; `nproc`: each one's ranks). Asked of every node at once: each
    answer is bounded on its node (RAS ~3 s, records `record_timeout_s`, py-spy 30 s)."""
    asked = {"ras": [a.ras_status.remote() for a in actors]}
    if flight_recorder:
        asked["records"] = [a.flight_records.remote(record_timeout_s) for a in actors]
    if py_spy:
        asked["stacks"] = [a.stacks.remote() for a in actors]
    ray.wait([ref for refs in asked.values() for ref in refs], num_returns=sum(map(len, asked.values())),
             timeout=_STACKS_TIMEOUT_S)
    answers = {what: _answers(nodes, refs, what) for what, refs in asked.items()}
    evidence = Evidence()
    by_rank = rank_nodes(nodes, nproc)
    for node, answer in zip(nodes, answers.get("records", [])):
        if answer is None:
            evidence.missing.update({r: NoRecord(reason="no answer from its node") for r, n in by_rank.items()
                                     if n.node == node.node})
        for rank, record in (answer or {}).items():
            if isinstance(record, dict):
                evidence.records[int(rank)] = record
            else:
                evidence.missing[int(rank)] = record
    evidence.dumps = [d for answer in answers.get("stacks", []) for d in answer or []]
    evidence.findings, evidence.ras_line = ras.attribute([a for a in answers["ras"] if a is not None])
    return evidence


def write_report(why: str, evidence: Evidence, verdict: HangVerdict, report_dir: Path) -> None:
    """The hang report: every rank's stack (`rank-0003.txt`, a helper's `r1-pid123.txt`), `summary.txt`,
    `verdict.json`; what torch's flight-recorder analyzer makes of the records follows (`write_analysis`)."""
    report_dir.mkdir(parents=True, exist_ok=True)
    for d in evidence.dumps:
        name = f"rank-{int(d.rank):04d}.txt" if d.rank.isdigit() else f"{d.rank.replace(':', '-')}.txt"
        (report_dir / name).write_text(d.text + (f"\n# py-spy error: {d.error}\n" if d.error else ""))
    (report_dir / "summary.txt").write_text(f"{why}\n{evidence.summary}\n{evidence.ras_line}\n{verdict.line()}\n")
    (report_dir / "verdict.json").write_text(verdict.model_dump_json(indent=2))


def write_analysis(records: dict[int, dict], report_dir: Path) -> None:
    """`analyzer.txt` in the hang report: what torch's own flight-recorder analyzer says of the records. In a child
    process, after the verdict: it imports torch (seconds), prints its findings raw through a logger of its own
    bound to the process's stderr, and none of that belongs in the driver or its stream."""
    if not records:
        return
    report_dir.mkdir(parents=True, exist_ok=True)
    kept = report_dir / "records.pickle"
    kept.write_bytes(pickle.dumps(records))
    with open(report_dir / "analyzer.txt", "w") as out:
        try:
            subprocess.run([sys.executable, "-c", _ANALYZE, str(kept)], stdout=out, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, timeout=_ANALYZER_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            out.write(f"\ntorch's analyzer did not finish in {_ANALYZER_TIMEOUT_S}s\n")


_ANALYZE = ("import pickle, sys\nfrom a4ray.observe.flight import analyze\n"
            "note, printed = analyze(pickle.loads(open(sys.argv[1], 'rb').read()))\nprint(note)\nprint(printed)")
_ANALYZER_TIMEOUT_S = 120


def inspect(actors: list, nodes: list[NodeRef], nproc: list[int], ended: dict[int, tuple[int, float]], *,
            py_spy: bool, flight_recorder: bool, record_timeout_s: float) -> tuple[Evidence, HangVerdict]:
    """Where every rank is, and the verdict on it (`ended`: global rank -> (exit code, when) of the ranks that have
    ended while the launch runs)."""
    evidence = collect(actors, nodes, nproc, py_spy=py_spy, flight_recorder=flight_recorder,
                       record_timeout_s=record_timeout_s)
    verdict = judge(evidence.records, evidence.missing, evidence.dumps, nodes, nproc, evidence.findings, ended)
    verdict.ras = evidence.ras_line
    return evidence, verdict


HINTS = {
    "hang": "a rank that never joins a collective: its stack and record say where it is",
    "ended": "a rank ran out of work before its peers (fewer batches, an early return or exit): give every rank the "
             "same number of steps (DistributedSampler with drop_last, an even split), or let ranks finish unevenly "
             "with DDP's join() (torch.distributed.algorithms.Join)",
    "desync": "the ranks called different collectives at the same point: look for a collective under a rank-dependent "
              "branch or shapes that differ by rank; rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL, which makes torch "
              "check every collective's op and shapes across ranks and fail naming them",
}


def picture(verdict: HangVerdict) -> tuple:
    """What a look saw, to compare with the next: the same ranks waiting in the same place, the same culprits."""
    where = (verdict.collective.group, verdict.collective.seq) if verdict.collective else verdict.waiting_in
    return verdict.kind, where, tuple(verdict.waiting), tuple(c.rank for c in verdict.culprits), verdict.undetermined


def settled(verdict: HangVerdict, window_s: float | None, seen_before: bool) -> str | None:
    """Why a verdict shows a collective that cannot complete, or None (a suspicion is not a verdict):
      * a rank ended, or left (its process is gone), while its peers wait for it; a desync;
      * ranks have waited in the collective a whole window (their flight records say since when);
      * the same ranks wait in the same place as at the previous look (`seen_before`)."""
    if verdict.kind == "ended":
        return "a rank ended while its peers wait for it"
    if verdict.kind == "desync":
        return "the ranks called different collectives"
    if not verdict.waiting:  # a rank gone while nobody waits is a rank that finished: no hang of a collective
        return None
    if any(c.why == "its process is gone" for c in verdict.culprits):
        return "a rank's process is gone while its peers wait in a collective"
    if window_s is None:
        return None
    if verdict.waiting_since is not None and time.time() - verdict.waiting_since >= window_s:
        return f"ranks have waited in the collective for {time.time() - verdict.waiting_since:.0f}s"
    return "the same ranks still wait in the same place" if seen_before else None


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
          nproc: list[int], findings: dict[int, ras.Finding] | None = None,
          ended: dict[int, tuple[int, float]] | None = None) -> HangVerdict:
    """Who the hang waits for. First what makes a collective impossible whoever else is slow:
      * a desync: ranks entered different collectives (op, dtype or size) at one sequence number of a group (their
        flight records; without records, their stacks inside different collectives). The minority is named; where
        no side is, both are and no one is blamed;
      * a rank that ended (`ended`: global rank -> (exit code, when)) while live ranks wait inside a collective of
        a group that holds it, which its record (left at its exit) shows it never joined.
    Otherwise a rank is named only on evidence about that rank:
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
    ended = {r: e for r, e in (ended or {}).items() if r in by_rank}
    # A rank that left its record at exit, not among those seen to end well: its process is gone (it failed).
    missing = {**missing, **{r: NoRecord(reason="process gone", detail="it left its record as it exited")
                             for r, record in records.items() if record.get(flight.ENDED) and r not in ended}}
    stacks = {int(d.rank): d for d in dumps if d.rank.isdigit() and int(d.rank) in by_rank and int(d.rank) not in ended}
    inside = sorted(r for r, d in stacks.items() if _inside(d))
    outside = sorted(r for r, d in stacks.items() if _known(d) and not _inside(d))
    named: dict[int, Culprit] = {}
    evidence: list[str] = []
    notes: list[str] = []
    m = flight.match(records, world) if records else None

    def name(ranks: list[int], where: Callable[[int], str], why: str, said: str | None) -> None:
        """Name `ranks` on `why`; `said`: the evidence line ("{}": the ranks), None where one says it already."""
        ranks = [r for r in ranks if r not in named]
        for r in ranks:
            named[r] = Culprit(rank=r, node=by_rank[r], where=where(r), why=why)
        if ranks and said:
            evidence.append(said.format(ranges(ranks)))

    def at(r: int) -> str:
        return stacks[r].where if r in stacks and _known(stacks[r]) else ""

    def ended_ranks() -> list[EndedRank]:
        group = m.collective.group if m and m.collective else "0"
        return [ended_rank(r, by_rank[r], code, when, records.get(r), group) for r, (code, when) in sorted(ended.items())]

    def verdict(**fields) -> HangVerdict:
        return HangVerdict(culprits=sorted(named.values(), key=lambda c: c.rank), evidence=evidence,
                           note="; ".join(n for n in notes if n), ended=ended_ranks(), **fields)

    if records:
        evidence.append(f"flight recorder of rank(s) {ranges(sorted(records))}")
    if m is not None and m.sides:  # a desync
        sides = m.sides
        if all(len(sides[0].ranks) < len(side.ranks) for side in sides[1:]):
            name(sides[0].ranks, lambda r: sides[0].call, f"it called {sides[0].call} where its group's others did "
                 "not", None)
        return verdict(kind="desync", sides=sides, collective=m.collective, waiting=m.waiting,
                       waiting_since=m.waiting_since, analyzer=m.analyzer)
    if m is None or m.collective is None:
        calls: dict[str, list[int]] = {}
        for r in inside:  # without records, the stacks: ranks inside different collectives
            op = stacks[r].where.removeprefix(_STOPPED).split(" ", 1)[0]
            if op not in _UNSPECIFIC:
                calls.setdefault(op, []).append(r)
        if len(calls) > 1:
            evidence.insert(0, f"stacks of rank(s) {ranges(sorted(stacks))}")
            sides = sorted((DesyncSide(ranks=ranks, call=op) for op, ranks in calls.items()),
                           key=lambda side: (len(side.ranks), side.ranks))
            if all(len(sides[0].ranks) < len(side.ranks) for side in sides[1:]):
                name(sides[0].ranks, lambda r: sides[0].call, f"its stack is in {sides[0].call} where its group's "
                     "others are not", None)
            return verdict(kind="desync", sides=sides, waiting=inside)
    if ended:  # a rank that ended, and others that went on into a collective of its group that it never joined
        group = m.collective.group if m is not None and m.collective is not None else "0"
        members = m.members if m is not None and m.collective is not None and m.members_known else world
        joined = {r: _entered(records.get(r), group) for r in records}
        waiting = set(m.waiting if m is not None and m.collective is not None else []) | set(inside)
        left = []
        for r in sorted(ended):
            if r not in members:
                continue
            mine = joined.get(r)  # None: no record of what it did last
            # Who went on without it: live ranks waiting (in a later collective than it entered, where records
            # say), and ranks whose records entered a later one, which failed or left since (its echo).
            beyond = {o for o, seq in joined.items() if o not in ended and mine is not None and seq > mine}
            if (waiting - set(ended) and (mine is None or not (waiting & set(joined)) or waiting & beyond)) or beyond:
                left.append(r)
                waiting |= beyond
        if left:
            seq = min(joined.get(r) or 0 for r in left) + 1
            collective = _collective_at(records, group, seq) or (m.collective if m is not None else None)
            name(left, lambda r: f"ended with exit {ended[r][0]}", "it ended while its peers went on into a "
                 "collective with it", "end of rank(s) {}")
            return verdict(kind="ended", collective=collective, waiting=sorted(waiting - set(ended)),
                           waiting_in=stacks[inside[0]].where if inside and collective is None else "",
                           waiting_since=m.waiting_since if m is not None else None,
                           analyzer=m.analyzer if m is not None else "")
    if m is not None:
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
        fields = {"collective": m.collective, "waiting": m.waiting, "analyzer": m.analyzer,
                  "waiting_since": m.waiting_since}
    else:
        _gone_and_ras(name, missing, findings, world)
        told = sorted(set(inside) | set(outside))  # stacks that say where a rank is (not py-spy's errors)
        if not told and not named:
            why = "; ".join(sorted({m.line() for m in missing.values()})) or "the flight recorder is off"
            errors = sorted({d.error for d in stacks.values() if d.error})
            notes.append(f"no flight record ({why}) and no stacks" + (f" ({'; '.join(errors)})" if errors else ""))
            return verdict()
        if told:
            why = "; ".join(sorted({m.line() for m in missing.values()})) or "the flight recorder is off"
            evidence.insert(0, f"stacks of rank(s) {ranges(told)} (no flight record: {why})")
        if inside:
            name(outside, at, "its stack is outside any collective", None)
        elif told and not named:
            notes.append("no rank is inside a collective: the hang is not a collective's")
            return verdict()
        undecided = [r for r in world if r not in named and r not in inside and r not in outside and r not in ended]
        fields = {"waiting": inside, "waiting_in": stacks[inside[0]].where if inside else ""}
    if named:
        if undecided:
            whys = sorted({missing[r].reason for r in undecided if r in missing}) or ["no record"]
            notes.append(f"rank(s) {ranges(undecided)} not judged: no evidence either way ({', '.join(whys)})")
        return verdict(**fields)
    if undecided:
        return verdict(undetermined=True, candidates=[_candidate(r, by_rank, missing, stacks, findings)
                                                      for r in undecided], **fields)
    where = f"#{fields['collective'].seq}" if fields.get("collective") else "a collective"
    notes.append(f"every member of the group is inside {where}: the fabric, or a rank frozen there, not one rank")
    return verdict(**fields)


# Frames that say a rank waits, not which collective it called: no side of a desync.
_UNSPECIFIC = {"wait", "synchronize", "_wait_for_workers", "_coalescing_manager"}


def _entered(record: dict | None, group: str) -> int:
    """The last collective_seq_id a rank's record shows it entered in `group` (0: none, or no record)."""
    if not record:
        return 0
    seqs = [e.get("collective_seq_id") or 0 for e in record.get("entries") or []
            if str((e.get("process_group") or [e.get("pg_id", "0")])[0]) == group and not e.get("is_p2p")]
    return max(seqs + [flight.last_enqueued(record, group)])


def _collective_at(records: dict[int, dict], group: str, seq: int) -> Collective | None:
    """Collective #`seq` of `group` as any rank's record shows it."""
    for record in records.values():
        for e in record.get("entries") or []:
            if e.get("collective_seq_id") == seq and not e.get("is_p2p") and \
                    str((e.get("process_group") or [e.get("pg_id", "0")])[0]) == group:
                return flight.collective(e)
    return None


def ended_rank(rank: int, node: NodeRef, code: int, at: float, record: dict | None, group: str = "0") -> EndedRank:
    """A rank that ended while others of its launch ran, with the last collective of `group` its record (left at
    exit) shows it completed."""
    return EndedRank(rank=rank, node=node, exit_code=code, at=at, last=last_done(record, group))


def last_done(record: dict | None, group: str) -> Collective | None:
    """The last collective of `group` a rank's record shows completed."""
    if not record:
        return None
    done = [e for e in record.get("entries") or [] if not e.get("is_p2p") and e.get("collective_seq_id")
            and str((e.get("process_group") or [e.get("pg_id", "0")])[0]) == group and flight.done(e, record)]
    if not done:
        return None
    return flight.collective(max(done, key=lambda e: e["collective_seq_id"]))


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
