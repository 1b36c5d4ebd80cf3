"""python -m a4ray.convert -f SPEC: the same as `a4ray convert -f SPEC`."""

import sys

from a4ray.driver import main as driver

if __name__ == "__main__":
    sys.exit(driver.main("convert", description=__doc__))
