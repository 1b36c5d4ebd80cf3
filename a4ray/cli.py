"""The `a4ray` command. Each group of subcommands lives in `a4ray/commands/`; this file only wires them, and
imports only the group of the command asked for: the job commands import Ray, torch and megatron-core
(seconds), which `a4ray --help` or `a4ray render` never need."""

from __future__ import annotations

import argparse
import importlib
import sys

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

# command -> (the module under a4ray/commands that defines it, what it does in one line)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("jobs", "run a job spec on the cluster (or an embedded one); its `kind:` picks the job"),
    "convert": ("jobs", "convert a Hugging Face checkpoint to Megatron-core (cached; verified by default)"),
    "doctor": ("jobs", "check every node of a job's gang before training"),
    "stage": ("jobs", "stage a job's artifacts onto the workspace, exactly once"),
    "nccl-test": ("jobs", "is the network right? nccl-tests (or a torch benchmark) across the gang, with a verdict"),
    "deepep-test": ("jobs", "DeepEP's internode test across the gang"),
    "standins": ("jobs", "make the tiny local stand-ins of the Qwen3 checkpoints and datasets"),
    "local": ("local", "a local Ray cluster of simulated A4 nodes to submit jobs to: up, down, status"),
    "render": ("kube", "print the KubeRay manifest (RayCluster, RayJob) of a spec"),
    "up": ("kube", "create the RayCluster of a spec on GKE and wait for its head"),
    "down": ("kube", "delete a RayCluster (or RayJob) and its storage objects"),
    "status": ("kube", "a4ray's RayClusters and RayJobs, one line each"),
    "submit": ("kube", "run a job: on a RayCluster (--cluster) or as a RayJob"),
    "logs": ("kube", "logs of a RayJob, or of a job on a RayCluster"),
}


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
