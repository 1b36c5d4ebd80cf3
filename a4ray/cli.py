"""The `a4ray` command. Each group of subcommands lives in `a4ray/commands/`; this file only wires them, and
imports only the group of the command asked for: the job commands import Ray, torch and megatron-core
(seconds), which `a4ray --help` or `a4ray render` never need."""

from __future__ import annotations

import argparse
import importlib
import sys

from a4ray.commands import COMMANDS

DESCRIPTION = """\
Run and test LLM training on multi-node GKE A4 clusters through Ray, or rehearse it on a local cluster of
simulated A4 nodes. The main job is `python -m a4ray.qwen3_next` (stage -> convert -> preflight -> train);
with no cluster at hand it rehearses on an embedded one."""

EPILOG = """\
examples:
  python -m a4ray.qwen3_next                       rehearse the main job locally (no cluster needed)
  a4ray local up --nodes 2 --gpus-per-node 1       a local cluster to submit jobs to (a4ray local down stops it)
  a4ray nccl-test --local-nodes 2 --gpus-per-node 2     is the network right? (here: a CPU rehearsal)
  a4ray render cluster -f jobs/cluster-a4.yaml     the KubeRay RayCluster of a spec
  a4ray up -f jobs/cluster-a4.yaml; a4ray submit -f jobs/ddp_test.yaml --cluster a4

`a4ray COMMAND --help` for a command's options. The README has the rest."""

def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of `a4ray`, with the options of the command `argv` names (the others are listed only)."""
    parser = argparse.ArgumentParser(prog="a4ray", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    asked = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    group = COMMANDS[asked][0] if asked in COMMANDS else None
    for name, (module, summary) in COMMANDS.items():
        if module == group:
            continue
        sub.add_parser(name, help=summary)
    if group is not None:
        importlib.import_module(f"a4ray.commands.{group}").add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
