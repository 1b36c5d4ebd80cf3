"""`a4ray convert -f SPEC`: convert an HF checkpoint to Megatron-core (cached; verified by default)."""

from __future__ import annotations

import argparse

from a4ray.entry import add_job_options, job_main

DESCRIPTION = ("Convert a Hugging Face checkpoint to a Megatron-core checkpoint (native Ray tasks, Pai-Megatron-Patch "
               "or ms-swift), verify it and cache it: a second run with the same input and options does nothing.")


def _options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_job_options(parser)
    parser.add_argument("--verify", dest="verify", action="store_true", default=None,
                        help="verify the checkpoint (default for the native backend)")
    parser.add_argument("--no-verify", dest="verify", action="store_false", help="skip verification")
    return parser


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = _options(sub.add_parser("convert", help=DESCRIPTION.split(":")[0], description=DESCRIPTION))
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.verify is not None:
        args.set = [f"convert.verify.enabled={str(args.verify).lower()}", *args.set]
    return job_main("convert", args=args)


def main(argv: list[str] | None = None) -> int:
    parser = _options(argparse.ArgumentParser(prog="python -m a4ray.convert", description=DESCRIPTION))
    return _run(parser.parse_args(argv))
