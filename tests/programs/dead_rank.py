"""A rank program for the dead-rank tests: every rank says it is up; the victim rank starts two helpers, one
that inherits its stdout (as megatron-core's checkpoint worker or a data loader worker does) and one that
leaves its process group with `setsid` (a double fork), then is SIGKILLed (as the kernel's OOM killer would);
every other rank blocks without error and prints nothing, as NCCL peers of a dead rank do.

    python dead_rank.py VICTIM_RANK MARKER     (MARKER: a word in the helpers' command lines, for `ps`)
"""

import os
import signal
import subprocess
import sys
import time

victim, marker = int(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
print(f"rank {rank} up", flush=True)
if rank != victim:
    time.sleep(3600)  # blocked in a collective with the dead rank: no error, no output
    sys.exit(0)

helper = [sys.executable, "-c", "import sys, time; time.sleep(3600)", marker]
subprocess.Popen(helper)  # inherits stdout: holds the rank's pipe open after the rank is gone
if os.fork() == 0:  # a double fork out of the rank's group and session
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, helper + ["setsid"])
    os._exit(0)
os.wait()
print(f"rank {rank}: helpers started; the last line before the kill", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
