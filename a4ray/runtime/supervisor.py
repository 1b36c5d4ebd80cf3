"""Supervising one launch of a gang: every node's lines streamed to the driver with its node and rank (what
`observe/stream.py` lets through: each library warning once, a line several ranks print once with their ranks, no
raw iteration or result lines; the logs keep everything), and the launch ended on the first failure (a non-zero
exit, a lost node), a hang, its timeout or a cancel. Once it stops the nodes, their last lines go to the logs only.

The gang (`gang.py`) places the nodes and starts their commands; it hands the running launch to a
`Supervisor`, which watches until every command has ended or one ended it, stops the nodes still running
through the gang, and returns the `Outcome`. Ranks here are launch ranks; `members[rank]` is the node's
gang rank, used in what is printed so a node keeps one name across launches.
"""

from __future__ import annotations

import pickle
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import ray

from a4ray.core.console import say
from a4ray.observe import flight, hang, metrics, stream
from a4ray.observe.goodput import LaunchTimes
from a4ray.observe.progress import Progress, progress_summary
from a4ray.observe.stacks import ranges
from a4ray.observe.straggler import StragglerCheck
from a4ray.observe.verdicts import Culprit, HangVerdict, NodeRef, Straggler
from a4ray.runtime.deaths import ACTOR_GONE, why_died
from a4ray.runtime.launch import Launch
from a4ray.runtime.node_actor import Line, Poll
from a4ray.runtime.notice import NOTICE_EXIT_CODE, SAVED_ON_NOTICE
from a4ray.runtime.ranks import FAILURE_HEADER, ended_rank
from a4ray.spec.resilience import ObserveSpec

LAST_LINES = 20
# How long a node's long poll waits for news. The launcher's lines and the command's end answer at once, ranks' lines
# within 0.1 s (`node_actor._GATHER_S`); an idle node answers this often, which costs the driver ~1.5 ms of CPU a
# time: every second, that was most of a core at 512 nodes. The supervisor checks deadlines and hangs every second
# whatever the polls do.
POLL_WAIT_S = 5.0
NCCL_TIMEOUT = "Watchdog caught collective operation timeout"  # ProcessGroupNCCL's, before it dumps and aborts
_LOST_CHECK_S = 10.0  # after a node fails: how long its peers have to show they are alive
# After a rank ends while others run: when to look where the others are (seconds after the end, then again and
# again, until they end too, the launch fails, or the exit barrier passes). The first look lets peers that were
# finishing their own last step end too.
_AFTER_END_S = (3.0, 15.0, 60.0)
# A peer's failure that is the echo of a rank that left: gloo's, NCCL's and the socket's words for it.
_ANALYSIS_WAIT_S = 60.0  # how long the end of a launch waits for torch's analyzer to write its part of the report
_ECHO_WAIT_S = 3.0  # a failure in a peer-gone's words: how long the rank that left has to be seen
# how often the nodes are asked meanwhile: a poll answers at once with news, else after this, and the wait asks
# every node (a slower one held the rank that left's word back by half a second)
_ECHO_POLL_S = 0.1
_ECHO = re.compile(r"Connection (closed|reset) by peer|remote process exited|ncclRemoteError|Broken pipe|"
                   r"socket closed|recvBytes failed|peer closed")
# torch's own lines that a blocked rank prints every second, which say nothing about the run's progress.
_TORCH_NOISE = re.compile(r"Failed to check the \"should dump\" flag on TCPStore|ProcessGroupNCCL.*heartbeat|"
                          r"HeartbeatMonitor|TCPStore.*(Broken pipe|Connection reset)")

LineObserver = Callable[[int, Line], None]


class Outcome:
    """How a launch ended, as the supervisor saw it."""

    def __init__(self) -> None:
        self.kind: Literal["done", "failed", "lost", "hang", "timeout", "cancelled"] = "done"
        self.message: str | None = None
        self.hint: str | None = None
        self.failed_node: int | None = None  # launch rank
        self.lost: set[int] = set()
        self.tails: dict[int, list[str]] = {}
        self.iterations_seen = 0
        self.last_iteration: int | None = None
        self.saved_on_notice: int | None = None  # the iteration the ranks saved at on a cancel's notice
        self.hang_report: str | None = None
        self.hang_verdict: HangVerdict | None = None
        self.stragglers: list[Straggler] = []
        self.times = LaunchTimes()


class Supervisor:
    """Streams every node's lines to the driver and ends the launch on the first failure.

    `actors`: the launch's node actors, in launch-rank order; `members`: their gang ranks; `wheres`: how
    each node is described in messages; `nodes`: who each node is (host, IP, block) in verdicts;
    `stop(gang_ranks)` stops nodes' process trees (the gang's); `notice(gang_ranks)`, where the launch saves on
    notice, has them save and end first on a cancel (returns the grace it gave); `hang_dir`: where a hang report goes;
    `log_dir`: where the nodes' logs are; `records_dir`: where NCCL dumps its flight records on its own timeout;
    `tags`: the job and run, for metrics.
    """

    def __init__(self, actors: list, members: list[int], wheres: list[str], nodes: list[NodeRef], launches: list[Launch],
                 timeout_s: float | None, *, observe: ObserveSpec, observers: list[LineObserver],
                 stop: Callable[[list[int]], None], hang_dir: Path, log_dir: str, tags: tuple[str, str],
                 records_dir: Path, notice: Callable[[list[int]], float] | None = None):
        self.actors = actors
        self.members = members
        self.wheres = wheres
        self.nodes = nodes
        self.nproc = [launch.nproc for launch in launches]
        self.standby = {rank for rank, launch in enumerate(launches) if launch.standby}
        self.deadline = time.monotonic() + timeout_s if timeout_s else None
        self.timeout_s = timeout_s
        self.observe = observe
        self.observers = observers
        self.stop = stop
        self.notice = notice
        self.hang_dir = hang_dir
        self.records_dir = records_dir  # where NCCL dumps its flight records on its own timeout
        self.log_dir = log_dir
        self.tags = tags
        self.stream = stream.for_run(tags[1])  # warnings shown in earlier launches of the run stay shown
        self.lines = stream.RankLines(self.stream, ranks=sum(self.nproc), nodes=len(members),
                                      every_rank=observe.rank_lines == "all")
        self.cursors = {rank: 0 for rank in range(len(members))}
        self.finished: set[int] = set()  # nodes whose command has ended and handed out every line
        self.rank_tails: dict[tuple[int, int], list[str]] = {}
        self.outcome = Outcome()
        self.watchdog = hang.Watchdog(observe.watchdog)
        self.stragglers = StragglerCheck(observe.straggler, nodes, self.nproc, tags)
        self.last_summary_iteration: int | None = None
        self.last_progress: Progress | None = None
        self.stopping = False  # the nodes are being stopped: what they print now goes to their logs only
        self.stream_closed = False
        self.first_rank = [sum(self.nproc[:rank]) for rank in range(len(members))]  # a launch's global rank numbering
        self.ended_ranks: dict[int, tuple[int, float]] = {}  # global rank -> (exit code, when) while others ran
        self.looks_after_end = 0  # inspections since the latest rank ended
        self.inspect_at: float | None = None  # monotonic: an inspection is due (a rank ended while others run)
        self.suspicion: tuple[tuple, float] | None = None  # (what a look saw of ranks waiting, when to look again)
        self.said_not_hung = False
        self.suspected_at: float | None = None  # wall clock: the first look of the latest suspicion
        self.analysis: threading.Thread | None = None  # torch's analyzer over a verdict's records, for the report
        self.in_flight: dict[ray.ObjectRef, int] = {}  # each running node's long poll -> its rank
        self.gone: dict[int, str] = {}  # rank -> Ray's word on why its node actor is gone, once a call has told

    def _emit(self, rank: int, poll: Poll) -> None:
        node = self.members[rank]
        # Taken first: a Ctrl-C landing among these lines must not have the stop's drain hand them out again.
        self.cursors[rank] = poll.cursor
        if poll.dropped and not self.stopping:
            say(f"[n{node}] ... {poll.dropped} lines not streamed (driver fell behind); "
                f"they are in the node log")
        tail = self.outcome.tails.setdefault(rank, [])
        news = False  # a line held back as a repeat, or torch's own noise, is no news for the watchdog
        for line in poll.lines:
            if line.compute is not None:  # a window of every rank's compute time: judged, kept in the logs
                self.outcome.stragglers = list(self.stragglers.window(line.compute))
                continue
            if line.local_rank is None and (ended := ended_rank(line.text)) is not None:
                self._rank_ended(ended[0], ended[2], ended[3])  # the launcher's word: kept in the logs, judged
                tail.append(line.text)
                continue
            global_rank = None if line.local_rank is None else self.first_rank[rank] + line.local_rank
            if line.local_rank is not None:
                who = f"n{node} r{global_rank}"
                rank_tail = self.rank_tails.setdefault((rank, line.local_rank), [])
                rank_tail.append(line.text)
                del rank_tail[:-LAST_LINES]
            else:
                who = f"n{node}"
            if self.stopping:  # judged as ever (the watchdog's news), not shown
                shown = self.stream.show(who, line.text, progress=line.progress is not None)
            else:
                shown = self.lines.add(who, line.text, rank=global_rank, node=node, progress=line.progress is not None)
            news = news or (shown and not _TORCH_NOISE.search(line.text))
            for observer in self.observers:
                observer(rank, line)
            if line.progress is not None:
                self._on_progress(line.progress, line.at or time.time())
            elif self.stopping and (saved := SAVED_ON_NOTICE.search(line.text)):
                self.outcome.saved_on_notice = int(saved.group(1))
            tail.append(line.text)
        del tail[:-LAST_LINES]
        if poll.lines:
            self.watchdog.output((line.text for line in poll.lines), news)  # a line may say the run is busy (a save)

    def _on_progress(self, progress: Progress, now: float) -> None:
        """An iteration line, read on its node at `now`."""
        out = self.outcome
        self.watchdog.progress(progress.iteration, last=progress.iteration == progress.train_iters)
        if out.last_iteration is None or progress.iteration > out.last_iteration:
            if not self.stopping:  # a line drained while the gang stops is no progress after the fault
                if out.times.first_iteration_at is None:
                    out.times.first_iteration_at, out.times.first_iteration = now, progress.iteration
                out.times.last_progress_at = now
            out.iterations_seen += 1
            out.last_iteration = progress.iteration
            self.last_progress = progress
            every = self.observe.summary_every
            if (self.last_summary_iteration is None or progress.iteration - self.last_summary_iteration >= every
                    or progress.iteration == progress.train_iters):
                self._summarize(progress)

    def _summarize(self, progress: Progress) -> None:
        self.last_summary_iteration = progress.iteration
        say(f"progress: {progress_summary(progress, self.observe.seq_length)}")

    def _close_stream(self) -> None:
        """The launch's last word in the stream: the iteration it reached, if not said yet; the warnings held back."""
        if self.stream_closed:
            return
        self.stream_closed = True
        self.lines.flush()
        last = self.last_progress
        if last is not None and last.iteration != self.last_summary_iteration:
            self._summarize(last)
        held = self.stream.summary(f"{self.log_dir}/rank-*.log")
        if held:
            say(held)

    # ------------------------------------------------------------------ ranks that end early, hangs, desyncs
    def _rank_ended(self, rank: int, code: int, at: float) -> None:
        """Global rank `rank` ended (exit `code`, at wall time `at`) while others of the launch run: an event, judged
        at once. Its peers may wait for it in a collective it will never join (NCCL's block without an error)."""
        if rank in self.ended_ranks or self.stopping:
            return
        self.ended_ranks[rank] = (code, at)
        self.looks_after_end = 0
        self.inspect_at = time.monotonic() + _AFTER_END_S[0]

    def _node_ended(self, rank: int) -> None:
        """Node `rank`'s command ended with exit 0: its ranks (those its launcher did not say ended already) too."""
        for local in range(self.nproc[rank]):
            self._rank_ended(self.first_rank[rank] + local, 0, time.time())

    def _check(self) -> bool:
        """Whether the launch is over for a rank that ended, the watchdog, or the exit barrier (judged here)."""
        w = self.observe.watchdog
        if not w.enabled:
            return False
        now = time.monotonic()
        if self.ended_ranks:
            first = min(at for _, at in self.ended_ranks.values())
            ended = ranges(sorted(self.ended_ranks))
            if w.exit_barrier_s and time.time() - first > w.exit_barrier_s:
                return self._judge(f"the launch's other ranks still run {time.time() - first:.0f}s after rank(s) "
                                   f"{ended} ended (observe.watchdog.exit_barrier_s={w.exit_barrier_s:g}, as "
                                   f"torchrun's exit barrier)", None, bound=True)
            if self.inspect_at is not None and now >= self.inspect_at:
                self.looks_after_end += 1
                self.inspect_at = now + _AFTER_END_S[min(self.looks_after_end, len(_AFTER_END_S) - 1)]
                codes = sorted({code for code, _ in self.ended_ranks.values()})
                if self._judge(f"rank(s) {ended} ended (exit {', '.join(map(str, codes))}) while the launch's "
                               f"other ranks run", None):
                    return True
        alarm = self.watchdog.alarm(self.outcome.last_iteration)
        if alarm is None:
            self.suspicion = None
            return False
        if alarm.bound:
            return self._judge(alarm.why, alarm.window_s, bound=True)
        if self.suspicion is None or now >= self.suspicion[1]:
            return self._judge(alarm.why, alarm.window_s)
        return False

    def _judge(self, why: str, window_s: float | None, *, bound: bool = False) -> bool:
        """Look where every rank is and judge it: True, and the outcome set, where the evidence shows a collective
        that cannot complete (`hang.settled`), or at an upper bound (`bound`) whatever it shows. A look that finds
        ranks waiting, not yet long enough to tell, looks again; one that finds none waiting re-arms the watchdog."""
        w = self.observe.watchdog
        if self.suspicion is None:
            self.suspected_at = time.time()
        evidence, verdict = hang.inspect(self.actors, self.nodes, self.nproc, self.ended_ranks, py_spy=w.py_spy,
                                         flight_recorder=w.flight_recorder, record_timeout_s=w.record_timeout_s)
        picture = hang.picture(verdict)
        seen_before = self.suspicion is not None and self.suspicion[0] == picture
        settled = "the upper bound" if bound else hang.settled(verdict, window_s, seen_before)
        if settled:
            self._decide(why, evidence, verdict)
            return True
        if window_s is None:  # a look: it settles only an ended rank or a desync
            return False
        if verdict.waiting:  # someone waits in a collective: look again once it has waited a while
            self.suspicion = (picture, time.monotonic() + min(30.0, max(2.0, window_s / 2)))
            return False
        self.suspicion = None
        self.watchdog.rearm()
        if not self.said_not_hung:
            self.said_not_hung = True
            if verdict.evidence:
                say(f"{why}; no rank waits in a collective ({evidence.summary}): not a hang")
            else:  # no record and no stack says where any rank is: nothing to judge a hang by
                bound = w.no_progress_s
                say(f"{why}; nothing says where the ranks are ({verdict.note or evidence.summary}): not judged, "
                    f"watching on until the ranks move or fail" + (f", or observe.watchdog.no_progress_s={bound:g}"
                                                                   if bound else ""))
        return False

    def _decide(self, why: str, evidence: hang.Evidence, verdict: HangVerdict) -> None:
        metrics.record_hang(*self.tags)
        for culprit in {c.node.node: c for c in verdict.culprits if verdict.kind == "hang"}.values():
            metrics.record_culprit(*self.tags, culprit.node)  # a rank that ended early or desynced: the program's
        hang.write_report(why, evidence, verdict, self.hang_dir)
        # torch's own analyzer, for the report, while the gang stops (watch() waits for it)
        self.analysis = threading.Thread(target=hang.write_analysis, args=(evidence.records, self.hang_dir),
                                         name="a4ray-fr-analyzer", daemon=True)
        self.analysis.start()
        out = self.outcome
        out.kind, out.hang_report, out.hang_verdict = "hang", str(self.hang_dir), verdict
        if verdict.kind == "hang":
            out.times.fault_seen_at = self.suspected_at or time.time()
            out.message = f"the launch hung: {why}; {verdict.line()}"
        else:
            out.times.fault_seen_at = min((at for _, at in self.ended_ranks.values()), default=None) \
                if verdict.kind == "ended" else self.suspected_at or time.time()
            out.message = verdict.line()
        out.times.verdict_at = time.time()
        out.hint = f"{hang.HINTS[verdict.kind]}; stacks, flight records and torch's analyzer are in {self.hang_dir}"
        say(f"verdict: {out.message}")
        say(f"hang report: {self.hang_dir}")

    def watch(self) -> Outcome:
        try:
            return self._watch()
        finally:
            self._close_stream()
            if self.analysis is not None:
                self.analysis.join(_ANALYSIS_WAIT_S)

    def _watch(self) -> Outcome:
        out = self.outcome
        pending = self.in_flight
        pending.update({a.poll.remote(0, POLL_WAIT_S): rank for rank, a in enumerate(self.actors)})
        try:
            # Standby nodes never end by themselves: the launch is over when every command has ended.
            while any(rank not in self.standby for rank in pending.values()):
                wait_s = 1.0 if self.deadline is None else max(0.0, min(1.0, self.deadline - time.monotonic()))
                held = self.lines.due()  # rank lines that waited for their copies from other ranks long enough
                wait_s = wait_s if held is None else min(wait_s, held)
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
                for ref in ready:
                    rank = pending.pop(ref)
                    try:
                        poll: Poll = ray.get(ref)
                    except ACTOR_GONE as e:
                        self._fail(rank, "lost", self._lost(rank, f"its node actor is gone (Ray: {why_died(e)})"))
                        return self._finish()
                    self._emit(rank, poll)
                    if not poll.running:
                        self.finished.add(rank)
                    if poll.running and self._rank_failed(rank):
                        # The node's launcher reports a dead rank the moment it sees it, then stops the node's
                        # other ranks; the gang stops now, not when that node has: its peers on other nodes
                        # are blocked in a collective with the dead rank and, on NCCL, never fail by themselves.
                        self._node_failed(rank, "reported it", sorted(set(pending.values())))
                        return self._finish()
                    if poll.running:
                        pending[self.actors[rank].poll.remote(poll.cursor, POLL_WAIT_S)] = rank
                    elif poll.exit_code not in (0, None):
                        self._node_failed(rank, f"exited with code {poll.exit_code}{signal_name(poll.exit_code)}",
                                          sorted(set(pending.values())), killed=poll.exit_code < 0)
                        return self._finish()
                    elif any(r not in self.standby for r in pending.values()):  # ended well while others run
                        self._node_ended(rank)
                if pending and self._check():
                    return self._finish()
                if self.deadline is not None and time.monotonic() >= self.deadline and pending:
                    out.kind, out.message = "timeout", f"the launch ran past its timeout ({self.timeout_s:g}s)"
                    out.hint = "raise timeout_s in the spec if the job needs longer"
                    return self._finish()
        except KeyboardInterrupt:
            out.kind, out.message = "cancelled", "cancelled (Ctrl-C or `ray job stop`)"
            return self._finish()
        if pending:  # the standby nodes: their exec'd commands (MPI daemons) end with the launch
            self.stop([self.members[rank] for rank in pending.values()])
        return out

    def _rank_failed(self, rank: int) -> bool:
        """Whether node `rank`'s launcher has reported a failed rank (a4ray's launcher does as it sees it)."""
        tail = self.outcome.tails.get(rank, [])
        return bool(self.nproc[rank]) and any(line.startswith(FAILURE_HEADER) for line in tail) \
            and root_cause(tail) is not None

    def _node_failed(self, rank: int, how: str, peers: list[int], killed: bool = False) -> None:
        """Node `rank` failed (`how`: "exited with code 1"); unless a lost peer or a rank that left before it explains
        it, it is the launch's failure. A command `killed` by a signal may be the echo of its own actor's end: Ray
        kills a worker's children as it kills the worker (`ray.kill`, a lost raylet), and the command's end can
        reach the driver before the actor's does."""
        failed = f"node {self.members[rank]} ({self.wheres[rank]}) {how}"
        others = [p for p in peers if p != rank]
        gone = self._catch_up(others, 0.0)
        if self._echo(rank) and not self.ended_ranks and not gone:
            # The words of a peer gone: a rank that left cleanly fails its gloo peers before its own process has
            # exited. Its end (its launcher's line, its node's settle) or a failure of its own is the cause; or a
            # node that is gone, whose actor's poll fails once Ray knows (then the lost node is the cause).
            deadline = time.monotonic() + _ECHO_WAIT_S
            while not self.ended_ranks and not gone and time.monotonic() < deadline:
                gone = self._catch_up([rank, *others], _ECHO_POLL_S)
                if first := next((p for p in others if self._rank_failed(p) and not self._echo(p)), None):
                    rank, failed = first, f"node {self.members[first]} ({self.wheres[first]}) reported it"
                    break
        lost = self._lost_among([rank, *others] if killed else others)
        if lost is None:
            self._fail(rank, "failed", failed, how)
        else:  # the failure was the echo of a lost peer (a collective's peer vanished)
            lost_rank, why = lost
            after = "" if lost_rank == rank else f"; {failed} after it"
            self._fail(lost_rank, "lost", self._lost(lost_rank, f"its node actor is gone (Ray: {why}){after}"))

    def _echo(self, rank: int) -> bool:
        """Node `rank`'s failed rank ended with the words of a peer gone (gloo's "Connection closed by peer", ...). Only
        that rank's own lines count, where its launcher named it: its node's other ranks may be echoing it (a rank
        SIGKILLed prints nothing, and its local peers' "Connection reset by peer" is about it)."""
        tail = self.outcome.tails.get(rank, [])
        cause = root_cause(tail)
        if cause is None:
            return any(_ECHO.search(line) for line in tail)
        return any(_ECHO.search(line) for line in self.rank_tails.get((rank, cause[1]), []))

    def _catch_up(self, ranks: list[int], wait_s: float) -> list[int]:
        """The lines these nodes have printed by now, or within `wait_s` (their launchers' word on ranks that ended
        among them). Returns the nodes whose actor Ray says is gone (judged by _lost_among). A node with its long
        poll in flight is not asked again: that poll answers with its first news, and it is the call that fails
        first when the node goes (its connection breaks, ~1 s; a new call waits ~2 s to fail to connect)."""
        in_flight = {ref: r for ref, r in self.in_flight.items() if r in ranks}
        refs = {self.actors[r].poll.remote(self.cursors[r], wait_s): r for r in ranks if r not in in_flight.values()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s + 5) if refs else ([], [])
        if in_flight:
            ready += ray.wait(list(in_flight), num_returns=len(in_flight), timeout=0 if refs else wait_s)[0]
        refs.update(in_flight)
        gone = []
        for ref in ready:
            self.in_flight.pop(ref, None)
            try:
                poll = ray.get(ref)
            except ACTOR_GONE as e:
                gone.append(refs[ref])
                self.gone[refs[ref]] = why_died(e)
                continue
            except Exception:  # noqa: BLE001 - a node that cannot answer now is judged by _lost_among
                continue
            self._emit(refs[ref], poll)
            if ref in in_flight and poll.running:  # the watch goes on asking it
                self.in_flight[self.actors[refs[ref]].poll.remote(poll.cursor, POLL_WAIT_S)] = refs[ref]
            if not poll.running:
                self.finished.add(refs[ref])
            if not poll.running and poll.exit_code == 0:  # its ranks all ended well
                self._node_ended(refs[ref])
        return gone

    def _lost_among(self, ranks: list[int]) -> tuple[int, str] | None:
        """The first of `ranks` whose node actor is gone, with Ray's word on why. When a node dies, its peers'
        collectives fail within milliseconds, often before Ray reports the node: the lost node is the root cause."""
        known = next((rank for rank in ranks if rank in self.gone), None)
        if known is not None:
            return known, self.gone[known]
        refs = {self.actors[rank].alive.remote(): rank for rank in ranks}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=_LOST_CHECK_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ACTOR_GONE as e:
                return refs[ref], why_died(e)
        return None

    def _lost(self, rank: int, why: str) -> str:
        return f"node {self.members[rank]} ({self.wheres[rank]}) was lost: {why}"

    def _fail(self, rank: int, kind: str, message: str, how: str = "") -> None:
        out = self.outcome
        out.kind = kind  # type: ignore[assignment]
        out.failed_node = rank
        if kind == "lost":
            out.lost.add(rank)
        tail = out.tails.get(rank, [])
        cause = root_cause(tail) if self.nproc[rank] and kind == "failed" else None
        left = self._left_before(self.rank_tails.get((rank, cause[1]), []) or tail) if cause else None
        if left is not None:  # the failure is the echo of a rank that left: that rank is the cause
            self._echo_of(left, cause, tail)
            return
        if cause:
            global_rank, local_rank, code = cause
            ended = signal_name(code).strip(" ()").replace("killed by", "was killed by") or f"exited with code {code}"
            why = root_cause_detail(tail)
            message = (f"rank {global_rank} (local rank {local_rank}) on {self.nodes[rank].describe()} {ended}"
                       f"{'; ' + why if why else ''}; the gang was stopped (node {self.members[rank]} {how})")
            tail = self.rank_tails.get((rank, local_rank), [])
            message += f"; last lines of rank {global_rank}"
        else:
            message += "; last lines"
        if kind == "failed" and any(NCCL_TIMEOUT in line for line in tail):
            out.hang_verdict = self._nccl_timeout_verdict()
            if out.hang_verdict is not None:
                message += f" (NCCL's watchdog timed out a collective; {out.hang_verdict.line()})"
        out.message = message + (":\n" + "\n".join(f"    {t}" for t in tail[-LAST_LINES:]) if tail else "")

    def _left_before(self, tail: list[str]) -> list[int] | None:
        """The ranks that ended well (exit 0) before this failure, when the failed rank's words are those of a peer
        gone (gloo's "Connection closed by peer", NCCL's remote error): the failure is their echo."""
        left = sorted(r for r, (code, _) in self.ended_ranks.items() if code == 0)
        return left if left and any(_ECHO.search(line) for line in tail) else None

    def _echo_of(self, left: list[int], cause: tuple[int, int, int], tail: list[str]) -> None:
        out = self.outcome
        by_rank = hang.rank_nodes(self.nodes, self.nproc)
        failed_rank = cause[0]
        echo = next((m.group(0) for line in tail if (m := _ECHO.search(line))), "a peer gone")
        ended = [hang.ended_rank(r, by_rank[r], *self.ended_ranks[r], self._exit_record(r)) for r in left]
        out.hang_verdict = HangVerdict(
            kind="ended", ended=ended, waiting=[failed_rank],
            culprits=[Culprit(rank=e.rank, node=e.node, where=f"ended with exit {e.exit_code}",
                              why="it ended while its peers were in a collective with it") for e in ended],
            evidence=[f"end of rank(s) {ranges(left)}", f"rank {failed_rank}'s {echo!r}"])
        out.kind = "failed"
        out.failed_node = next(n for n in range(len(self.nodes)) if self.nodes[n].node == ended[0].node.node)
        out.times.fault_seen_at = min(e.at for e in ended)
        rank_tail = self.rank_tails.get((self._launch_rank(failed_rank), cause[1]), [])
        said = "; ".join(e.describe() for e in ended)
        out.message = (f"{said}; rank {failed_rank} (local rank {cause[1]}) on {by_rank[failed_rank].describe()} then "
                       f"failed with {echo!r}, its echo, not a cause of its own; last lines of rank {failed_rank}:\n"
                       + "\n".join(f"    {t}" for t in (rank_tail or tail)[-LAST_LINES:]))
        out.hint = hang.HINTS["ended"]

    def _launch_rank(self, global_rank: int) -> int:
        """The launch rank of the node that runs `global_rank`."""
        return max(n for n in range(len(self.first_rank)) if self.first_rank[n] <= global_rank)

    def _exit_record(self, rank: int) -> dict | None:
        """The flight record rank `rank` left as it exited (runtime/rank_site), if any."""
        try:
            return flight.read_dump(self.records_dir / f"{flight.EXIT_DUMP_PREFIX}{rank}")
        except (OSError, EOFError, pickle.UnpicklingError):
            return None

    def _nccl_timeout_verdict(self) -> HangVerdict | None:
        """The verdict from the flight records NCCL dumped on its timeout (TORCH_NCCL_DUMP_ON_TIMEOUT), if any."""
        time.sleep(2)  # the other ranks' watchdogs dump on the same timeout, a moment later
        records = {}
        for path in sorted(self.records_dir.glob("nccl_trace_rank_*")):
            try:
                records[int(path.name.rsplit("_", 1)[1])] = flight.read_dump(path)
            except (OSError, ValueError, EOFError, pickle.UnpicklingError):
                continue
        if not records:
            return None
        verdict = hang.judge(records, {}, [], self.nodes, self.nproc)
        for culprit in {c.node.node: c for c in verdict.culprits}.values():
            metrics.record_culprit(*self.tags, culprit.node)
        return verdict

    def _give_notice(self, ranks: list[int]) -> None:
        """A cancel of a launch that saves on notice: its ranks save at the iteration they reached, then end."""
        say(f"notice to {len(ranks)} node(s): the ranks save a checkpoint at the iteration they reached, then end "
            "(Ctrl-C again to stop at once)")
        t0 = time.monotonic()
        try:
            grace = self.notice([self.members[rank] for rank in ranks])
        except KeyboardInterrupt:
            say("a second Ctrl-C: stopping now, without the save")
            return
        took = time.monotonic() - t0
        for rank in ranks:  # their last lines, the save's among them
            try:
                self._emit(rank, ray.get(self.actors[rank].poll.remote(self.cursors[rank], 0.0), timeout=30))
            except Exception:  # noqa: BLE001 - an actor gone: the stop that follows reports it
                continue
        saved = self.outcome.saved_on_notice
        say(f"saved checkpoint iteration {saved} on notice in {took:.1f}s" if saved is not None else
            f"no checkpoint saved on notice within {took:.1f}s (grace {grace:g}s, cluster.notice_grace_s): a rerun "
            "resumes from the newest one saved before")

    def _finish(self) -> Outcome:
        """Stop every still-running node, then drain the lines they printed while stopping. Not only the ranks
        with a poll pending: a Ctrl-C / SIGTERM lands between taking a poll's result and asking again as often
        as not (it is sent on seeing a line), and that rank's command must stop too."""
        out = self.outcome
        running = set(range(len(self.members))) - self.finished
        self._close_stream()
        if out.kind != "done":
            out.times.fault_seen_at = out.times.fault_seen_at or (time.time() if out.kind != "cancelled" else None)
            out.times.verdict_at = out.times.verdict_at or time.time()
        said = {"hang": "the verdict above", "failed": "the failure below", "lost": "a node was lost",
                "timeout": "past the timeout", "cancelled": "cancelled"}.get(out.kind, "")
        say(f"stopping {len(running)} node(s)" + (f": {said}" if said else ""))
        self.stopping = True
        if out.kind == "cancelled" and self.notice is not None and running - out.lost:
            self._give_notice(sorted(running - out.lost))
        self.stop([self.members[rank] for rank in sorted(running - out.lost)])
        for rank in sorted(running - out.lost):
            try:
                poll = ray.get(self.actors[rank].poll.remote(self.cursors[rank], 0.0), timeout=30)
                self._emit(rank, poll)
            except KeyboardInterrupt:  # a second Ctrl-C while stopping: the nodes are stopped already
                continue
            except Exception:  # noqa: BLE001 - an actor that died while stopping is reported as lost
                out.lost.add(rank)
        return out


_ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_ROOT_CAUSE_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_ROOT_CAUSE_WHY = re.compile(r"^\s*cause\s*:\s*(.+)$")


def root_cause(lines: list[str]) -> tuple[int, int, int] | None:
    """(global rank, local rank, exit code) from the "Root Cause (first observed failure)" report that torchrun
    and a4ray.runtime.ranks print."""
    try:
        start = max(i for i, line in enumerate(lines) if "Root Cause" in line)
    except ValueError:
        return None
    rank = code = None
    for line in lines[start:]:
        if rank is None and (m := _ROOT_CAUSE_RANK.match(line)):
            rank = (int(m.group(1)), int(m.group(2)))
        elif code is None and (m := _ROOT_CAUSE_CODE.match(line)):
            code = int(m.group(1))
    return (*rank, code) if rank and code is not None else None


def root_cause_detail(lines: list[str]) -> str | None:
    """What the node knows of why the first failed rank ended (a4ray's launcher: the kernel's OOM killer)."""
    try:
        start = max(i for i, line in enumerate(lines) if "Root Cause" in line)
    except ValueError:
        return None
    for line in lines[start:]:
        if m := _ROOT_CAUSE_WHY.match(line):
            return m.group(1)
    return None


def signal_name(code: int) -> str:
    """What killed a process that ended with a negative exit code (" (killed by SIGKILL)"), or what a4ray's own codes
    mean, else ""."""
    if code == NOTICE_EXIT_CODE:
        return " (its ranks saved on notice and ended: its pod is being deleted, preempted or maintained)"
    if code < 0:
        try:
            return f" (killed by {signal.Signals(-code).name})"
        except ValueError:
            return ""
    return ""
