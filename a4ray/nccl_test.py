"""python -m a4ray.nccl_test: is the network right? nccl-tests (or a torch benchmark) across the gang.

Replaces the seeds' mpirun-over-SSH nccl-test.sh: runs the collectives of the spec on every GPU of every
node (mpirun through Ray, no SSH; or torchrun where nccl-tests is not in the image), prints a busbw
table per collective, checks results, busbw against the spec's thresholds and that NCCL used gIB/IB
rather than TCP sockets, and exits 0 only if all passed. `--isolate` tests node pairs to name bad nodes.
"""

import argparse
import sys

from a4ray.commands.network import add_nccl_options, run_nccl_test


def main(argv: list[str] | None = None) -> int:
    parser = add_nccl_options(argparse.ArgumentParser(prog="python -m a4ray.nccl_test", description=__doc__))
    return run_nccl_test(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
