"""`a4ray run -f SPEC`: run any job spec (its `kind:` picks the workload), as `python -m a4ray.<kind>` does."""

from __future__ import annotations

import argparse

from a4ray.entry import add_job_options, job_main


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = add_job_options(sub.add_parser("run", help="run a job spec on the cluster (or an embedded one)"))
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from a4ray.spec.loader import parse_yaml

    if not args.config:
        raise SystemExit("a4ray run: -f/--config SPEC is required")
    with open(args.config) as f:
        kind = (parse_yaml(f.read(), args.config) or {}).get("kind")
    if not kind:
        raise SystemExit(f"a4ray run: {args.config} has no `kind:`")
    if kind == "cluster":
        raise SystemExit(f"a4ray run: {args.config} describes a cluster, not a job: `a4ray up -f {args.config}` "
                         "creates it on GKE; run a job spec (e.g. jobs/ddp_test.yaml) instead")
    if kind == "stage":  # not a gang workload: staging runs as Ray tasks
        from a4ray.commands.stage import main_args

        return main_args(args)
    return job_main(kind, argv=None, args=args)
