"""The options every `python -m a4ray.<workload>` takes, and the one main they all share."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from a4ray.core.console import say
from a4ray.core.errors import A4RayError
from a4ray.core.redact import redact


def add_job_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", "-f", metavar="FILE", help="job spec YAML (default: the kind's defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="A.B.C=VALUE",
                        help="override a spec field (Helm style; repeatable; lists by index: a.b[0]=x)")
    parser.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a running "
                        "local cluster, else an embedded local cluster of simulated A4 nodes)")
    parser.add_argument("--local-nodes", type=int, metavar="N",
                        help="nodes of the job (sets cluster.nodes; also the embedded cluster's size)")
    parser.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs per node (sets cluster.gpus_per_node)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (nodes, commands, env); run nothing")
    parser.add_argument("--result", metavar="FILE", help="write the typed result as JSON")
    parser.add_argument("--dashboard", action="store_true", help="start the Ray dashboard on the embedded cluster")
    parser.add_argument("--run-dir", metavar="DIR", help="record the run in this existing run directory "
                        "(a4ray.submit makes one and passes it to the job's driver)")
    return parser


def shorthand_sets(args: argparse.Namespace) -> list[str]:
    """--local-nodes / --gpus-per-node as spec overrides; explicit --set wins over them."""
    sets = []
    if args.local_nodes is not None:
        sets.append(f"cluster.nodes={args.local_nodes}")
    if args.gpus_per_node is not None:
        sets.append(f"cluster.gpus_per_node={args.gpus_per_node}")
    return sets + list(args.set)


def _write_json(path: str, data: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(redact(data))


def job_main(kind: str, argv: list[str] | None = None, *, description: str | None = None,
             args: argparse.Namespace | None = None) -> int:
    from a4ray.api import run
    from a4ray.runner import workload_for
    from a4ray.spec import JOB_KINDS, RecipeJob, load_job

    spec_class = JOB_KINDS.get(kind)
    if spec_class is not None and issubclass(spec_class, RecipeJob):  # a pipeline of steps, not one launch
        from a4ray.pipeline.entry import pipeline_main

        return pipeline_main(kind, argv, description=description, args=args)
    if args is None:
        parser = argparse.ArgumentParser(prog=f"python -m a4ray.{kind}", description=description)
        args = add_job_options(parser).parse_args(argv)
    try:
        spec = load_job(args.config, shorthand_sets(args), kind=kind)
        if args.dry_run:
            work = workload_for(spec)
            work.check()  # a dry run refuses what the run would refuse
            plan = work.plan()
            print(plan.render(), flush=True)
            if args.result:
                _write_json(args.result, plan.model_dump_json(indent=2))
            return 0
        result = run(spec, address=args.address, local_nodes=args.local_nodes, dashboard=args.dashboard,
                     run_dir=args.run_dir)
    except A4RayError as error:
        print(f"a4ray: error: {error}", file=sys.stderr, flush=True)
        if args.result:
            _write_json(args.result, json.dumps({"kind": kind, "ok": False, "error": str(error)}, indent=2))
        return error.exit_code
    except KeyboardInterrupt:
        print("a4ray: cancelled", file=sys.stderr, flush=True)
        return 130
    if result.table():
        print(result.table(), flush=True)
    say(result.verdict)
    if args.result:
        _write_json(args.result, result.model_dump_json(indent=2))
    return 0 if result.ok else 1
