"""A stop with notice: the ranks save at the iteration they reached, then end.

A cancel (Ctrl-C, `ray job stop`, SIGTERM to `a4ray run`'s group) is a stop the ranks can prepare for, unlike a
fault, whose peers block on the dead or stuck rank. For a launch whose trainer saves on notice (`Launch.
saves_on_notice`: a4ray's Megatron trainer with `--exit-signal-handler`), the node sends `NOTICE_SIGNAL` to each of
its rank processes (`give_notice`) and waits, up to the notice's grace period, for the launch to end by itself;
the stop that follows finds nothing left, or ends what did not finish in time.

The notice is SIGUSR1, not SIGTERM: a fault's stop sends SIGTERM, and a rank blocked in a collective with a dead
peer never reaches the end of its iteration to act on a flag; SIGTERM keeps ending it at once (a trainer without
a handler ends on SIGUSR1 too, its default action). Only the ranks' own processes get it: their forked helpers (a
data-loader worker, an async save's writer) inherit RANK but not the handler's purpose.

`SAVED_ON_NOTICE` is the line the trainer prints once the checkpoint is complete; the supervisor takes the
iteration from it as the run's evidence.
"""

from __future__ import annotations

import re
import signal

import psutil

from a4ray.runtime.process import launch_processes

NOTICE_SIGNAL = signal.SIGUSR1
# a4ray.mcore's words ("saved checkpoint iteration 7 on notice (SIGUSR1) to <dir> in 0.31s")
SAVED_ON_NOTICE = re.compile(r"saved checkpoint iteration (\d+) on notice")


def rank_processes(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The ranks among a launch's processes: RANK and LOCAL_RANK in their env, and a parent that is not a rank."""
    ranks = {}
    for proc in procs:
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if "RANK" in env and "LOCAL_RANK" in env:
            ranks[proc.pid] = proc
    mains = []
    for pid, proc in ranks.items():
        try:
            if proc.ppid() not in ranks:
                mains.append(proc)
        except psutil.Error:
            continue
    return mains


def give_notice(pgid: int, launch_id: str) -> int:
    """Send the notice to every rank of the launch; returns how many ranks got it."""
    ranks = rank_processes(launch_processes(pgid, launch_id))
    for proc in ranks:
        try:
            proc.send_signal(NOTICE_SIGNAL)
        except psutil.Error:
            pass
    return len(ranks)
