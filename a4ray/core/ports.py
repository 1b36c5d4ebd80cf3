"""Ports a4ray listens on: one chooser for the rendezvous, the dashboard's agent, Prometheus and the tests.

A port asked of the kernel (bind to 0) comes from the ephemeral range, the same range the kernel hands to
every outgoing connection: between choosing it and listening on it, a busy node's Ray processes may take it
as a connection's local port (EADDRINUSE). So a4ray picks below that range (`/proc/sys/net/ipv4/
ip_local_port_range`) and above Ray's worker ports (10002-19999 by default), where only listeners go.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOW = 20000
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def is_free(port: int, host: str = "") -> bool:
    """Whether `port` can be listened on at `host` ("" is every address) now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "") -> int:
    """A port free at `host` now, below the ephemeral range, so nothing but another listener can take it."""
    high = max(_ephemeral_start(), LOW + 1000)
    for port in random.sample(range(LOW, high), min(500, high - LOW)):
        if is_free(port, host):
            return port
    raise OSError(f"no free port in {LOW}-{high} on {socket.gethostname()}: close listeners or widen the range")
