"""NCCL's RAS as a second witness on a hang. NCCL >= 2.24 runs its RAS service (reliability, availability,
serviceability) in every process; one of them per node answers clients on localhost:28028 (NCCL_RAS_ADDR,
`host:port`, moves it). This is a client for it, a parser of its `VERBOSE STATUS` text, and the mapping of the
processes it names (by node address and pid) to the launch's global ranks.

The protocol and the text are NCCL's own, read from src/ras/client.cc and src/ras/client_support.cc at
v2.28.9 (the GPU machine's NCCL): the client sends `CLIENT PROTOCOL 2` (answered `SERVER PROTOCOL 2`), `TIMEOUT
<s>` (answered `OK`: how long RAS gathers from its peers), then `VERBOSE STATUS`; the server writes its report
and closes the connection. The JSON form (`SET FORMAT json`, 2.28.7+) is not used: its `missing_ranks` is
malformed in 2.28.9.

What counts as evidence against a rank (`Finding.evidence`):
  * DEAD: the process is "considered dead (unreachable via the RAS network)";
  * a MISMATCH of operation counts: the rank launched fewer operations of a kind (AllReduce, ...) than others of
    its communicator did: it never launched the collective they wait in.
What does not, though it is reported: INCOMPLETE ("Missing communicator data from N rank(s)" or "job
process(es)": RAS heard nothing from the process, which a rank in teardown shows too), a rank's status
(FINALIZE, ABORT: what ranks do after a hang), and asynchronous errors (a peer's failure surfaces on every rank
as "Remote process error"). A hang in which every rank launched the same collective is invisible to the counts.
"""

from __future__ import annotations

import re
import socket
import time
from typing import Literal

import psutil
from pydantic import BaseModel

DEFAULT_ADDR = "localhost:28028"  # NCCL_RAS_CLIENT_PORT (ras_internal.h)
PROTOCOL = 2  # NCCL_RAS_CLIENT_PROTOCOL
_GATHER_S = 1  # `TIMEOUT`: how long RAS waits on each leg of its query to its peers (NCCL's default: 5)

FindingKind = Literal["dead", "unresponsive", "missing-ops", "status", "error"]


class Finding(BaseModel):
    """One process or rank RAS named, and what it said of it."""

    kind: FindingKind
    detail: str  # e.g. "launched up to AllReduce operation 2 while ranks of its communicator launched up to 3"
    comm: str = ""  # "#0-0 (8ac639d88b72043d)": RAS's group-index of the communicator and its hash; "" job-wide
    comm_rank: int | None = None
    gpu: str = ""
    pid: int | None = None
    host: str = ""  # the node's address as RAS knows it

    @property
    def evidence(self) -> bool:
        return self.kind in ("dead", "missing-ops")

    def describe(self) -> str:
        where = f"process {self.pid} on {self.host or '?'}" if self.pid is not None else "process unknown to RAS"
        gpu = f", GPU {self.gpu}" if self.gpu else ""
        comm = f" in communicator {self.comm}" if self.comm else ""
        return f"{self.detail}{comm} (NCCL RAS: {where}{gpu})"


class Report(BaseModel):
    version: str = ""  # "NCCL version 2.28.9+cuda12.9 compiled with CUDA 12.9"
    findings: list[Finding] = []
    complete: bool = False  # RAS's whole answer was read (its "Warnings" section came)


# The lines of client_support.cc's rasClientRunComms (v2.28.9), as its format strings make them.
_COMM = re.compile(r"^#(\d+)-(\d+) \(([0-9a-f]+)\) (INCOMPLETE|ERROR|MISMATCH)$")
_PROCESS = re.compile(r"^  Process (\d+) on node (\S*) managing GPUs? (.*)$")
_WHO = r" -- (?:GPU (?P<gpu>.+?) managed by process (?P<pid>\d+) on node (?P<host>\S*)|\[process information not found\])$"
_RANK = re.compile(r"^  Rank (?P<rank>\d+)(?P<what>| has status (?P<status>\w+)| has launched up to operation "
                   r"(?P<ops>\d+)| has not launched any operations| reported (?P<error>.+?))" + _WHO)
_GROUP_STATUS = re.compile(r"^  \d+ ranks have status (\w+)$")
_GROUP_OPS = re.compile(r"^  \d+ ranks have launched up to operation (\d+)$")
_GROUP_NO_OPS = re.compile(r"^  \d+ ranks have not launched any operations$")
_GROUP_ERROR = re.compile(r"^  \d+ ranks reported (.+)$")
_DIFFERENT_OPS = re.compile(r"^  Communicator ranks have different (\S+) operation counts$")


def parse(text: str) -> Report:
    """The processes and ranks RAS's `VERBOSE STATUS` text names (see the module's doc for which are evidence)."""
    report = Report()
    block = ""  # "INCOMPLETE" / "DEAD" (job-wide), or a communicator's: "comm INCOMPLETE|ERROR|MISMATCH"
    comm = ""
    sub = ""  # inside a MISMATCH: "status", or the operation whose counts differ ("AllReduce")
    value: str | int | None = None  # the current group's status, operation count or error
    ops: dict[tuple[str, str], list[tuple[int, Finding]]] = {}  # (comm, op) -> (count, the rank)
    groups: dict[tuple[str, str], dict[int, int]] = {}  # (comm, op) -> count -> ranks, where RAS lists none
    for line in text.splitlines():
        line = line.rstrip("\r")
        if line.startswith("NCCL version "):
            report.version = line
        elif line in ("Errors", "Warnings"):
            report.complete = report.complete or line == "Warnings"
            block, comm = "", ""
        elif line in ("INCOMPLETE", "DEAD"):
            block, comm = line, ""
        elif m := _COMM.match(line):
            block, comm, sub, value = f"comm {m.group(4)}", f"#{m.group(1)}-{m.group(2)} ({m.group(3)})", "", None
        elif (m := _PROCESS.match(line)) and block in ("INCOMPLETE", "DEAD"):
            dead = block == "DEAD"
            report.findings.append(Finding(
                kind="dead" if dead else "unresponsive", pid=int(m.group(1)), host=m.group(2), gpu=m.group(3),
                detail="considered dead by NCCL (unreachable via the RAS network)" if dead else
                "sent RAS no communicator data (unresponsive, or in teardown)"))
        elif block.startswith("comm "):
            if line == "  Communicator ranks have different status":
                sub, value = "status", None
            elif m := _DIFFERENT_OPS.match(line):
                sub, value = m.group(1), None
            elif m := (_GROUP_STATUS.match(line) or _GROUP_ERROR.match(line)):
                value = m.group(1)
            elif m := _GROUP_OPS.match(line):
                value = int(m.group(1))
                groups.setdefault((comm, sub), {})[value] = int(line.split()[0])
            elif _GROUP_NO_OPS.match(line):
                value = 0
                groups.setdefault((comm, sub), {})[value] = int(line.split()[0])
            elif m := _RANK.match(line):
                finding = _rank_finding(m, block, comm, sub, value)
                if finding is None:
                    continue
                if finding.kind == "missing-ops":
                    count = int(m.group("ops") or 0) if m.group("what") else int(value or 0)
                    ops.setdefault((comm, sub), []).append((count, finding))
                else:
                    report.findings.append(finding)
    for (comm, op), ranks in ops.items():
        # The most frequent count has its ranks listed only where they are few (RAS's outliers): its header counts.
        top = max([count for count, _ in ranks] + list(groups.get((comm, op), {})))
        ahead = sorted(f.comm_rank for count, f in ranks if count == top and f.comm_rank is not None)
        for count, finding in ranks:
            if count < top:  # behind its communicator: it never launched what the others wait in
                launched = f"launched up to {op} operation {count}" if count else f"launched no {op} operation"
                peers = (f"rank(s) {', '.join(map(str, ahead))}" if ahead else
                         f"{groups.get((comm, op), {}).get(top, 'other')} ranks")
                finding.detail = f"{launched} while {peers} of its communicator launched up to {top}"
                report.findings.append(finding)
    return report


def _rank_finding(m: re.Match, block: str, comm: str, sub: str, value) -> Finding | None:
    who = {"comm": comm, "comm_rank": int(m.group("rank")), "gpu": m.group("gpu") or "",
           "pid": int(m.group("pid")) if m.group("pid") else None, "host": m.group("host") or ""}
    if block == "comm INCOMPLETE":
        return Finding(kind="unresponsive", detail="sent RAS no data on its communicator (unresponsive, or in "
                       "teardown)", **who)
    if block == "comm ERROR":
        return Finding(kind="error", detail=f"reported {m.group('error') or value}", **who)
    if block == "comm MISMATCH" and sub == "status":
        return Finding(kind="status", detail=f"has status {m.group('status') or value} in its communicator", **who)
    if block == "comm MISMATCH" and sub:
        return Finding(kind="missing-ops", detail="", **who)  # the detail once every count of the op is read
    return None


def split_addr(addr: str) -> tuple[str, int]:
    """NCCL_RAS_ADDR's `host:port` (`[v6]:port`)."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"NCCL_RAS_ADDR={addr!r} is not host:port")
    return host.strip("[]"), int(port)


def query(addr: str = DEFAULT_ADDR, timeout_s: float = 3.0) -> str:
    """RAS's `VERBOSE STATUS` text from `addr`, read until RAS closes the connection or `timeout_s` has passed
    (then what came so far). Raises OSError where nothing listens or it is not RAS."""
    host, port = split_addr(addr)
    deadline = time.monotonic() + timeout_s
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        reader = _Lines(conn, deadline)
        conn.sendall(f"CLIENT PROTOCOL {PROTOCOL}\n".encode())
        answer = reader.line()
        if not answer.upper().startswith("SERVER PROTOCOL"):
            raise OSError(f"not NCCL's RAS on {addr}: it answered {answer[:60]!r}")
        conn.sendall(f"TIMEOUT {_GATHER_S}\n".encode())
        if reader.line().strip() != "OK":
            raise OSError(f"NCCL's RAS on {addr} refused TIMEOUT {_GATHER_S}")
        conn.sendall(b"VERBOSE STATUS\n")
        return reader.rest()


class _Lines:
    def __init__(self, conn: socket.socket, deadline: float):
        self.conn, self.deadline, self.buffer = conn, deadline, b""

    def _recv(self) -> bytes:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        self.conn.settimeout(left)
        return self.conn.recv(65536)

    def line(self) -> str:
        while b"\n" not in self.buffer:
            chunk = self._recv()
            if not chunk:
                raise OSError("RAS closed the connection during the handshake")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode(errors="replace")

    def rest(self) -> str:
        try:
            while chunk := self._recv():
                self.buffer += chunk
        except (TimeoutError, socket.timeout):
            pass  # what came so far (RAS gathers from its peers for up to twice its TIMEOUT)
        return self.buffer.decode(errors="replace")


class NodeRas(BaseModel):
    """What one node's RAS said (or why nothing), with what maps the processes it names to global ranks."""

    node: int  # launch rank of the node
    address: str  # where it was asked
    report: Report | None = None
    why: str = ""  # why there is no report
    host_addresses: list[str] = []  # the node's IP addresses: RAS names a process by its node's address
    pids: dict[int, int] = {}  # global rank -> pid, this node's ranks


def ask(node: int, ranks: dict[int, int], env_addr: str | None = None, timeout_s: float = 3.0) -> NodeRas:
    """Ask this node's RAS (at NCCL_RAS_ADDR, `env_addr`, else localhost:28028), bounded by `timeout_s`."""
    addr = env_addr or DEFAULT_ADDR
    out = NodeRas(node=node, address=addr, pids=ranks, host_addresses=_addresses())
    try:
        text = query(addr, timeout_s)
    except ValueError as e:
        out.why = str(e)
    except ConnectionRefusedError:
        out.why = f"RAS not listening on {addr} (NCCL < 2.24, NCCL_RAS_ENABLE=0, or no NCCL process on the node)"
    except (TimeoutError, socket.timeout):
        out.why = f"RAS on {addr} did not answer within {timeout_s:g}s"
    except OSError as e:
        out.why = f"RAS on {addr}: {e.strerror or e}"
    else:
        out.report = parse(text)
        if not out.report.version and not out.report.findings:
            out.report, out.why = None, f"RAS on {addr} sent no status ({len(text)} bytes)"
    return out


def _addresses() -> list[str]:
    found = {"127.0.0.1", "::1"}
    for addrs in psutil.net_if_addrs().values():
        found.update(a.address.split("%", 1)[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    return sorted(found)


def attribute(answers: list[NodeRas]) -> tuple[dict[int, Finding], str]:
    """The findings of every node's RAS by global rank (a process is known by its node's address and its pid), and
    one line saying what RAS said, or why it was not heard."""
    by_process: dict[tuple[str, int], int] = {}
    for answer in answers:
        for rank, pid in answer.pids.items():
            for address in answer.host_addresses:
                by_process[(address, pid)] = rank
    heard = [a for a in answers if a.report is not None]
    if not heard:
        whys = sorted({a.why for a in answers if a.why}) or ["no node was asked"]
        return {}, f"NCCL RAS not heard: {'; '.join(whys)}"
    found: dict[int, Finding] = {}
    unmapped: list[Finding] = []
    for answer in heard:
        for finding in answer.report.findings:
            rank = by_process.get((finding.host, finding.pid)) if finding.pid is not None else None
            if rank is None:
                unmapped.append(finding)
            elif rank not in found or (finding.evidence and not found[rank].evidence):
                found[rank] = finding  # evidence wins over a mere status of the same rank
    named = [f"rank {r} {f.detail}" + ("" if f.evidence else " (not evidence)") for r, f in sorted(found.items())]
    others = {(f.kind, f.host, f.pid, f.comm): f for f in unmapped}.values()  # every node's RAS says the same
    named += [f"{f.describe()}, not one of this launch's ranks" for f in list(others)[:3]]
    said = "; ".join(named) or "no dead rank, no operation count behind its communicator's"
    version = heard[0].report.version.removeprefix("NCCL version ").split(" compiled", 1)[0] or "version unknown"
    return found, f"NCCL RAS ({version}): {said}"
