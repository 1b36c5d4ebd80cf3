"""The workspace's history of its nodes, across jobs: `<workspace>/nodes/<host>.jsonl`, one event a line
(when, what: lost, hang culprit, straggler, doctor failure; the run; why). It lives on the shared workspace,
so it outlives the Ray cluster and its jobs; a restart reads it to keep the next gang off a node that failed,
and the doctor, `a4ray status` and `a4ray nodes` show it. `a4ray nodes forget HOST` clears a host's.

A host is the node's machine as the topology names it (GKE's host label), else its hostname.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

NodeEventKind = Literal["lost", "hang-culprit", "straggler", "doctor-failed"]


class NodeEvent(BaseModel):
    date: str  # ISO 8601, UTC
    host: str
    event: NodeEventKind
    run: str = ""
    detail: str = ""

    def line(self) -> str:
        return f"{self.date[:19].replace('T', ' ')}  {self.event:<13} {self.run or '-'}  {self.detail}"


def _file_name(host: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", host) + ".jsonl"


class NodeHistory:
    def __init__(self, workspace: Path | str):
        self.dir = Path(workspace) / "nodes"

    def add(self, host: str, event: NodeEventKind, *, run: str = "", detail: str = "") -> NodeEvent:
        record = NodeEvent(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           host=host, event=event, run=run, detail=detail)
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / _file_name(host), "a") as f:  # one short line: appends from several drivers interleave whole
            f.write(record.model_dump_json() + "\n")
        return record

    def events(self, host: str) -> list[NodeEvent]:
        path = self.dir / _file_name(host)
        if not path.is_file():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(NodeEvent.model_validate_json(line))
            except ValueError:
                continue  # a line cut short by a crash: the others still count
        return out

    def hosts(self) -> dict[str, list[NodeEvent]]:
        """Every host with a history, and its events (oldest first)."""
        if not self.dir.is_dir():
            return {}
        found: dict[str, list[NodeEvent]] = {}
        for path in sorted(self.dir.glob("*.jsonl")):
            for event in self.events(path.stem) or []:
                found.setdefault(event.host, []).append(event)
        return found

    def forget(self, host: str) -> int:
        """Clear `host`'s history; returns how many events it held."""
        events = self.events(host)
        (self.dir / _file_name(host)).unlink(missing_ok=True)
        return len(events)


def summarize(events: list[NodeEvent]) -> str:
    """"2 lost, 1 hang-culprit (last 2026-11-25 04:55: ...)" for one host."""
    if not events:
        return "no history"
    counts: dict[str, int] = {}
    for e in events:
        counts[e.event] = counts.get(e.event, 0) + 1
    last = events[-1]
    return (", ".join(f"{n} {kind}" for kind, n in counts.items())
            + f" (last {last.date[:16].replace('T', ' ')}: {last.event} in {last.run or '-'}: {last.detail})")
