"""Ports a4ray listens on: one chooser for the rendezvous, the dashboard's agent, Prometheus and the tests; and
one wait for what listens on them to answer (`wait_http`).

A port asked of the kernel (bind to 0) comes from the ephemeral range, the same range the kernel hands to
every outgoing connection: between choosing it and listening on it, a busy node's Ray processes may take it
as a connection's local port (EADDRINUSE). So a4ray picks below that range (`/proc/sys/net/ipv4/
ip_local_port_range`) and above Ray's worker ports (10002-19999 by default), where only listeners go.
"""

from __future__ import annotations

import random
import socket
import time
import urllib.request
from collections.abc import Callable
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


def wait_http(url: str, within_s: float, *, still: Callable[[], bool] = lambda: True) -> str | None:
    """Ask `url` every 0.5 s until it answers 200, `within_s` has passed, or `still()` says its server is gone.
    Returns None once it answered, else why not (the last error)."""
    deadline = time.monotonic() + within_s
    why = "not asked"
    while still():
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return None
                why = f"HTTP {reply.status}"
        except OSError as e:
            why = str(e)
        if time.monotonic() >= deadline:
            return why
        time.sleep(0.5)
    return "its server is gone"
