"""PyTorch's flight recorder on a hang: every rank's record of its collectives, fetched on its node, and
matched across ranks into "which collective is stuck, and which ranks never joined it".

Getting a rank's record (on its node, by the node actor):
  * NCCL: writing to the rank's debug pipe (`TORCH_NCCL_DEBUG_INFO_PIPE_FILE<rank>`) makes its watchdog
    thread dump the record to `TORCH_FR_DUMP_TEMP_FILE<rank>` (a pickle); an NCCL timeout dumps it too
    (`TORCH_NCCL_DUMP_ON_TIMEOUT`).
  * gloo (and NCCL), in a4ray's own rank programs: each serves torch's c10d worker server on a Unix socket
    (`programs/distributed.py`), whose C++ `fr_trace_json` handler answers while the rank's Python is blocked
    in a collective. torch 2.13 records gloo collectives (`gloo:all_reduce`, collective_seq_id 1, 2, ...).
  * a user's program on gloo serves nothing: its stacks are the evidence (`hang.py`).

Matching: a4ray matches collective_seq_id per process group itself: in a group whose collective #S some
rank entered and did not finish, the members that never entered #S are the culprits. torch's own analyzer
(`torch.distributed.flight_recorder.components.builder.build_db`) is run over the same records, and where it
refuses them the verdict says so: on gloo's it raises KeyError (the entries name the default group
"0"/"default_pg", its pg_config names it "", with no member ranks), so it cannot be the one that decides.
"""

from __future__ import annotations

import argparse
import ast
import http.client
import json
import pickle
import socket
from pathlib import Path

from pydantic import BaseModel

from a4ray.observe.verdicts import Collective


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


class Match(BaseModel):
    """What the records say: the stuck collective, who waits in it, who never joined it, whose record is missing."""

    collective: Collective | None = None
    waiting: list[int] = []
    never_joined: list[int] = []
    missing: list[int] = []  # members of the stuck group with no record
    members: list[int] = []  # of the stuck group
    members_known: bool = False  # from the records' pg_config (NCCL's) or the default group, not inferred
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


def _done(entry: dict) -> bool:
    return entry.get("state") == "completed" or bool(entry.get("retired"))


def match(records: dict[int, dict], world: list[int]) -> Match:
    """Match every rank's record (`records`: global rank -> its flight record) by collective_seq_id per
    process group; `world`: every rank of the launch (those without a record are missing)."""
    torch_note = _torch_analyzer(records)
    groups: dict[str, dict[int, list[dict]]] = {}
    for rank, record in records.items():
        for entry in record.get("entries") or []:
            if entry.get("is_p2p") or not entry.get("collective_seq_id"):
                continue
            group = str((entry.get("process_group") or [entry.get("pg_id", "0")])[0])
            groups.setdefault(group, {}).setdefault(rank, []).append(entry)
    stuck: list[tuple[int, str, dict]] = []
    for group, by_rank in groups.items():
        for entries in by_rank.values():
            open_ = [e for e in entries if not _done(e)]
            if open_:
                first = min(open_, key=lambda e: e["collective_seq_id"])
                stuck.append((first["collective_seq_id"], group, first))
    if not stuck:
        return Match(analyzer="a4ray", missing=sorted(set(world) - set(records)),
                     note="every recorded collective had finished: the ranks are not blocked in a collective "
                     "the flight recorder saw" + torch_note)
    # The group blocked longest: its lowest open collective (a rank waits there for the others).
    seq, group, entry = min(stuck, key=lambda s: (s[0], s[1]))
    members, known = _members(records, group, world)
    # The last collective each rank entered in the group: its entries', or its pg_status' where the ring buffer
    # (TORCH_FR_BUFFER_SIZE entries) no longer holds the group's entries.
    entered = {r: max([e["collective_seq_id"] for e in groups[group].get(r, [])] + [_last_enqueued(records[r], group)])
               for r in records}
    waiting = sorted(r for r, entries in groups[group].items()
                     if any(e["collective_seq_id"] == seq and not _done(e) for e in entries))
    never = sorted(r for r in members if r in records and entered.get(r, 0) < seq)
    desc = str((entry.get("process_group") or ["", ""])[1] or "")
    collective = Collective(group=group, group_desc="" if desc == "default_pg" else desc, seq=seq,
                            op=entry.get("profiling_name", ""), input_sizes=entry.get("input_sizes") or [],
                            output_sizes=entry.get("output_sizes") or [])
    return Match(collective=collective, waiting=waiting, never_joined=never, members=members, members_known=known,
                 missing=sorted(r for r in members if r not in records), analyzer="a4ray (collective_seq_id per "
                 "process group)", note=torch_note.lstrip("; "))


def _last_enqueued(record: dict, group: str) -> int:
    try:
        return int((record.get("pg_status") or {}).get(group, {}).get("last_enqueued_collective", 0))
    except (TypeError, ValueError, AttributeError):
        return 0


def _torch_analyzer(records: dict[int, dict]) -> str:
    """Run torch's analyzer over the records; "" when it accepts them, else why a4ray matched them itself."""
    try:
        from torch.distributed.flight_recorder.components.builder import build_db
    except ImportError:
        return "; torch's flight-recorder analyzer is not in this torch (>= 2.10 has it)"
    details = {f"rank{r}": {**record, "rank": r} for r, record in records.items()}
    args = argparse.Namespace(verbose=False, just_print_entries=False, allow_incomplete_ranks=True,
                              mismatch_cap=10, selected_ranks=None, pg_filters=None, output=None)
    version = next(iter(records.values())).get("version", "") if records else ""
    try:
        build_db(details, args, version)
    except (KeyError, AssertionError, ValueError, TypeError, AttributeError, SystemExit) as e:
        return f"; torch's analyzer refused these records ({type(e).__name__}: {str(e)[:80]})"
    return ""
