"""The `a4ray` command. Each subcommand lives with the feature it drives; this file only wires them."""

from __future__ import annotations

import argparse
import importlib
import sys

# module: it defines `add_cli(subparsers)`, which adds its subcommand(s) with a `func(args) -> int`.
SUBCOMMAND_MODULES = [
    "a4ray.commands.run",
    "a4ray.commands.convert",
    "a4ray.commands.local",
    "a4ray.commands.doctor",
    "a4ray.commands.kube",
    "a4ray.commands.stage",
    "a4ray.commands.network",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="a4ray", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
