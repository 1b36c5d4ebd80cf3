"""Goodput: where a run's wall time went, and what a failure cost; and Meta's ETTR model of what that means at scale.

A run's wall time (the attempt loop's start to its end) is cut into buckets that never overlap and add up to it,
by the wall clock (`time.time()`), from each launch's `LaunchTimes` (the driver's) and from a `Stopwatch` that
watches the streamed lines (when each new iteration line came, by the clock of the node that read it: a poll hands
the driver lines in batches; when a checkpoint save or an evaluation began and ended):

  productive_time                    the steps of iterations never redone (between iteration lines)
  placement                          the first gang: its placement group asked for -> the nodes' commands started
  program_startup                    commands started -> the first iteration line (process start, imports, init,
                                     checkpoint load, compile; the first logged step's own time is in here)
  unproductive_checkpoint_save_time  blocking checkpoint saves ("saving checkpoint at iteration" -> "successfully
                                     saved checkpoint" / "saved checkpoint iteration", or the next iteration line;
                                     a4ray.mcore's local saves: "busy: saving" -> "done: saving"); an async save's
                                     write after training went on is not lost time, and is recorded apart
                                     (`background_save_s`)
  evaluation                         "Evaluating on|iter" -> "validation loss at" (or the next iteration line)
  wasted_progress_from_disruption    the steps of iterations a later attempt redid (it resumed from a checkpoint
                                     before them), at their measured time
  fault_detection                    the last iteration line before a fault -> a4ray's verdict (the launch failed)
  recovery                           the verdict -> the next attempt's first iteration line (stopping the gang,
                                     the backoff, a new gang's placement where the old one could not serve, the
                                     startup, the checkpoint load)
  other                              the rest: before the first gang, the last line -> the end of a finished
                                     launch (the final save is a save), after a last failed launch's verdict

goodput = productive_time / wall. The names are Google's ml-goodput-measurement `BadputType`s where they fit
(`GOOGLE` says which of theirs each bucket is, or is part of); Google's infrastructure recovery (the last step
before the fault -> the new job's start) is fault_detection plus the first part of recovery here.

Each failure that ended an attempt is an `Incident`: its kind, the last progress before it, when it was seen, the
verdict, the gang stopped, the next attempt started, its first iteration, and when the run was back at the iteration
it had reached (caught up).

`project_ettr` is Meta's model (Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research
Clusters", HPCA 2025): E[ETTR] ~ (1 - N r_f (u0 + dt/2)) / (1 + w/dt), best checkpoint interval dt* = sqrt(2 w /
(N r_f)), with N nodes, r_f failures per node-day, u0 the restart overhead, w the checkpoint write time and dt the
checkpoint interval; `Goodput.projection()` feeds it a run's own u0, w and dt.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from array import array
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel

from a4ray.core.results import axes, dataframe
from a4ray.observe.checkpoint_policy import PUBLISHED_RATE, best_interval_s


class LaunchTimes(BaseModel):
    """When things happened in one launch, wall clock (`time.time()`): what goodput accounting and incident
    records are built from. None: it did not happen (no iteration came, nothing failed)."""

    placing_at: float | None = None  # the gang asked Ray for its placement group
    started_at: float | None = None  # the nodes' commands were started
    first_iteration_at: float | None = None  # the first new iteration line
    first_iteration: int | None = None  # its number (after a resume: the checkpoint's next iteration)
    last_progress_at: float | None = None  # the latest new iteration line
    fault_seen_at: float | None = None  # a4ray first saw what ended the launch (a rank's end, a failure, a suspicion)
    verdict_at: float | None = None  # a4ray decided the launch has failed (and began stopping it)
    ended_at: float | None = None  # every node stopped


# bucket -> (its short label in the goodput line, its name in Google's ml-goodput-measurement)
BUCKETS: dict[str, tuple[str, str]] = {
    "productive_time": ("productive", "productive time (goodput)"),
    "placement": ("placement", "part of TPU_INITIALIZATION (the accelerators got)"),
    "program_startup": ("startup", "PROGRAM_STARTUP, with TRAINING_PREP and UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME"),
    "unproductive_checkpoint_save_time": ("checkpoints", "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME"),
    "evaluation": ("evaluation", "CUSTOM_BADPUT_EVENTS (evaluation)"),
    "wasted_progress_from_disruption": ("lost work", "WASTED_PROGRESS_FROM_DISRUPTION"),
    "fault_detection": ("detection", "first part of INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION"),
    "recovery": ("recovery", "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION's rest, and the restart's startup"),
    "other": ("other", "OTHER"),
}
GOOGLE = {bucket: google for bucket, (_, google) in BUCKETS.items()}
COLOURS = {"productive_time": "#2da44e", "placement": "#8250df", "program_startup": "#bf8700",
           "unproductive_checkpoint_save_time": "#0969da", "evaluation": "#54aeff",
           "wasted_progress_from_disruption": "#cf222e", "fault_detection": "#fa4549", "recovery": "#fb8f44",
           "other": "#afb8c1"}
# What a save or an evaluation in a busy spell would otherwise be counted as: a busy spell paints over these only.
_PAINTABLE = {"productive_time", "wasted_progress_from_disruption", "fault_detection", "other"}

# Meta's failure rates (failures per 1000 node-days) on their two clusters, and the node counts projected
PUBLISHED_RATES = (PUBLISHED_RATE, 2.34)  # Meta's RSC-1 and RSC-2, failures per 1000 node-days
PROJECTED_NODES = (16, 64, 256, 1024)

BusyKind = Literal["checkpoint", "evaluation", "other"]
# The lines that begin and end a busy spell: Megatron-LM's (checkpointing.py's "saving checkpoint at iteration",
# "successfully saved checkpoint"; training.py's "Evaluating on"/"Evaluating iter", "validation loss at"), a4ray's
# trainers' "saved checkpoint iteration", and any program's `a4ray: busy ...` / `a4ray: done ...`. The hang
# watchdog (observe/hang.py) reads the same lines for whether a run is busy; here they also say with what.
_BEGINS: list[tuple[re.Pattern, BusyKind]] = [
    (re.compile(r"saving checkpoint at iteration", re.IGNORECASE), "checkpoint"),
    (re.compile(r"\bEvaluating (on|iter)\b", re.IGNORECASE), "evaluation"),
    (re.compile(r"\ba4ray(\.\w+)?: busy\b.*\bsav", re.IGNORECASE), "checkpoint"),  # a4ray.mcore's local saves
    (re.compile(r"\ba4ray: busy\b.*\beval", re.IGNORECASE), "evaluation"),
    (re.compile(r"\ba4ray: busy\b", re.IGNORECASE), "other"),
]
_ENDS = re.compile(r"successfully saved checkpoint|\bsaved checkpoint iteration\b|validation loss at|"
                   r"\ba4ray(\.\w+)?: done\b", re.IGNORECASE)
# An async save's write, once it is complete (a4ray.mcore: "checkpoint iteration 20 complete: written in the
# background in 0.44s"): time the run did not wait for, recorded beside the blocking part.
_BACKGROUND = re.compile(r"checkpoint iteration \d+ complete: written in the background in ([0-9.]+)s")
_BUSY_BUCKET = {"checkpoint": "unproductive_checkpoint_save_time", "evaluation": "evaluation", "other": "other"}


class Busy(BaseModel):
    """A spell between iterations in which the run said it was saving a checkpoint or evaluating."""

    kind: BusyKind
    start: float
    end: float | None = None  # None: no line said it ended before the launch did


class AttemptRecord(BaseModel):
    """What the accounting needs of one attempt: its launch's times and how it ended (from its `GangResult`),
    and when each new iteration line and busy spell came (its `Stopwatch`)."""

    attempt: int
    times: LaunchTimes
    failure_kind: str | None = None  # None: the launch succeeded
    failure: str | None = None
    iterations: list[tuple[int, float]] = []  # (iteration, when its line came), increasing
    busy: list[Busy] = []
    background_saves: list[float] = []  # seconds each async save wrote after training went on


class Stopwatch:
    """A line observer (`Gang.observing`): for one launch, when each new iteration line came and when a save or an
    evaluation began and ended: when its node read it (the line's `at`), else by `clock` (the driver's wall clock, as
    `LaunchTimes`). Ranks that print the same line count once; a spell runs from the first rank's begin line to the
    last rank's end line before the next iteration. `on_progress(self)` is called at most every `every_s` seconds on a
    new iteration line."""

    def __init__(self, clock: Callable[[], float] = time.time,
                 on_progress: Callable[[Stopwatch], None] | None = None, every_s: float = 10.0):
        self.clock = clock
        self.on_progress = on_progress
        self.every_s = every_s
        self._numbers, self._times = array("q"), array("d")  # each new iteration line: 16 bytes, for long runs
        self.busy: list[Busy] = []
        self.background: list[float] = []
        self._told: float | None = None

    @property
    def iterations(self) -> list[tuple[int, float]]:
        """(iteration, when its line came) of every new iteration line, in order."""
        return list(zip(self._numbers, self._times))

    def __call__(self, rank: int, line: Any) -> None:
        now = getattr(line, "at", None) or self.clock()
        progress = getattr(line, "progress", None)
        if progress is not None:
            self.iteration(progress.iteration, now)
        else:
            self.text(line.text, now)

    def iteration(self, iteration: int, now: float) -> None:
        if self._numbers and iteration <= self._numbers[-1]:
            return
        self._numbers.append(iteration)
        self._times.append(now)
        if self.busy and self.busy[-1].end is None:  # the next iteration came: whatever was busy is done
            self.busy[-1].end = now
        if self.on_progress is not None and (self._told is None or now - self._told >= self.every_s):
            self._told = now
            self.on_progress(self)

    def text(self, text: str, now: float) -> None:
        low = text.lower()  # every streamed line comes here: substrings first (an IGNORECASE regex: ~25 us a line)
        if not ("checkpoint" in low or "evaluat" in low or "validation loss" in low or "a4ray: " in low):
            return
        if "background" in low and (written := _BACKGROUND.search(text)):
            self.background.append(float(written.group(1)))
            return
        kind = next((kind for pattern, kind in _BEGINS if pattern.search(text)), None)
        last = self.busy[-1] if self.busy else None
        since = self._times[-1] if self._times else -math.inf
        if kind is not None:
            if last is not None and last.end is not None and last.end >= since and last.kind == kind:
                last.end = None  # another rank's late begin line of the spell since the last iteration
            elif last is None or last.end is not None:
                self.busy.append(Busy(kind=kind, start=now))
        elif _ENDS.search(text) and last is not None:
            if last.end is None or last.end >= since:  # open, or another rank's end of the same spell
                last.end = now

    def record(self, attempt: int, times: LaunchTimes, failure_kind: str | None = None,
               failure: str | None = None) -> AttemptRecord:
        # A line drained after the verdict was made before it (a rank's last iteration, read a poll late): the work
        # counts, by the verdict at the latest, so no progress reads as coming after the fault was decided.
        last = times.verdict_at if times.verdict_at is not None else math.inf
        return AttemptRecord(attempt=attempt, times=times, failure_kind=failure_kind, failure=failure,
                             iterations=[(i, min(at, last)) for i, at in self.iterations],
                             busy=[b.model_copy() for b in self.busy], background_saves=list(self.background))


class Segment(BaseModel):
    """A stretch of the run in one bucket, seconds from the run's start, belonging to one attempt's bar."""

    attempt: int
    bucket: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Incident(BaseModel):
    """A failure that ended an attempt, and the run's way back from it (wall clock; None: did not happen)."""

    attempt: int  # the attempt it ended
    kind: str  # failed | lost | hang | timeout | cancelled
    failure: str = ""  # the first line of what a4ray said
    last_iteration: int | None = None  # the run's furthest iteration before it
    last_progress_at: float | None = None  # this attempt's last new iteration line (None: it made none)
    seen_at: float | None = None  # a4ray first saw it
    verdict_at: float | None = None  # a4ray decided the launch failed
    stopped_at: float | None = None  # every node of the gang stopped
    placed_at: float | None = None  # the next attempt's commands started (on the same gang or a placed new one)
    first_iteration_at: float | None = None  # the new gang's first iteration line
    first_iteration: int | None = None
    resumed_from: int | None = None  # the iteration the new gang resumed after (its checkpoint)
    caught_up_at: float | None = None  # the run back at `last_iteration`
    redone_iterations: int = 0  # iterations done before it and done again after it
    lost_work_s: float = 0.0  # their measured time before it
    estimated: list[str] = []  # times the launch did not record, and what stands in for them

    @property
    def detection_s(self) -> float | None:
        return _between(self.last_progress_at, self.verdict_at)

    @property
    def recovery_s(self) -> float | None:
        return _between(self.verdict_at, self.first_iteration_at)

    @property
    def cost_s(self) -> float | None:
        """What it cost the run: detection + recovery + lost work (None where the run never recovered)."""
        if self.recovery_s is None:
            return None
        return (self.detection_s or 0.0) + self.recovery_s + self.lost_work_s

    def row(self, started_at: float = 0.0) -> dict[str, Any]:
        def at(t: float | None) -> float | None:
            return None if t is None else round(t - started_at, 3)

        return {"attempt": self.attempt, "kind": self.kind, "last iteration": self.last_iteration,
                "last progress s": at(self.last_progress_at), "seen s": at(self.seen_at),
                "verdict s": at(self.verdict_at), "stopped s": at(self.stopped_at), "placed s": at(self.placed_at),
                "first iteration s": at(self.first_iteration_at), "resumed from": self.resumed_from,
                "caught up s": at(self.caught_up_at), "detection s": _round(self.detection_s),
                "recovery s": _round(self.recovery_s), "lost work s": round(self.lost_work_s, 3),
                "redone iterations": self.redone_iterations}


class Projection(BaseModel):
    """Meta's E[ETTR] for one cluster size and failure rate."""

    nodes: int
    failures_per_1000_node_days: float
    interval_s: float | None  # the checkpoint interval it was computed at (the run's), if known
    ettr: float | None  # at that interval
    best_interval_s: float  # dt* = sqrt(2 w / (N r_f))
    best_ettr: float  # at dt*


class Goodput(BaseModel):
    """Where one run's wall time went (`result.json`'s `goodput`)."""

    started_at: float  # wall clock: the attempt loop began
    ended_at: float  # ... and returned
    wall_s: float
    goodput: float  # productive_time / wall_s
    buckets: dict[str, float]  # bucket -> seconds; they add up to wall_s
    google: dict[str, str] = GOOGLE  # each bucket's name in Google's ml-goodput-measurement
    attempts: int = 1
    iterations: int | None = None  # the furthest iteration reached
    productive_iterations: int = 0
    step_time_s: float | None = None  # productive time per productive iteration
    checkpoint_save_s: float | None = None  # median blocking save (w)
    background_save_s: float | None = None  # median time an async save went on writing after training resumed
    checkpoint_interval_s: float | None = None  # median time between saves' starts (dt)
    restart_overhead_s: float | None = None  # u0: median detection + recovery of the incidents, else the cold start
    incidents: list[Incident] = []
    segments: list[Segment] = []  # the run's time line, bucket by bucket, one bar per attempt
    notes: list[str] = []

    def share(self, bucket: str) -> float:
        return self.buckets.get(bucket, 0.0) / self.wall_s if self.wall_s > 0 else 0.0

    def line(self) -> str:
        """One line: "goodput 91.2% of 120.3s: startup 3.1%, checkpoints 1.4%, lost work 2.0%, ..." (badput > 0)."""
        parts = [f"{BUCKETS[b][0]} {self.share(b) * 100:.1f}%" for b in BUCKETS
                 if b != "productive_time" and self.share(b) >= 0.0005]
        incidents = f"; {len(self.incidents)} incident(s)" if self.incidents else ""
        return f"goodput {self.goodput * 100:.1f}% of {self.wall_s:.1f}s: " + ", ".join(parts) + incidents

    def rows(self) -> list[dict[str, Any]]:
        """One row per bucket: seconds and share of the wall time."""
        return [{"bucket": b, "seconds": round(s, 3), "share": round(self.share(b), 4), "google": GOOGLE[b]}
                for b, s in self.buckets.items()]

    def to_pandas(self):
        return dataframe(self.rows())

    def incident_rows(self) -> list[dict[str, Any]]:
        """Each incident, its times in seconds from the run's start."""
        return [i.row(self.started_at) for i in self.incidents]

    def projection(self, nodes: tuple[int, ...] = PROJECTED_NODES,
                   rates: tuple[float, ...] = PUBLISHED_RATES) -> list[Projection]:
        """Meta's model at `nodes` and `rates` (failures per 1000 node-days), from this run's u0, w and dt."""
        if self.restart_overhead_s is None or self.checkpoint_save_s is None:
            raise ValueError("the run measured no restart overhead or checkpoint save: give u0_s and w_s to "
                             "project_ettr yourself")
        return project_ettr(self.restart_overhead_s, self.checkpoint_save_s, self.checkpoint_interval_s,
                            nodes=nodes, rates=rates)

    def plot(self, ax=None):
        """The run's time line: one bar per attempt, its stretches coloured by bucket (matplotlib)."""
        ax = axes(ax, title=f"goodput {self.goodput * 100:.1f}%", xlabel="seconds from the run's start",
                  ylabel="attempt")
        attempts = sorted({s.attempt for s in self.segments}) or [0]
        for bucket, colour in COLOURS.items():
            for attempt in attempts:
                spans = [(s.start, s.seconds) for s in self.segments if s.bucket == bucket and s.attempt == attempt]
                if spans:
                    ax.broken_barh(spans, (attempt - 0.4, 0.8), facecolors=colour)
        for bucket in BUCKETS:  # the legend: the buckets this run has
            if any(s.bucket == bucket for s in self.segments):
                ax.bar(0, 0, color=COLOURS[bucket], label=BUCKETS[bucket][0])
        ax.set_yticks(attempts)
        ax.set_xlim(0, max(self.wall_s, 1e-9))
        ax.invert_yaxis()
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=5, fontsize="small", frameon=False)
        return ax


def project_ettr(u0_s: float, w_s: float, interval_s: float | None = None, *,
                 nodes: tuple[int, ...] = PROJECTED_NODES,
                 rates: tuple[float, ...] = PUBLISHED_RATES) -> list[Projection]:
    """Meta's E[ETTR] ~ (1 - N r_f (u0 + dt/2)) / (1 + w/dt) at each node count and failure rate (per 1000
    node-days), at `interval_s` (dt) if given and at the best interval dt* = sqrt(2 w / (N r_f)). u0: the restart
    overhead, w: the checkpoint write time, seconds. An ETTR below 0 (failures come faster than the run recovers)
    is 0."""
    for name, value in (("u0_s", u0_s), ("w_s", w_s)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value!r}: need a finite number of seconds >= 0")
    if interval_s is not None and not (math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"interval_s={interval_s!r}: need a finite number of seconds > 0")
    if not nodes or any(not isinstance(n, int) or n < 1 for n in nodes):
        raise ValueError(f"nodes={nodes!r}: need whole numbers >= 1")
    if not rates or any(not (r > 0) for r in rates):
        raise ValueError(f"rates={rates!r}: need failures per 1000 node-days > 0")
    found = []
    for rate in rates:
        per_node_s = rate / 1000 / 86400
        for n in nodes:
            failures_s = n * per_node_s
            best = best_interval_s(w_s, n, rate)
            found.append(Projection(
                nodes=n, failures_per_1000_node_days=rate, interval_s=interval_s,
                ettr=None if interval_s is None else ettr(u0_s, w_s, interval_s, failures_s),
                best_interval_s=best, best_ettr=ettr(u0_s, w_s, best, failures_s) if best > 0 else
                max(0.0, 1 - failures_s * u0_s)))
    return found


def ettr(u0_s: float, w_s: float, interval_s: float, failures_per_s: float) -> float:
    """(1 - F (u0 + dt/2)) / (1 + w/dt), F the cluster's failures per second; at least 0."""
    return max(0.0, (1 - failures_per_s * (u0_s + interval_s / 2)) / (1 + w_s / interval_s))


def projection_table(projections: list[Projection]) -> str:
    """The projection as text: one line per rate and node count."""
    lines = [f"{'nodes':>6} {'r_f/1000 node-days':>18} {'ETTR at dt':>11} {'best dt':>9} {'ETTR at best':>12}"]
    for p in projections:
        at = "-" if p.ettr is None else f"{p.ettr:.3f}"
        lines.append(f"{p.nodes:>6} {p.failures_per_1000_node_days:>18.2f} {at:>11} "
                     f"{p.best_interval_s:>8.0f}s {p.best_ettr:>12.3f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- accounting


def account(attempts: list[AttemptRecord], started_at: float, ended_at: float) -> Goodput:
    """The run's wall time, `started_at` -> `ended_at`, cut into buckets from its attempts (in order)."""
    notes: list[str] = []
    resumed = _resume_points(attempts)
    segments: list[tuple[int, str, float, float]] = []  # (attempt, bucket, start, end), in time order
    cursor = started_at

    def add(attempt: int, bucket: str, until: float | None) -> None:
        nonlocal cursor
        if until is None or until <= cursor:
            return
        segments.append((attempt, bucket, cursor, until))
        cursor = until

    incidents: list[Incident] = []
    productive_iterations = 0
    for index, a in enumerate(attempts):
        t = a.times
        ended = t.ended_at if t.ended_at is not None else ended_at
        failed = a.failure_kind is not None
        verdict, seen, estimated = _fault_times(a, ended) if failed else (None, None, [])
        first = a.iterations[0][1] if a.iterations else None
        if index == 0:
            placing = t.placing_at if t.placing_at is not None else t.started_at
            add(a.attempt, "other", placing)
            add(a.attempt, "placement", t.started_at)
            add(a.attempt, "program_startup", first if first is not None else verdict if failed else ended)
        else:
            add(a.attempt, "recovery", first if first is not None else verdict if failed else ended)
        later = [resumed[j] for j in range(index + 1, len(attempts)) if resumed[j] is not None]
        redo_after = min(later) if later else None  # iterations past this were redone (or thrown away) later
        redone_here = 0
        for (i0, t0), (i1, t1) in zip(a.iterations, a.iterations[1:]):
            span = i1 - i0
            redone = 0 if redo_after is None else min(span, max(0, i1 - max(i0, redo_after)))
            add(a.attempt, "productive_time", t0 + (t1 - t0) * (span - redone) / span)
            add(a.attempt, "wasted_progress_from_disruption", t1)
            redone_here += redone
            productive_iterations += span - redone
        if failed:
            add(a.attempt, "fault_detection", verdict if a.iterations else None)
            if index == len(attempts) - 1:  # no recovery follows: the gang's stop is the run's end
                add(a.attempt, "other", ended)
        else:
            add(a.attempt, "other", ended)
        if failed:
            incidents.append(_incident(attempts, index, resumed, verdict, seen, estimated, redone_here))
    end = max(ended_at, cursor)
    add(attempts[-1].attempt if attempts else 0, "other", end)
    painted = _paint(segments, [(a.attempt, b) for a in attempts for b in a.busy], attempts, end)
    buckets = {bucket: 0.0 for bucket in BUCKETS}
    lost: dict[int, float] = {}  # attempt -> its steps a later attempt redid, saves among them left out
    for attempt, bucket, s, e in painted:
        buckets[bucket] += e - s
        if bucket == "wasted_progress_from_disruption":
            lost[attempt] = lost.get(attempt, 0.0) + e - s
    for incident in incidents:
        incident.lost_work_s = lost.get(incident.attempt, 0.0)
    wall = end - started_at
    saves = [b for a in attempts for b in a.busy if b.kind == "checkpoint" and b.end is not None]
    save_starts = sorted(b.start for b in saves)
    cold = buckets["placement"] + buckets["program_startup"]
    overheads = [(i.detection_s or 0.0) + i.recovery_s for i in incidents if i.recovery_s is not None]
    if any(i.estimated for i in incidents):
        notes.append("some fault times were not recorded by the launch; see each incident's `estimated`")
    reached = [i for a in attempts for i, _ in a.iterations]
    background = [s for a in attempts for s in a.background_saves]
    return Goodput(
        started_at=started_at, ended_at=end, wall_s=wall,
        goodput=buckets["productive_time"] / wall if wall > 0 else 0.0, buckets=buckets, attempts=len(attempts),
        iterations=max(reached) if reached else None, productive_iterations=productive_iterations,
        step_time_s=buckets["productive_time"] / productive_iterations if productive_iterations else None,
        checkpoint_save_s=statistics.median(b.end - b.start for b in saves) if saves else None,
        background_save_s=statistics.median(background) if background else None,
        checkpoint_interval_s=statistics.median(b - a for a, b in zip(save_starts, save_starts[1:]))
        if len(save_starts) > 1 else None,
        restart_overhead_s=statistics.median(overheads) if overheads else (cold if cold > 0 else None),
        incidents=incidents, notes=notes,
        segments=_merged([Segment(attempt=at, bucket=b, start=s - started_at, end=e - started_at)
                          for at, b, s, e in painted]))


def _fault_times(a: AttemptRecord, ended: float) -> tuple[float, float, list[str]]:
    """(verdict, seen, what stood in for a time the launch did not record) of a failed attempt."""
    t, estimated = a.times, []
    # Until the supervisor records when it saw a fault and decided (LaunchTimes.fault_seen_at / verdict_at), the
    # launch's end stands in: it comes after both, so detection reads longer and recovery shorter than they were.
    verdict = t.verdict_at if t.verdict_at is not None else t.fault_seen_at
    if verdict is None:
        verdict = ended
        estimated.append("verdict_at: the launch's end (not recorded)")
    seen = t.fault_seen_at
    if seen is None:
        seen = verdict
        estimated.append("seen_at: the verdict (not recorded)")
    return verdict, seen, estimated


def _strides(a: AttemptRecord) -> list[int]:
    return [i1 - i0 for (i0, _), (i1, _) in zip(a.iterations, a.iterations[1:])]


def _resume_points(attempts: list[AttemptRecord]) -> list[int | None]:
    """The iteration each attempt resumed after (its checkpoint): its first line's iteration less the iterations a
    line covers (its lines' median stride, else the previous attempt's, else 1); None for the first attempt and
    for an attempt that logged no iteration."""
    found: list[int | None] = []
    stride = 1
    for index, a in enumerate(attempts):
        strides = _strides(a)
        stride = int(statistics.median(strides)) if strides else stride
        if index == 0 or not a.iterations:
            found.append(None)
        else:
            found.append(max(0, a.iterations[0][0] - stride))
    return found


def _incident(attempts: list[AttemptRecord], index: int, resumed: list[int | None], verdict: float, seen: float,
              estimated: list[str], redone: int) -> Incident:
    a = attempts[index]
    furthest = max((i for b in attempts[: index + 1] for i, _ in b.iterations), default=None)
    incident = Incident(
        attempt=a.attempt, kind=a.failure_kind or "failed", failure=(a.failure or "").splitlines()[0][:300]
        if a.failure else "", last_iteration=furthest,
        last_progress_at=a.iterations[-1][1] if a.iterations else None, seen_at=seen, verdict_at=verdict,
        stopped_at=a.times.ended_at, redone_iterations=redone, estimated=estimated)
    if index + 1 < len(attempts):
        nxt = attempts[index + 1]
        incident.placed_at = nxt.times.started_at
        if nxt.iterations:
            incident.first_iteration, incident.first_iteration_at = nxt.iterations[0]
            incident.resumed_from = resumed[index + 1]
        if furthest is not None:
            incident.caught_up_at = next((t for b in attempts[index + 1:] for i, t in b.iterations if i >= furthest),
                                         None)
    return incident


def _paint(segments: list[tuple[int, str, float, float]], spells: list[tuple[int, Busy]],
           attempts: list[AttemptRecord], end: float) -> list[tuple[int, str, float, float]]:
    """`segments` with each busy spell painted over the stretches of its own attempt it may cover (steps, lost work,
    detection, other): a save is a save whatever it interrupted. A spell no line ended ends where its launch did."""
    ends = {a.attempt: (a.times.ended_at if a.times.ended_at is not None else end) for a in attempts}
    for attempt, spell in spells:
        s, e = spell.start, spell.end if spell.end is not None else ends[attempt]
        bucket = _BUSY_BUCKET[spell.kind]
        if e <= s:
            continue
        out = []
        for seg in segments:
            at, b, s0, e0 = seg
            if at != attempt or b not in _PAINTABLE or e0 <= s or s0 >= e:
                out.append(seg)
                continue
            if s0 < s:
                out.append((at, b, s0, s))
            out.append((at, bucket, max(s0, s), min(e0, e)))
            if e0 > e:
                out.append((at, b, e, e0))
        segments = out
    return segments


def _merged(segments: list[Segment]) -> list[Segment]:
    """Adjacent stretches of one bucket in one attempt as one."""
    out: list[Segment] = []
    for seg in segments:
        if seg.end <= seg.start:
            continue
        if out and out[-1].attempt == seg.attempt and out[-1].bucket == seg.bucket and abs(out[-1].end - seg.start) < 1e-9:
            out[-1].end = seg.end
        else:
            out.append(seg.model_copy())
    return out


def _between(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def find(record: dict[str, Any]) -> Goodput | None:
    """The goodput in a run's `result.json` (parsed): its own `goodput`, else its train step's (a pipeline's)."""
    if record.get("goodput"):
        return Goodput.model_validate(record["goodput"])
    for step in reversed(record.get("steps") or []):
        found = (step.get("result") or {}).get("goodput")
        if found:
            return Goodput.model_validate(found)
    return None
