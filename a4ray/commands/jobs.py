"""`a4ray run | convert | doctor | stage | nccl-test | deepep-test` and `a4ray standins`: the job commands,
each one of the job driver's commands (`a4ray.driver.main`) under its CLI name."""

from __future__ import annotations

import argparse

from a4ray.commands import summary
from a4ray.driver.main import COMMANDS, add_options, run_command
from a4ray.staging.standins import make_all

# CLI name -> driver command
JOB_COMMANDS = {"run": "run", "convert": "convert", "doctor": "doctor", "stage": "stage", "nccl-test": "nccl_test",
                "deepep-test": "deepep_test"}


def add_cli(sub: argparse._SubParsersAction) -> None:
    for name, command in JOB_COMMANDS.items():
        parser = add_options(sub.add_parser(name, help=summary(name), description=summary(name)), COMMANDS[command])
        parser.set_defaults(func=lambda args, command=COMMANDS[command]: run_command(command, args))
    standins = sub.add_parser("standins", help=summary("standins"))
    standins.add_argument("--out", default=".a4ray/standins", help="directory to create them in (default: %(default)s)")
    standins.set_defaults(func=_standins)


def _standins(args: argparse.Namespace) -> int:
    for name, path in make_all(args.out).items():
        print(f"a4ray: stand-in {name}: {path}", flush=True)
    return 0
