"""python -m a4ray.convert -f SPEC: the same as `a4ray convert -f SPEC`."""

import sys

from a4ray.commands.convert import main

if __name__ == "__main__":
    sys.exit(main())
