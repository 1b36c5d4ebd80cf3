"""PyTorch's flight recorder on a hang: every rank's record of its collectives, fetched on its node, and
matched across ranks into "which collective is stuck, and which ranks never joined it".

Getting a rank's record (on its node, by the node actor: `collect`, every rank of the node at once):
  * NCCL: the debug pipe is `<TORCH_NCCL_DEBUG_INFO_PIPE_FILE><global rank>.pipe`, made (mkfifo, opened for
    reading) only by process group 0's heartbeat thread, and only when TORCH_FR_BUFFER_SIZE > 0; that thread
    reads it every TORCH_NCCL_COORD_CHECK_MILSEC (1 s) while TORCH_NCCL_DUMP_ON_TIMEOUT is on, and a byte
    written to it makes the rank dump its record to `<TORCH_FR_DUMP_TEMP_FILE><global rank>` (a pickle). An
    NCCL timeout dumps it there too. The pipe outlives its reader: a pipe nobody reads (ENXIO on opening it
    to write) is a rank whose process group 0 is gone, one in teardown.
  * gloo (and NCCL), in a4ray's own rank programs: each serves torch's c10d worker server on a Unix socket
    (`programs/distributed.py`), whose C++ `fr_trace_json` handler answers while the rank's Python is blocked
    in a collective. torch 2.13 records gloo collectives (`gloo:all_reduce`, collective_seq_id 1, 2, ...).
  * a user's program on gloo serves nothing: its stacks are the evidence (`hang.py`).
  * a rank that has ended: the record it left at exit (`runtime/rank_site/sitecustomize.py` writes
    `<EXIT_DUMP_ENV><global rank>`), the last collectives of a rank that ran out of work early.
Each rank without a record carries why (`NoRecord`): no pipe, timed out, process gone, in teardown. Only a
process gone says something about the rank; the others say only that it could not answer.

Matching: a4ray matches collective_seq_id per process group itself: in a group whose collective #S some
rank entered and did not finish, the members that never entered #S are the culprits. torch's own analyzer
(`torch.distributed.flight_recorder.components.builder.build_db`) is run over the same records for the hang report, and where it
refuses them the report says so: on gloo's it raises KeyError (the entries name the default group
"0"/"default_pg", its pg_config names it "", with no member ranks), so it cannot be the one that decides.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import errno
import http.client
import io
import json
import os
import pickle
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import psutil
from pydantic import BaseModel

from a4ray.observe.verdicts import Collective, DesyncSide
from a4ray.programs.record import fr_socket_path


EXIT_DUMP_ENV = "A4RAY_FR_EXIT_DUMP"  # where a rank's process leaves its record as it exits: <stem><RANK>
EXIT_DUMP_PREFIX = "exit_rank_"  # in the launch's flight-recorder/ directory
ENDED = "a4ray_ended"  # set in a record a rank left at its exit


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def fetch_json(path: str, timeout_s: float = 10) -> dict:
    """A rank's flight record from its worker server's `fr_trace_json` handler (POST, as torch's debug
    frontend asks it)."""
    conn = _UnixHTTP(path, timeout_s)
    try:
        conn.request("POST", "/handler/fr_trace_json")
        reply = conn.getresponse()
        body = reply.read()
        if reply.status != 200:
            raise OSError(f"fr_trace_json answered HTTP {reply.status}")
        return json.loads(body)
    finally:
        conn.close()


def read_dump(path: Path) -> dict:
    """An NCCL dump file (a pickle torch wrote for this launch's rank)."""
    with open(path, "rb") as f:
        return pickle.load(f)


def _inherited(pid: int, rank: str, by_pid: dict[int, str]) -> bool | None:
    """Whether the process carries `rank` because its parent does (a helper: a data-loader worker); None where it
    is gone."""
    try:
        return by_pid.get(psutil.Process(pid).ppid()) == rank
    except psutil.Error:
        return None


def rank_pids(processes: list[tuple[str, int]]) -> dict[int, int]:
    """Each global rank's own process, from (RANK, pid) of a launch's processes: a rank's data-loader workers and
    helpers inherit its RANK, and the rank is the one whose parent does not carry the same."""
    by_pid = {pid: rank for rank, pid in processes if rank.isdigit()}
    own: dict[int, int] = {}
    for pid, rank in sorted(by_pid.items()):
        if _inherited(pid, rank, by_pid) is False:
            own.setdefault(int(rank), pid)
    return own


def rank_labels(processes: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """(label, pid) of a launch's processes for their stacks: a rank's own process keeps its RANK; a helper that
    inherited it is `r<rank>:pid<pid>`, so its stack is never read as the rank's (a worker waiting on its queue
    while its rank waits in a collective would name an innocent rank)."""
    by_pid = {pid: rank for rank, pid in processes if rank.isdigit()}
    return [(f"r{rank}:pid{pid}" if rank.isdigit() and _inherited(pid, rank, by_pid) else rank, pid)
            for rank, pid in processes]


NoRecordReason = Literal["no pipe", "no server", "timed out", "process gone", "in teardown", "no answer from its node"]
_PRECEDENCE = ["process gone", "in teardown", "timed out", "no pipe", "no server", "no answer from its node"]


class NoRecord(BaseModel):
    """Why a rank gave no flight record. Only "process gone" is evidence about the rank (it exited, or a signal
    ended it); the others say that it could not answer, which a rank only slow to, or frozen, shares with the
    culprit."""

    reason: NoRecordReason
    detail: str = ""

    @property
    def evidence(self) -> bool:
        return self.reason == "process gone"

    def line(self) -> str:
        return f"{self.reason} ({self.detail})" if self.detail else self.reason


def collect(ranks: dict[int, int], expected: list[int], env: dict[str, str], sockets: Path, out_dir: Path,
            since: float, timeout_s: float = 10.0) -> dict[int, dict | NoRecord]:
    """Every rank's flight record on one node: global rank -> its record, or why there is none.

    `ranks`: the node's live rank processes (global rank -> pid); `expected`: the node's ranks (one not among
    `ranks` has exited); `env`: the launch's env (where the pipes and dumps are); `sockets`: where a4ray's
    programs serve theirs; `out_dir`: where the records are kept; `since`: when the launch started (an older dump
    is a previous launch's). Every rank is asked at once, through its debug pipe and its worker server; then
    this waits until each has a record, has gone, or `timeout_s` has passed."""
    found: dict[int, dict | NoRecord] = {}
    for rank in expected:  # a record left at exit: the rank's own process has ended (a child may carry its RANK on)
        left = _read_new_dump(env.get(EXIT_DUMP_ENV, ""), rank, since)
        if left is not None:
            found[rank] = {**left, ENDED: True}
        elif rank not in ranks and ranks:  # none found while the launch runs: the processes could not be read
            found[rank] = NoRecord(reason="process gone", detail="its process had exited (or a signal ended it) "
                                   "when the hang was judged")
    ranks = {rank: pid for rank, pid in ranks.items() if rank not in found}
    pipe_stem = env.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "")
    dump_stem = env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or ""
    failed: dict[int, list[NoRecord]] = {rank: [] for rank in ranks}
    piped: set[int] = set()
    for rank in ranks:
        reason = _write_pipe(pipe_stem, rank, env)
        if reason is None:
            piped.add(rank)
        else:
            failed[rank].append(reason)
    pool = ThreadPoolExecutor(max(1, min(16, len(ranks))))
    served: dict[int, Future] = {}
    for rank in ranks:
        path = fr_socket_path(str(sockets), rank)
        if os.path.exists(path):
            served[rank] = pool.submit(fetch_json, path, timeout_s)
        else:
            failed[rank].append(NoRecord(reason="no server", detail="no a4ray flight-record server: not an a4ray "
                                         "program"))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            for rank, pid in ranks.items():
                if isinstance(found.get(rank), dict):
                    continue
                future = served.get(rank)
                if future is not None and future.done():
                    served.pop(rank)
                    try:
                        found[rank] = record = future.result()
                        (out_dir / f"rank_{rank}.json").write_text(json.dumps(record))
                        continue
                    except (OSError, ValueError) as e:
                        failed[rank].append(_server_failed(e, timeout_s))
                record = _read_new_dump(dump_stem, rank, since)
                if record is not None:
                    found[rank] = record
                elif not _alive(pid):
                    failed[rank].append(NoRecord(reason="process gone", detail="its process ended while its "
                                                 "record was asked for"))
                    piped.discard(rank)
                    served.pop(rank, None)
            waiting = [r for r in ranks if not isinstance(found.get(r), dict) and (r in piped or r in served)]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    check_ms = env.get("TORCH_NCCL_COORD_CHECK_MILSEC", "1000")
    for rank in ranks:
        if isinstance(found.get(rank), dict):
            continue
        reasons = failed[rank]
        if rank in piped:
            reasons.append(NoRecord(reason="timed out", detail=f"no dump {timeout_s:g}s after its debug pipe was "
                                    f"written (its heartbeat thread reads it every {check_ms} ms while "
                                    "TORCH_NCCL_DUMP_ON_TIMEOUT is on)"))
        if rank in served:
            reasons.append(NoRecord(reason="timed out", detail=f"its flight-record server did not answer in "
                                    f"{timeout_s:g}s"))
        found[rank] = _why(reasons)
    return found


def _write_pipe(stem: str, rank: int, env: dict[str, str]) -> NoRecord | None:
    """Ask rank `rank` for a dump through its debug pipe; None once asked, else why it cannot be."""
    if not stem:
        return NoRecord(reason="no pipe", detail="TORCH_NCCL_DEBUG_INFO_PIPE_FILE is not set")
    pipe = Path(f"{stem}{rank}.pipe")
    if not pipe.exists():
        size = env.get("TORCH_FR_BUFFER_SIZE") or env.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or "0"
        return NoRecord(reason="no pipe", detail=f"no NCCL debug pipe: process group 0's heartbeat thread makes "
                        f"one in an NCCL rank with TORCH_FR_BUFFER_SIZE > 0 (here {size})")
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, b"1")
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno == errno.ENXIO:  # the pipe outlives its reader, process group 0's heartbeat thread
            return NoRecord(reason="in teardown", detail=f"nothing reads {pipe.name}: its process group 0 is gone")
        return NoRecord(reason="no pipe", detail=f"{pipe.name}: {e.strerror or e}")
    return None


def _read_new_dump(stem: str, rank: int, since: float) -> dict | None:
    path = Path(f"{stem}{rank}") if stem else None
    try:
        if path is None or path.stat().st_mtime < since:
            return None  # none yet, or a previous launch's
        return read_dump(path)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None  # not there yet, or being written: the next pass reads it


def _server_failed(e: Exception, timeout_s: float) -> NoRecord:
    if isinstance(e, (TimeoutError, socket.timeout)):
        return NoRecord(reason="timed out", detail=f"its flight-record server did not answer in {timeout_s:g}s")
    return NoRecord(reason="timed out", detail=f"its flight-record server failed ({type(e).__name__}: {e})")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _why(reasons: list[NoRecord]) -> NoRecord:
    """The reason that says most (a process gone over a pipe in teardown over a timeout over a missing pipe)."""
    reasons = sorted(reasons, key=lambda r: _PRECEDENCE.index(r.reason))
    if not reasons:
        return NoRecord(reason="no answer from its node")
    first = reasons[0]
    # A channel the rank does not have (a gloo rank's NCCL pipe) says nothing beside one that failed.
    rest = [r.line() for r in reasons[1:] if (r.reason != first.reason or r.detail != first.detail)
            and (r.reason not in ("no pipe", "no server") or first.reason in ("no pipe", "no server"))]
    return NoRecord(reason=first.reason, detail="; ".join(filter(None, [first.detail, *rest])))


class Match(BaseModel):
    """What the records say: the stuck collective, who waits in it, who never joined it, whose record is missing."""

    collective: Collective | None = None
    waiting: list[int] = []
    never_joined: list[int] = []
    missing: list[int] = []  # members of the stuck group with no record
    members: list[int] = []  # of the stuck group
    members_known: bool = False  # from the records' pg_config (NCCL's) or the default group, not inferred
    sides: list[DesyncSide] = []  # a desync at `collective`'s sequence number: who called what, the minority first
    waiting_since: float | None = None  # wall clock: when the first waiting rank entered the collective
    analyzer: str = ""
    note: str = ""


def _members(records: dict[int, dict], group: str, world: list[int]) -> tuple[list[int], bool]:
    """The group's global ranks: from pg_config where the record has them (NCCL's). gloo's records list none
    (`"ranks": "[]"`): then the ranks whose records show the group, and every rank without a record (which may
    be a member: only its stack can tell); the default group ("0") is the whole launch."""
    for record in records.values():
        config = record.get("pg_config") or {}
        entry = config.get(group)
        if entry is None and group == "0" and len(config) == 1:  # gloo's default group is keyed "" there
            entry = next(iter(config.values()))
        ranks = (entry or {}).get("ranks")
        ranks = ast.literal_eval(ranks) if isinstance(ranks, str) else ranks
        if ranks:
            return sorted(ranks), True
    if group == "0":
        return world, True
    showing = {r for r, record in records.items()
               if any(str((e.get("process_group") or [""])[0]) == group for e in record.get("entries") or [])}
    return sorted(showing | (set(world) - set(records))), False


def done(entry: dict, record: dict) -> bool:
    """Finished: its state says so, or its group's status counts it completed (gloo's entries stay "scheduled")."""
    group = str((entry.get("process_group") or [entry.get("pg_id", "0")])[0])
    return entry.get("state") == "completed" or bool(entry.get("retired")) or \
        entry.get("collective_seq_id", 0) <= _last_completed(record, group)


def _last_completed(record: dict, group: str) -> int:
    try:
        return int((record.get("pg_status") or {}).get(group, {}).get("last_completed_collective", 0))
    except (TypeError, ValueError, AttributeError):
        return 0


# Ops whose input sizes must agree on every rank (an all-to-all's and a gather's may differ by design).
_SAME_SIZES = {"all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "_allgather_base", "_reduce_scatter_base",
               "reduce_scatter_tensor", "allreduce", "allgather_into_tensor_coalesced"}


def _call(entry: dict) -> tuple[str, str]:
    """(what must agree across ranks, how it reads): the op, its dtypes, and its sizes where they must agree."""
    op = str(entry.get("profiling_name") or "").split(":")[-1]
    sizes = [list(s) for s in entry.get("input_sizes") or []]
    dtypes = [str(d) for d in entry.get("input_dtypes") or []]
    shown = " ".join(filter(None, [" ".join(map(str, sizes)), "/".join(dtypes)]))
    key = f"{op}|{dtypes}|{sizes if op in _SAME_SIZES else ''}"
    return key, f"{op} #{entry.get('collective_seq_id')}" + (f" ({shown})" if shown else "")


def desync(by_rank: dict[int, list[dict]]) -> tuple[int, list[DesyncSide]] | None:
    """The first sequence number of one group at which its ranks entered different collectives (another op, dtype,
    or size), and who called what, the smallest side first; None where every rank called the same ones."""
    at: dict[int, dict[int, dict]] = {}
    for rank, entries in by_rank.items():
        for e in entries:
            at.setdefault(e["collective_seq_id"], {})[rank] = e
    for seq in sorted(at):
        calls: dict[str, tuple[str, list[int]]] = {}
        for rank, entry in sorted(at[seq].items()):
            key, shown = _call(entry)
            calls.setdefault(key, (shown, []))[1].append(rank)
        if len(calls) > 1:
            sides = sorted((DesyncSide(ranks=ranks, call=shown) for shown, ranks in calls.values()),
                           key=lambda side: (len(side.ranks), side.ranks))
            return seq, sides
    return None


def match(records: dict[int, dict], world: list[int]) -> Match:
    """Match every rank's record (`records`: global rank -> its flight record) by collective_seq_id per
    process group; `world`: every rank of the launch (those without a record are missing)."""
    groups: dict[str, dict[int, list[dict]]] = {}
    for rank, record in records.items():
        for entry in record.get("entries") or []:
            if entry.get("is_p2p") or not entry.get("collective_seq_id"):
                continue
            group = str((entry.get("process_group") or [entry.get("pg_id", "0")])[0])
            groups.setdefault(group, {}).setdefault(rank, []).append(entry)
    desyncs = sorted((found[0], group, found[1]) for group, by_rank in groups.items() if (found := desync(by_rank)))
    stuck: list[tuple[int, str, dict]] = []
    for group, by_rank in groups.items():
        for rank, entries in by_rank.items():
            open_ = [e for e in entries if not done(e, records[rank])]
            if open_:
                first = min(open_, key=lambda e: e["collective_seq_id"])
                stuck.append((first["collective_seq_id"], group, first))
    if not stuck and not desyncs:
        return Match(analyzer="a4ray", missing=sorted(set(world) - set(records)),
                     note="every recorded collective had finished: the ranks are not blocked in a collective "
                     "the flight recorder saw")
    sides: list[DesyncSide] = []
    if desyncs:  # ranks that disagree on a collective: the first place they did is the root, whatever hangs later
        seq, group, sides = desyncs[0]
        entry = next(e for e in groups[group][sides[-1].ranks[0]] if e["collective_seq_id"] == seq)
    else:  # the group blocked longest: its lowest open collective (a rank waits there for the others)
        seq, group, entry = min(stuck, key=lambda s: (s[0], s[1]))
    members, known = _members(records, group, world)
    # The last collective each rank entered in the group: its entries', or its pg_status' where the ring buffer
    # (TORCH_FR_BUFFER_SIZE entries) no longer holds the group's entries.
    entered = {r: max([e["collective_seq_id"] for e in groups[group].get(r, [])] + [last_enqueued(records[r], group)])
               for r in records}
    open_at_seq = {r: e for r, entries in groups[group].items() for e in entries
                   if e["collective_seq_id"] == seq and not done(e, records[r])}
    waiting = sorted(open_at_seq)
    created = [e["time_created_ns"] / 1e9 for e in open_at_seq.values() if e.get("time_created_ns")]
    never = sorted(r for r in members if r in records and entered.get(r, 0) < seq)
    collective_ = collective(entry)
    return Match(collective=collective_, waiting=waiting, never_joined=never, members=members, members_known=known,
                 missing=sorted(r for r in members if r not in records), sides=sides,
                 waiting_since=min(created) if created else None, analyzer="a4ray (collective_seq_id per process "
                 "group)")


def collective(entry: dict) -> Collective:
    """The collective a record's entry names."""
    group, desc = [str(p) for p in (list(entry.get("process_group") or []) + [entry.get("pg_id", "0"), ""])[:2]]
    return Collective(group=group, group_desc="" if desc == "default_pg" else desc, seq=entry["collective_seq_id"],
                      op=entry.get("profiling_name", ""), input_sizes=entry.get("input_sizes") or [],
                      output_sizes=entry.get("output_sizes") or [])


def last_enqueued(record: dict, group: str) -> int:
    try:
        return int((record.get("pg_status") or {}).get(group, {}).get("last_enqueued_collective", 0))
    except (TypeError, ValueError, AttributeError):
        return 0


def analyze(records: dict[int, dict]) -> tuple[str, str]:
    """Run torch's own analyzer over the records, for the hang report: (whether it accepted them, or why a4ray
    matched them itself; what it printed: its findings come raw and unprefixed, several times over). Run after the
    verdict, never before it: its first import of torch costs the driver seconds (9 s on two loaded cores)."""
    try:
        from torch.distributed.flight_recorder.components.builder import build_db
    except ImportError:
        return "torch's flight-recorder analyzer is not in this torch (>= 2.10 has it)", ""
    details = {f"rank{r}": {**record, "rank": r} for r, record in records.items()}
    args = argparse.Namespace(verbose=False, just_print_entries=False, allow_incomplete_ranks=True,
                              mismatch_cap=10, selected_ranks=None, pg_filters=None, output=None)
    version = next(iter(records.values())).get("version", "") if records else ""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            build_db(details, args, version)
    except (KeyError, AssertionError, ValueError, TypeError, AttributeError, SystemExit) as e:
        return f"torch's analyzer refused these records ({type(e).__name__}: {str(e)[:80]})", printed.getvalue()
    return "torch's analyzer accepted these records", printed.getvalue()
