"""python -m a4ray.nccl_test: is the network right? nccl-tests (or a torch benchmark) across the gang.

Replaces the seeds' mpirun-over-SSH nccl-test.sh: runs the collectives of the spec on every GPU of every
node (mpirun through Ray, no SSH; or torchrun where nccl-tests is not in the image), prints a busbw
table per collective, checks results, busbw against the spec's thresholds and that NCCL used gIB/IB
rather than TCP sockets, and exits 0 only if all passed. `--isolate` tests node pairs to name bad nodes.
"""

import sys

from a4ray.driver import main as driver


def main(argv: list[str] | None = None) -> int:
    return driver.main("nccl_test", argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
