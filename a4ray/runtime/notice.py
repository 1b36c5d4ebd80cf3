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

Where a full save would not finish within the grace period (the trainer's last measured save against the time left),
the trainer copies its newest local checkpoint to shared storage instead, if it is newer than the newest persistent
one: fewer iterations are kept, but some are, where the full save would have been cut off.

`SAVED_ON_NOTICE` is the line the trainer prints once the checkpoint is complete; the supervisor takes the
iteration from it as the run's evidence. The trainer then ends with `NOTICE_EXIT_CODE`, so that a notice no cancel
asked for (below) reads as what it is, not as a run that finished.

On A4 a pod's deletion (GKE's maintenance and preemption notices come the same way) sends SIGTERM to `ray start` in
its container, and Ray then kills its workers: the notice must come first. The rendered worker pods run
`python -m a4ray.runtime.notice --grace-s N` as their preStop hook (k8s/render.py): it gives every a4ray launch's
ranks in the pod the notice and waits, up to N seconds, for them to save and end; the pod's
terminationGracePeriodSeconds covers it (cluster.notice_grace_s). The gang sees the node's ranks end with
NOTICE_EXIT_CODE, and its restart resumes from the checkpoint they saved.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys

import psutil

from a4ray.runtime.process import LAUNCH_ID_VAR, launch_processes, rank_processes, wait_gone

NOTICE_SIGNAL = signal.SIGUSR1
NOTICE_EXIT_CODE = 75  # EX_TEMPFAIL: saved, ended, to be resumed
# a4ray.mcore's words: "saved checkpoint iteration 7 on notice (SIGUSR1) to <dir> in 0.31s", or, where a full save
# would not finish within the grace period, "persisted local checkpoint iteration 5 on notice (SIGUSR1) to <dir> ..."
SAVED_ON_NOTICE = re.compile(r"(?:saved|persisted local) checkpoint iteration (\d+) on notice")


def give_notice(pgid: int, launch_id: str) -> int:
    """Send the notice to every rank of the launch; returns how many ranks got it."""
    ranks = rank_processes(launch_processes(pgid, launch_id))
    for proc in ranks:
        try:
            proc.send_signal(NOTICE_SIGNAL)
        except psutil.Error:
            pass
    return len(ranks)


def _launches(launch_id: str | None) -> list[psutil.Process]:
    """Every process of an a4ray launch on this machine (a pod: its container's), or of launch `launch_id`."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(LAUNCH_ID_VAR) is not None and launch_id in (None, proc.environ()[LAUNCH_ID_VAR]):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def main(argv: list[str] | None = None) -> int:
    """The worker pods' preStop hook: give every launch's ranks here the notice, wait for them to end."""
    parser = argparse.ArgumentParser(prog="python -m a4ray.runtime.notice", description=main.__doc__)
    parser.add_argument("--grace-s", type=float, default=300, help="how long to wait for the ranks to save and end")
    parser.add_argument("--launch-id", help="only this launch's ranks (default: every a4ray launch here)")
    args = parser.parse_args(argv)
    ranks = rank_processes(_launches(args.launch_id))
    for proc in ranks:
        try:
            proc.send_signal(NOTICE_SIGNAL)
        except psutil.Error:
            pass
    print(f"a4ray notice: {len(ranks)} rank(s) told to save and end (SIGUSR1)", flush=True)
    left = wait_gone(ranks, args.grace_s)
    print(f"a4ray notice: {len(ranks) - len(left)} ended, {len(left)} still running after {args.grace_s:g}s"
          if left else f"a4ray notice: every rank ended", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
