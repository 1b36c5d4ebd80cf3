"""python -m a4ray.stage -f jobs/<job>.yaml: stage a job's artifacts onto the workspace, exactly once.

The same as `a4ray stage` (the form `ray job submit -- python -m a4ray.stage ...` runs on a cluster).
"""

import argparse
import sys

from a4ray.commands.stage import add_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m a4ray.stage", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    add_cli(sub)
    args = parser.parse_args(["stage", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
