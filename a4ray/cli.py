"""The `a4ray` command. Each group of subcommands lives in `a4ray/commands/`; this file only wires them."""

from __future__ import annotations

import argparse
import sys

from a4ray.commands import jobs, kube, local, nodes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="a4ray", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (jobs, local, kube, nodes):
        module.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
