"""Reaper of one launch: waits for EOF on stdin (its owner closed the pipe or died), then kills the
launch's process group and every process carrying its launch id, and removes the launch's flight-recorder
pipe directory (the node actor makes one per launch; nothing reads it once the ranks are gone, and a node
actor ended with its gang can no longer remove it itself).

Usage (started by ManagedProcess, never by hand): python -m a4ray.runtime.reaper PGID LAUNCH_ID GRACE_S
"""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path


def flight_recorder_pipes(launch_id: str) -> Path:
    """Where a launch's ranks make their NCCL flight-recorder debug pipes and a4ray's programs their
    flight-record sockets: named pipes and sockets need a local filesystem, and a socket's path must stay short
    (108 bytes)."""
    return Path("/tmp") / f"a4ray-fr-{launch_id}"


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
