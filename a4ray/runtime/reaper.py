"""Reaper of one launch: waits for EOF on stdin (its owner closed the pipe or died), then kills the
launch's process group and every process carrying its launch id, and removes the launch's flight-recorder
pipe directory (the node actor makes one per launch; nothing reads it once the ranks are gone, and a node
actor ended with its gang can no longer remove it itself). Where the reaper was killed too, the next node actor
on the host and `a4ray local down` remove it (`sweep_flight_recorder_pipes`).

Usage (started by ManagedProcess, never by hand): python -m a4ray.runtime.reaper PGID LAUNCH_ID GRACE_S
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

from a4ray.core.liveness import start_mark, still_running


def flight_recorder_pipes(launch_id: str) -> Path:
    """Where a launch's ranks make their NCCL flight-recorder debug pipes and a4ray's programs their
    flight-record sockets: named pipes and sockets need a local filesystem, and a socket's path must stay short
    (108 bytes)."""
    return Path("/tmp") / f"a4ray-fr-{launch_id}"


_OWNER = ".owner"  # in a launch's pipe directory: the process that made it (host, pid, its start time)


def make_flight_recorder_pipes(launch_id: str) -> Path:
    """The launch's pipe directory, made by this process (the node actor), which it records as its owner."""
    pipes = flight_recorder_pipes(launch_id)
    pipes.mkdir(parents=True, exist_ok=True)
    (pipes / _OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": start_mark()}))
    return pipes


def sweep_flight_recorder_pipes() -> list[Path]:
    """Remove the pipe directories whose owner is gone (a node actor killed with its gang cannot remove its own,
    nor can its reaper when killed with it); returns them. Other test workers, clusters and users share /tmp, so
    a directory goes only if its owner is recorded, on this host, and no process of that pid started at that time
    lives (pids are reused). One without a record (being made, or another version's) or another host's is left."""
    removed = []
    for pipes in Path("/tmp").glob("a4ray-fr-*"):
        try:
            owner = json.loads((pipes / _OWNER).read_text())
            if owner["host"] != socket.gethostname() or still_running(owner["pid"], owner["started"]):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue  # no record, one that is being written, or an owner we may not look at: not ours to judge
        shutil.rmtree(pipes, ignore_errors=True)
        removed.append(pipes)
    return removed


def main(argv: list[str]) -> int:
    pgid, launch_id, grace_s = int(argv[0]), argv[1], float(argv[2])
    # Our own session: a SIGTERM/SIGINT sent to the owner's group must not stop the clean-up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    from a4ray.runtime.process import terminate_launch

    terminate_launch(pgid, launch_id, grace_s)
    shutil.rmtree(flight_recorder_pipes(launch_id), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
