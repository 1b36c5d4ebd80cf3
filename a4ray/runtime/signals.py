"""Signals a job driver must handle itself."""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def sigterm_as_interrupt():
    """`ray job stop` sends SIGTERM: treat it like Ctrl-C so the gang is stopped cleanly. Installed after
    `ray.init`, which sets a SIGTERM handler of its own that would exit without stopping the gang."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
