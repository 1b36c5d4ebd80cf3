"""An MPI program for the MPI-through-Ray tests: each rank reports where it runs and an allreduce.

Modes (argv[1]): `report` (default) prints one A4RAY_RESULT line per rank and exits 0; `fail R` makes
rank R die with exit code 3 after the allreduce (without MPI_Finalize, as a crash would); `hang` prints
`ready <rank>` and sleeps (to be killed).
"""

import json
import os
import sys
import time

from mpi4py import MPI


def say(text: str) -> None:
    # One write per line: mpirun merges every rank's output into one stream, and print() writes the
    # text and its newline separately, so two ranks' lines could interleave.
    os.write(1, (text + "\n").encode())


comm = MPI.COMM_WORLD
total = comm.allreduce(comm.rank)
mode = sys.argv[1] if len(sys.argv) > 1 else "report"
say("A4RAY_RESULT " + json.dumps({
    "rank": comm.rank, "size": comm.size, "allreduce": total, "pid": os.getpid(),
    "node_rank": int(os.environ["A4RAY_NODE_RANK"]), "local_rank": int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]),
    "forwarded": os.environ.get("A4RAY_TEST_FORWARDED"),
}))
if mode == "fail" and comm.rank == int(sys.argv[2]):
    os._exit(3)
if mode == "hang":
    say(f"ready {comm.rank}")
    time.sleep(600)
comm.Barrier()
