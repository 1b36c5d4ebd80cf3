"""python -m a4ray.deepep_test: DeepEP's internode test (tests/test_internode.py) across the gang.

Replaces the seeds' RUN_DEEPEP_TEST: one process per node with WORLD_SIZE, RANK and MASTER_ADDR from the
gang's topology order, DeepEP's NVSHMEM env, launched through mpirun without SSH (or directly by each
node actor); prints the pass count and the dispatch/combine bandwidths per node; exits 0 only if every
case passed on every node.
"""

import sys

from a4ray.driver import main as driver


def main(argv: list[str] | None = None) -> int:
    return driver.main("deepep_test", argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
