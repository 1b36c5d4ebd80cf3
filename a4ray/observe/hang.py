"""Hangs, on the driver's side: the watchdog that decides a launch is hung, the report of where every rank
was when it did (each node's flight records and stacks, from `flight.py` and `stacks.py` through its node
actor, and a summary), and the verdict: which rank, on which node, the hang waits for.

The supervisor feeds the watchdog what it streams (output, iteration lines) and asks it every second.
"""

from __future__ import annotations

import time
from pathlib import Path

import ray

from a4ray.core.console import say
from a4ray.observe import flight
from a4ray.observe.stacks import StackDump, ranges, summarize
from a4ray.observe.verdicts import Culprit, HangVerdict, NodeRef
from a4ray.spec.resilience import WatchdogSpec

_STACKS_TIMEOUT_S = 120


class Watchdog:
    """A hang is no new iteration for `no_progress_s` once training has started, no iteration line in the
    first `startup_s`, or no output from any node for `no_output_s` (observe.watchdog)."""

    def __init__(self, spec: WatchdogSpec):
        self.spec = spec
        self.started_at = self.last_output_at = time.monotonic()
        self.last_progress_at: float | None = None

    def output(self) -> None:
        self.last_output_at = time.monotonic()

    def progress(self) -> None:
        self.last_progress_at = time.monotonic()

    def why(self, last_iteration: int | None) -> str | None:
        """Why the launch looks hung, or None."""
        w = self.spec
        if not w.enabled:
            return None
        now = time.monotonic()
        if self.last_progress_at is not None:
            if w.no_progress_s and now - self.last_progress_at > w.no_progress_s:
                return (f"no new iteration for {now - self.last_progress_at:.0f}s (after iteration "
                        f"{last_iteration}; observe.watchdog.no_progress_s={w.no_progress_s:g})")
        elif w.startup_s and now - self.started_at > w.startup_s:
            return f"no iteration line in the first {w.startup_s:g}s (observe.watchdog.startup_s)"
        if w.no_output_s and now - self.last_output_at > w.no_output_s:
            return f"no output from any node for {now - self.last_output_at:.0f}s (observe.watchdog.no_output_s)"
        return None


def report(why: str, actors: list, nodes: list[NodeRef], nproc: list[int], report_dir: Path, *, py_spy: bool,
           flight_recorder: bool) -> tuple[str, HangVerdict]:
    """Every rank's flight record and stack dump on every node (`actors`: the launch's node actors; `nodes`:
    who they are; `nproc`: each one's ranks), the stacks written to `report_dir` with `summary.txt`; returns
    the one-line stack summary and the verdict."""
    say(f"hang detected: {why}; collecting the flight records and stacks of every rank")
    report_dir.mkdir(parents=True, exist_ok=True)
    records: dict[int, dict] = {}
    unanswered: dict[int, str] = {}
    if flight_recorder:
        for answer in _ask(actors, nodes, lambda a: a.flight_records.remote()):
            for rank, record in (answer or {}).items():
                if isinstance(record, dict):
                    records[int(rank)] = record
                else:
                    unanswered[int(rank)] = record
    dumps: list[StackDump] = []
    if py_spy:
        for answer in _ask(actors, nodes, lambda a: a.stacks.remote()):
            dumps += answer or []
    for d in dumps:
        name = f"rank-{int(d.rank):04d}.txt" if d.rank.isdigit() else f"{d.rank.replace(':', '-')}.txt"
        (report_dir / name).write_text(d.text + (f"\n# py-spy error: {d.error}\n" if d.error else ""))
    summary = summarize(dumps) if dumps else "no stacks collected (observe.watchdog.py_spy is off)"
    verdict = judge(records, unanswered, dumps, nodes, nproc)
    (report_dir / "summary.txt").write_text(f"{why}\n{summary}\n{verdict.line()}\n")
    (report_dir / "verdict.json").write_text(verdict.model_dump_json(indent=2))
    say(f"stacks: {summary}")
    say(f"hang verdict: {verdict.line()}")
    say(f"hang report: {report_dir}")
    return summary, verdict


def _ask(actors: list, nodes: list[NodeRef], call) -> list:
    """`call(actor)` on every node at once, bounded; a node that cannot answer gives None (and is named)."""
    refs = [call(actor) for actor in actors]
    ray.wait(refs, num_returns=len(refs), timeout=_STACKS_TIMEOUT_S)
    answers = []
    for node, ref in zip(nodes, refs):
        try:
            answers.append(ray.get(ref, timeout=0))
        except Exception as e:  # noqa: BLE001 - a node that cannot answer is named, and is evidence of nothing
            say(f"  {node.describe()}: no answer ({type(e).__name__})")
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


def judge(records: dict[int, dict], unanswered: dict[int, str], dumps: list[StackDump], nodes: list[NodeRef],
          nproc: list[int]) -> HangVerdict:
    """Who the hang waits for, from the flight records where there are some, else from the stacks. A rank is
    named only on evidence: it never entered the collective the others wait in (its record), it is not inside
    a collective while the others are (its stack), or, with no record or stack of its own, every other member
    of the group waits for it inside the stuck collective."""
    by_rank = rank_nodes(nodes, nproc)
    world = sorted(by_rank)
    if not world:
        return HangVerdict(note="not a launch of ranks (no torchrun ranks to compare)")
    stacks = {int(d.rank): d for d in dumps if d.rank.isdigit()}
    running = [r for r, d in stacks.items() if d.in_collective]
    elsewhere = [r for r, d in stacks.items() if d.where and not d.in_collective]

    def culprit(rank: int, fallback: str) -> Culprit:
        d = stacks.get(rank)
        return Culprit(rank=rank, node=by_rank[rank], where=(d.where if d and d.where else fallback))

    if records:
        m = flight.match(records, world)
        evidence = [f"flight recorder of rank(s) {ranges(sorted(records))}"]
        if m.collective is None:
            return HangVerdict(evidence=evidence, analyzer=m.analyzer, waiting=running, note=m.note)
        named = [culprit(r, "") for r in m.never_joined]
        notes = [m.note] if m.note else []
        silent = [r for r in m.missing if r in by_rank]
        if silent:
            # No record of their own: their stacks decide; with no stack either, the whole group waiting
            # for them inside the collective does.
            off = [r for r in silent if r in elsewhere]
            unknown = [r for r in silent if r not in stacks or not stacks[r].where]
            named += [culprit(r, "") for r in off]
            if off:
                evidence.append(f"stacks of rank(s) {ranges(off)}")
            answered = set(records) & set(m.members)
            if unknown and m.members_known and not m.never_joined and not off and set(m.waiting) >= answered:
                named += [culprit(r, "did not answer") for r in unknown]
                notes.append(f"rank(s) {ranges(unknown)} answered neither flight record nor stack dump, while "
                             f"every other member waits inside the collective")
            elif unknown:
                notes.append(f"rank(s) {ranges(unknown)} gave no record and no stack: not judged")
            inside = [r for r in silent if r in running]
            if inside:
                notes.append(f"rank(s) {ranges(inside)} gave no record but their stacks are in a collective")
        if not named:
            notes.append(f"every member of the group with a record or stack is inside #{m.collective.seq} or "
                         "unjudged: a desync or the fabric, not one rank")
        for r in m.never_joined:
            if r in running:
                notes.append(f"rank {r} waits in a different collective than #{m.collective.seq} (a desync)")
        return HangVerdict(collective=m.collective, culprits=sorted(named, key=lambda c: c.rank), waiting=m.waiting,
                           evidence=evidence, analyzer=m.analyzer, note="; ".join(notes))
    if not stacks:
        why = "; ".join(sorted(set(unanswered.values()))) or "no flight record"
        return HangVerdict(note=f"no flight record ({why}) and no stacks")
    evidence = [f"stacks of rank(s) {ranges(sorted(stacks))} (no flight record: "
                f"{'; '.join(sorted(set(unanswered.values()))) or 'the flight recorder is off'})"]
    missing = [r for r in world if r not in stacks or not stacks[r].where]
    note = f"rank(s) {ranges(missing)} gave no stack: not judged" if missing else ""
    if running and elsewhere:
        return HangVerdict(culprits=[culprit(r, "") for r in sorted(elsewhere)], waiting=sorted(running),
                           evidence=evidence, note=note)
    if running:
        return HangVerdict(waiting=sorted(running), evidence=evidence,
                           note="every rank with a stack is inside a collective: a desync or the fabric, "
                           "not one rank" + (f"; {note}" if note else ""))
    return HangVerdict(evidence=evidence, note="no rank is inside a collective: the hang is not a collective's"
                       + (f"; {note}" if note else ""))
