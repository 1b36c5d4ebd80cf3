"""`a4ray run | convert | doctor | stage | nccl-test | deepep-test` and `a4ray standins`: the job commands,
each one of the job driver's commands (`a4ray.driver.main`) under its CLI name."""

from __future__ import annotations

import argparse

from a4ray.driver.main import COMMANDS, add_options, run_command
from a4ray.staging.standins import make_all

# CLI name -> (driver command, help)
JOB_COMMANDS = {
    "run": ("run", "run a job spec on the cluster (or an embedded one); its `kind:` picks the job"),
    "convert": ("convert", "convert a Hugging Face checkpoint to Megatron-core (cached; verified by default)"),
    "doctor": ("doctor", "check every node of a job's gang before training"),
    "stage": ("stage", "stage a job's artifacts onto the workspace, exactly once"),
    "nccl-test": ("nccl_test", "is the network right? nccl-tests (or a torch benchmark) across the gang, with a "
                  "verdict"),
    "deepep-test": ("deepep_test", "DeepEP's internode test across the gang"),
}


def add_cli(sub: argparse._SubParsersAction) -> None:
    for name, (command, help_text) in JOB_COMMANDS.items():
        parser = add_options(sub.add_parser(name, help=help_text, description=help_text), COMMANDS[command])
        parser.set_defaults(func=lambda args, command=COMMANDS[command]: run_command(command, args))
    standins = sub.add_parser("standins", help="make the tiny local stand-ins of the Qwen3 checkpoints and datasets")
    standins.add_argument("--out", default=".a4ray/standins", help="directory to create them in (default: %(default)s)")
    standins.set_defaults(func=_standins)


def _standins(args: argparse.Namespace) -> int:
    for name, path in make_all(args.out).items():
        print(f"a4ray: stand-in {name}: {path}", flush=True)
    return 0
