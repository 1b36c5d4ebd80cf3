"""The workspace's history of its nodes, across jobs: `<workspace>/nodes/<host>.jsonl`, one event a line
(when, what: lost, hang culprit, straggler, doctor failure; the run; why). It lives on the shared workspace,
so it outlives the Ray cluster and its jobs; a restart reads it to keep the next gang off a node that failed,
and the doctor, `a4ray status` and `a4ray nodes` show it. `a4ray nodes forget HOST` clears a host's.

A host is the node's machine as the topology names it (GKE's host label), else its hostname.

Beside the events, `_service.jsonl` records each launch's node time (its hosts, how long they ran): with the
failures among the events, the workspace's own node failure rate, which auto checkpoint intervals use
(`failure_rate`).
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

NodeEventKind = Literal["lost", "hang-culprit", "straggler", "doctor-failed"]
FAILURES: tuple[NodeEventKind, ...] = ("lost", "hang-culprit")  # a node's fault that ended a launch (not a slow node)
SERVICE = "_service"  # the file of node time served; no host's name starts with "_" (RFC 1123)
PUBLISHED_RATE = 6.50  # failures per 1000 node-days: Meta's RSC-1 (RSC-2: 2.34)
PRIOR_NODE_DAYS = 1000.0  # how much node time the published rate weighs as, against the workspace's own


class NodeEvent(BaseModel):
    date: str  # ISO 8601, UTC
    host: str
    event: NodeEventKind
    run: str = ""
    detail: str = ""

    def line(self) -> str:
        return f"{self.date[:19].replace('T', ' ')}  {self.event:<13} {self.run or '-'}  {self.detail}"


class Service(BaseModel):
    """One launch's node time: how long each of its hosts ran it, in seconds."""

    date: str
    run: str
    seconds: dict[str, float]


class FailureRate(BaseModel):
    """Each node's failure rate, per 1000 node-days, and where it comes from."""

    per_1000_node_days: float
    failures: int = 0  # in the workspace's history
    node_days: float = 0.0  # served, in the workspace's history

    @property
    def source(self) -> str:
        if not self.node_days:
            return "Meta's published RSC-1 rate; this workspace's node history has no node time yet"
        failures = f"{self.failures} node failure{'' if self.failures == 1 else 's'}"
        return (f"this workspace's node history, {failures} in {_node_time(self.node_days)}, "
                f"weighed with Meta's published {PUBLISHED_RATE:g} as {PRIOR_NODE_DAYS:g} node-days")


def _node_time(days: float) -> str:
    """"4,020 node-days", "5.5 node-hours", "42 node-seconds": node time as a person reads it."""
    if days >= 1:
        return f"{days:,.0f} node-days" if days >= 10 else f"{days:.1f} node-days"
    hours = days * 24
    return f"{hours:.2g} node-hours" if hours >= 0.1 else f"{days * 86400:.0f} node-seconds"


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
            if path.stem == SERVICE:
                continue
            for event in self.events(path.stem) or []:
                found.setdefault(event.host, []).append(event)
        return found

    def blamed(self) -> dict[str, str]:
        """The hosts a launch's end was blamed on (lost, a hang's culprit), each with its history in a line: where a
        new run's gang is not placed (cluster.keep_off_blamed) until `a4ray nodes forget HOST`."""
        return {host: f"{summarize(events)}; `a4ray nodes forget {host}` once repaired"
                for host, events in self.hosts().items() if any(e.event in FAILURES for e in events)}

    def served(self, seconds: dict[str, float], *, run: str = "") -> None:
        """Record how long each host ran a launch (the node time failures are counted against)."""
        seconds = {host: round(s, 3) for host, s in sorted(seconds.items()) if s > 0}
        if not seconds:
            return
        record = Service(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), run=run,
                         seconds=seconds)
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / f"{SERVICE}.jsonl", "a") as f:
            f.write(record.model_dump_json() + "\n")

    def failure_rate(self) -> FailureRate:
        """The nodes' failure rate from this workspace's history, Poisson with a Gamma prior: Meta's published rate
        counts as PRIOR_NODE_DAYS of node time, so a young history moves it a little and a long one decides it.
        Failures are the launches' ends a node was blamed for (lost, hang culprit); node time, what `served`
        recorded."""
        node_seconds = 0.0
        path = self.dir / f"{SERVICE}.jsonl"
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    service = Service.model_validate_json(line)
                except ValueError:
                    continue  # a line cut short by a crash
                node_seconds += sum(service.seconds.values())
        if not node_seconds:
            return FailureRate(per_1000_node_days=PUBLISHED_RATE)
        failures = sum(e.event in FAILURES for events in self.hosts().values() for e in events)
        node_days = node_seconds / 86400
        rate = (failures + PUBLISHED_RATE * PRIOR_NODE_DAYS / 1000) / (node_days + PRIOR_NODE_DAYS) * 1000
        return FailureRate(per_1000_node_days=rate, failures=failures, node_days=node_days)

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
