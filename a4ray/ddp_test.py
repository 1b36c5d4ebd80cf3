"""python -m a4ray.ddp_test: a small real DDP training run on every GPU of every node of the gang.

Replaces the seeds' torchrun-ddp-test.sh: checks that a collective sums right and that every rank's
parameters agree after N DDP steps, prints a per-rank table and one verdict; exits 0 only if all passed.
"""

import sys

from a4ray.driver import main as driver


def main(argv: list[str] | None = None) -> int:
    return driver.main("ddp_test", argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
