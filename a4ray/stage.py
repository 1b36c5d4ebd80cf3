"""python -m a4ray.stage -f jobs/<job>.yaml: stage a job's artifacts onto the workspace, exactly once.

The same as `a4ray stage` (the form `ray job submit -- python -m a4ray.stage ...` runs on a cluster).
"""

import sys

from a4ray.driver import main as driver


def main(argv: list[str] | None = None) -> int:
    return driver.main("stage", argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
