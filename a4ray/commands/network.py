"""`a4ray nccl-test` and `a4ray deepep-test`: the network tests, as `python -m a4ray.nccl_test` / `.deepep_test`."""

from __future__ import annotations

import argparse

from a4ray.entry import add_job_options, job_main


def add_nccl_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_job_options(parser)
    parser.add_argument("--isolate", action="store_true",
                        help="on failure or low busbw, test node pairs to name the bad nodes (nccl.isolate)")
    return parser


def run_nccl_test(args: argparse.Namespace) -> int:
    if args.isolate:
        args.set.append("nccl.isolate=true")
    return job_main("nccl_test", args=args)


def add_cli(sub: argparse._SubParsersAction) -> None:
    nccl = sub.add_parser("nccl-test", help="is the network right? nccl-tests (or a torch benchmark) across the "
                          "gang, with a verdict")
    add_nccl_options(nccl).set_defaults(func=run_nccl_test)
    deepep = add_job_options(sub.add_parser("deepep-test", help="DeepEP's internode test across the gang"))
    deepep.set_defaults(func=lambda args: job_main("deepep_test", args=args))
