"""`a4ray stage -f SPEC`: stage a job's artifacts (models, datasets, code) onto the workspace, exactly once.

SPEC is a `kind: stage` spec or any job with `artifacts:` (a recipe: what its stage step stages).

Also `a4ray standins`: make the tiny local stand-ins (checkpoints, Megatron corpus, Alpaca JSON) that
`jobs/qwen3_next_local.yaml` stages on an embedded cluster.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from a4ray.entry import add_job_options, shorthand_sets


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = add_job_options(sub.add_parser("stage", help="stage a job's artifacts onto the workspace, exactly once"))
    p.add_argument("--only", action="append", default=[], metavar="NAME", help="stage only this artifact (repeatable)")
    p.add_argument("--replace", action="store_true",
                   help="restage targets that hold something else, were modified, or were not staged by a4ray")
    p.add_argument("--workspace", metavar="DIR", help="resolve targets under DIR instead of the spec's workspace")
    p.set_defaults(func=main_args)
    s = sub.add_parser("standins", help="make the tiny local stand-ins of the Qwen3 checkpoints and datasets")
    s.add_argument("--out", default=".a4ray/standins", help="directory to create them in (default: %(default)s)")
    s.set_defaults(func=_standins)


def main_args(args: argparse.Namespace) -> int:
    from a4ray.core.console import say
    from a4ray.core.errors import A4RayError, SpecError, StagingFailed
    from a4ray.core.redact import redact
    from a4ray.spec import Staged, load_job
    from a4ray.spec.loader import parse_yaml
    from a4ray.staging.stager import plan, stage

    try:
        sets = shorthand_sets(args) + (["staging.replace=true"] if getattr(args, "replace", False) else [])
        kind = "stage"  # or the kind of the file given: any job that stages artifacts (a recipe: its stage step)
        if args.config and Path(args.config).is_file():
            kind = (parse_yaml(Path(args.config).read_text(), args.config) or {}).get("kind") or "stage"
        spec = load_job(args.config, sets, kind=kind)
        if not isinstance(spec, Staged):
            raise SpecError(spec.source, [f"kind: a {spec.kind!r} job stages nothing (no artifacts: section)"],
                            hint="pass a stage spec or a recipe, e.g. jobs/qwen3_next.yaml")
        if not spec.artifacts:
            raise SpecError(spec.source, ["artifacts: nothing to stage"],
                            hint="pass -f with a stage spec that lists artifacts, e.g. jobs/qwen3_next_local.yaml")
        if args.dry_run:
            print(plan(spec), flush=True)
            return 0
        result = stage(spec, address=args.address, local_nodes=args.local_nodes,
                       only=getattr(args, "only", []), workspace=getattr(args, "workspace", None))
    except StagingFailed as failure:
        print(failure.result.table(), flush=True)
        print(f"a4ray: error: {failure}", file=sys.stderr, flush=True)
        _write_result(args.result, failure.result.model_dump_json(indent=2))
        say(failure.result.verdict)
        return failure.exit_code
    except A4RayError as error:
        print(f"a4ray: error: {error}", file=sys.stderr, flush=True)
        _write_result(args.result, json.dumps({"kind": "stage", "ok": False, "error": redact(str(error))}))
        return error.exit_code
    except KeyboardInterrupt:
        print("a4ray: cancelled (partial downloads are kept and resumed by the next run)", file=sys.stderr)
        return 130
    print(result.table(), flush=True)
    say(result.verdict)
    _write_result(args.result, result.model_dump_json(indent=2))
    return 0


def _write_result(path: str | None, text: str) -> None:
    if path:
        from a4ray.core.redact import redact

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(redact(text))


def _standins(args: argparse.Namespace) -> int:
    from a4ray.staging.standins import make_all

    for name, path in make_all(args.out).items():
        print(f"a4ray: stand-in {name}: {path}", flush=True)
    return 0
