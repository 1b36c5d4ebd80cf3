"""Supervising one launch of a gang: every node's lines streamed to the driver with its node and rank (what
`observe/stream.py` lets through: each library warning once, no raw iteration or result lines; the logs keep
everything), and the launch ended on the first failure (a non-zero exit, a lost node), a hang, its timeout
or a cancel. Once it stops the nodes, their last lines go to the logs only.

The gang (`gang.py`) places the nodes and starts their commands; it hands the running launch to a
`Supervisor`, which watches until every command has ended or one ended it, stops the nodes still running
through the gang, and returns the `Outcome`. Ranks here are launch ranks; `members[rank]` is the node's
gang rank, used in what is printed so a node keeps one name across launches.
"""

from __future__ import annotations

import pickle
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import ray

from a4ray.core.console import say
from a4ray.observe import flight, hang, metrics, stream
from a4ray.observe.progress import Progress, progress_summary
from a4ray.observe.straggler import StragglerCheck
from a4ray.observe.verdicts import HangVerdict, NodeRef, Straggler
from a4ray.runtime.deaths import ACTOR_GONE, why_died
from a4ray.runtime.launch import Launch, LaunchTimes
from a4ray.runtime.node_actor import Line, Poll
from a4ray.runtime.ranks import FAILURE_HEADER
from a4ray.spec.resilience import ObserveSpec

LAST_LINES = 20
# How long a node's long poll waits for news. Lines and the command's end answer at once; an idle node
# answers this often, which costs the driver ~1.5 ms of CPU a time: every second, that was most of a core
# at 512 nodes. The supervisor checks deadlines and hangs every second whatever the polls do.
POLL_WAIT_S = 5.0
NCCL_TIMEOUT = "Watchdog caught collective operation timeout"  # ProcessGroupNCCL's, before it dumps and aborts
_LOST_CHECK_S = 10.0  # after a node fails: how long its peers have to show they are alive

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
        self.hang_report: str | None = None
        self.hang_verdict: HangVerdict | None = None
        self.stragglers: list[Straggler] = []
        self.times = LaunchTimes()


class Supervisor:
    """Streams every node's lines to the driver and ends the launch on the first failure.

    `actors`: the launch's node actors, in launch-rank order; `members`: their gang ranks; `wheres`: how
    each node is described in messages; `nodes`: who each node is (host, IP, block) in verdicts;
    `stop(gang_ranks)` stops nodes' process trees (the gang's); `hang_dir`: where a hang report goes;
    `log_dir`: where the nodes' logs are; `records_dir`: where NCCL dumps its flight records on its own timeout;
    `tags`: the job and run, for metrics.
    """

    def __init__(self, actors: list, members: list[int], wheres: list[str], nodes: list[NodeRef], launches: list[Launch],
                 timeout_s: float | None, *, observe: ObserveSpec, observers: list[LineObserver],
                 stop: Callable[[list[int]], None], hang_dir: Path, log_dir: str, tags: tuple[str, str],
                 records_dir: Path):
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
        self.hang_dir = hang_dir
        self.records_dir = records_dir  # where NCCL dumps its flight records on its own timeout
        self.log_dir = log_dir
        self.tags = tags
        self.stream = stream.for_run(tags[1])  # warnings shown in earlier launches of the run stay shown
        self.cursors = {rank: 0 for rank in range(len(members))}
        self.ended: set[int] = set()  # ranks whose command has ended and handed out every line
        self.rank_tails: dict[tuple[int, int], list[str]] = {}
        self.outcome = Outcome()
        self.watchdog = hang.Watchdog(observe.watchdog)
        self.stragglers = StragglerCheck(observe.straggler, nodes, self.nproc, tags)
        self.last_summary_iteration: int | None = None
        self.last_progress: Progress | None = None
        self.stopping = False  # the nodes are being stopped: what they print now goes to their logs only
        self.stream_closed = False

    def _emit(self, rank: int, poll: Poll) -> None:
        node = self.members[rank]
        # Taken first: a Ctrl-C landing among these lines must not have the stop's drain hand them out again.
        self.cursors[rank] = poll.cursor
        if poll.dropped and not self.stopping:
            say(f"[n{node}] ... {poll.dropped} lines not streamed (driver fell behind); "
                f"they are in the node log")
        tail = self.outcome.tails.setdefault(rank, [])
        for line in poll.lines:
            if line.compute is not None:  # a window of every rank's compute time: judged, kept in the logs
                self.outcome.stragglers = list(self.stragglers.window(line.compute))
                continue
            if line.local_rank is not None:
                who = f"n{node} r{rank * self.nproc[rank] + line.local_rank}"
                rank_tail = self.rank_tails.setdefault((rank, line.local_rank), [])
                rank_tail.append(line.text)
                del rank_tail[:-LAST_LINES]
            else:
                who = f"n{node}"
            if self.stream.show(who, line.text, progress=line.progress is not None) and not self.stopping:
                print(f"[{who}] {line.text}", flush=True)
            for observer in self.observers:
                observer(rank, line)
            if line.progress is not None:
                self._on_progress(line.progress)
            tail.append(line.text)
        del tail[:-LAST_LINES]
        if poll.lines:
            self.watchdog.output(line.text for line in poll.lines)  # a line may say the run is busy (a save)

    def _on_progress(self, progress: Progress) -> None:
        out = self.outcome
        self.watchdog.progress(progress.iteration)
        if out.last_iteration is None or progress.iteration > out.last_iteration:
            now = time.time()
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
        last = self.last_progress
        if last is not None and last.iteration != self.last_summary_iteration:
            self._summarize(last)
        held = self.stream.summary(f"{self.log_dir}/rank-*.log")
        if held:
            say(held)

    def _on_hang(self, why: str) -> None:
        metrics.record_hang(*self.tags)
        w = self.observe.watchdog
        summary, verdict = hang.report(why, self.actors, self.nodes, self.nproc, self.hang_dir, py_spy=w.py_spy,
                                       flight_recorder=w.flight_recorder, record_timeout_s=w.record_timeout_s)
        for culprit in {c.node.node: c for c in verdict.culprits}.values():
            metrics.record_culprit(*self.tags, culprit.node)
        out = self.outcome
        out.kind, out.hang_report, out.hang_verdict = "hang", str(self.hang_dir), verdict
        out.message = f"the launch hung: {why}; {verdict.line()}; {summary}"
        out.hint = f"stack dumps and the verdict are in {self.hang_dir}, flight records under the logs' flight-recorder/"

    def watch(self) -> Outcome:
        try:
            return self._watch()
        finally:
            self._close_stream()

    def _watch(self) -> Outcome:
        out = self.outcome
        pending = {a.poll.remote(0, POLL_WAIT_S): rank for rank, a in enumerate(self.actors)}
        try:
            # Standby nodes never end by themselves: the launch is over when every command has ended.
            while any(rank not in self.standby for rank in pending.values()):
                wait_s = 1.0 if self.deadline is None else max(0.0, min(1.0, self.deadline - time.monotonic()))
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
                        self.ended.add(rank)
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
                                          sorted(set(pending.values())))
                        return self._finish()
                why = self.watchdog.why(out.last_iteration) if pending else None
                if why:
                    self._on_hang(why)
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

    def _node_failed(self, rank: int, how: str, peers: list[int]) -> None:
        """Node `rank` failed (`how`: "exited with code 1"); unless a lost peer explains it, it is the launch's
        failure."""
        failed = f"node {self.members[rank]} ({self.wheres[rank]}) {how}"
        lost = self._lost_among([p for p in peers if p != rank])
        if lost is None:
            self._fail(rank, "failed", failed, how)
        else:  # the failure was the echo of a lost peer (a collective's peer vanished)
            lost_rank, why = lost
            self._fail(lost_rank, "lost", self._lost(lost_rank, f"its node actor is gone (Ray: {why}); "
                                                                f"{failed} after it"))

    def _lost_among(self, ranks: list[int]) -> tuple[int, str] | None:
        """The first of `ranks` whose node actor is gone, with Ray's word on why. When a node dies, its peers'
        collectives fail within milliseconds, often before Ray reports the node: the lost node is the root cause."""
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

    def _finish(self) -> Outcome:
        """Stop every still-running node, then drain the lines they printed while stopping. Not only the ranks
        with a poll pending: a Ctrl-C / SIGTERM lands between taking a poll's result and asking again as often
        as not (it is sent on seeing a line), and that rank's command must stop too."""
        out = self.outcome
        running = set(range(len(self.members))) - self.ended
        self._close_stream()
        say(f"stopping {len(running)} node(s): {out.message.splitlines()[0] if out.message else ''}")
        self.stopping = True
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
    """What killed a process that ended with a negative exit code (" (killed by SIGKILL)"), else ""."""
    if code < 0:
        try:
            return f" (killed by {signal.Signals(-code).name})"
        except ValueError:
            return ""
    return ""
