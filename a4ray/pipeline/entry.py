"""`python -m a4ray.<recipe>`: run a recipe's pipeline, or rehearse it locally.

Which spec: `--config FILE` if given. Otherwise, when this command would start an embedded local cluster
(no --address, no RAY_ADDRESS, no Ray cluster running here) and is not a dry run, the recipe's local
profile `jobs/<kind>_local.yaml` (tiny stand-ins, the built-in trainer), saying so; else the recipe's
defaults, which are its A4 run. After a local rehearsal it prints what the same run launches on A4.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from a4ray.core.console import say
from a4ray.entry import _write_json, add_job_options, shorthand_sets
from a4ray.core.errors import A4RayError
from a4ray.spec.recipes import STEPS

JOBS_DIR = Path(__file__).resolve().parents[2] / "jobs"


def local_profile(kind: str) -> Path | None:
    path = JOBS_DIR / f"{kind}_local.yaml"
    return path if path.is_file() else None


def add_pipeline_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_job_options(parser)
    parser.add_argument("--skip", action="append", default=[], metavar="STEP[,STEP]",
                        help=f"steps not to run ({', '.join(STEPS)}); their outputs must exist")
    parser.add_argument("--from", dest="start", choices=STEPS, help="begin at this step (earlier ones are skipped)")
    return parser


def _pipeline_sets(args: argparse.Namespace) -> list[str]:
    skip = [s.strip() for item in getattr(args, "skip", []) for s in item.split(",") if s.strip()]
    sets = [f"pipeline.skip=[{','.join(skip)}]"] if skip else []
    return sets + ([f"pipeline.start={args.start}"] if getattr(args, "start", None) else [])


def pipeline_main(kind: str, argv: list[str] | None = None, *, description: str | None = None,
                  args: argparse.Namespace | None = None) -> int:
    from a4ray.api import run
    from a4ray.pipeline import plan
    from a4ray.runtime.connect import will_embed
    from a4ray.spec import load_job

    if args is None:
        parser = argparse.ArgumentParser(prog=f"python -m a4ray.{kind}", description=description)
        args = add_pipeline_options(parser).parse_args(argv)
    config, rehearsal = args.config, False
    if config is None and not args.dry_run and will_embed(args.address):
        config, rehearsal = local_profile(kind), True
        if config is None:
            print(f"a4ray: error: no Ray cluster to join (no --address, RAY_ADDRESS or local cluster) and {kind} has "
                  f"no local rehearsal profile ({_shown(JOBS_DIR / f'{kind}_local.yaml')})\n  hint: run it on a "
                  f"cluster (`ray job submit -- python -m a4ray.{kind}`), see its plan with --dry-run, or pass "
                  "--config FILE", file=sys.stderr, flush=True)
            return 2
        say(f"no Ray cluster to join (no --address, RAY_ADDRESS or local cluster): rehearsing on an embedded "
            f"local cluster with the local profile {_shown(config)}; on A4: `ray job submit -- python -m "
            f"a4ray.{kind}` (the recipe's defaults)")
    try:
        spec = load_job(config, shorthand_sets(args) + _pipeline_sets(args), kind=kind)
        if args.dry_run:
            print(plan(spec), flush=True)
            return 0
        result = run(spec, address=args.address, local_nodes=args.local_nodes, dashboard=args.dashboard,
                     run_dir=args.run_dir)
    except A4RayError as error:
        print(f"a4ray: error: {error}", file=sys.stderr, flush=True)
        if args.result:
            _write_json(args.result, json.dumps({"kind": kind, "ok": False, "error": str(error)}, indent=2))
        return error.exit_code
    except KeyboardInterrupt:
        print("a4ray: cancelled; run the same command again to resume (finished steps are cached)",
              file=sys.stderr, flush=True)
        return 130
    print(result.table(), flush=True)
    say(result.verdict)
    if rehearsal and result.ok:
        print(a4_summary(kind, list(args.set), result), flush=True)
    if args.result:
        _write_json(args.result, result.model_dump_json(indent=2))
    return result.exit_code


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def a4_summary(kind: str, sets: list[str], result) -> str:
    """After a local rehearsal: the outputs, and what the same pipeline launches on A4 (the recipe's defaults)."""
    from a4ray.pipeline import check
    from a4ray.pipeline.steps import Convert, Train, convert_job, convert_plan, train_workload
    from a4ray.spec import load_job

    lines = ["", f"outputs of this rehearsal (run directory {result.run_dir}):"]
    for step in result.steps:
        lines += [f"  {step.name}: {what}: {path}" for what, path in step.outputs.items()]
    lines.append(f"  logs: {result.run_dir}/logs/train (one file per node and per rank)")
    try:
        a4 = load_job(None, sets, kind=kind)
        check(a4)
        note = f" with {' '.join('--set ' + s for s in sets)}" if sets else ""
    except A4RayError:
        a4, note = load_job(None, [], kind=kind), " (your --set values do not apply to A4; shown without them)"
    ws, c = a4.storage.workspace, a4.cluster
    lines += ["", f"on A4, `python -m a4ray.{kind}`{note} runs the same steps on {c.nodes} x {c.machine_type} "
              f"({c.gpus_per_node} GPUs each), workspace {ws}:",
              f"  stage: {len(a4.artifacts)} artifact(s):"]
    lines += [f"    {a.name} <- {a.source}" for a in a4.artifacts]
    convert = Convert(a4)
    if convert.not_needed():
        lines.append(f"  convert: skipped: {convert.not_needed()}")
    else:
        lines.append(f"  convert: {convert.runs()} -> {convert.latest(ws)}")
        lines += [f"    {line}" for line in convert_plan(convert_job(a4)).splitlines()]
    lines.append("  preflight: a4ray doctor on every node of the gang")
    work = train_workload(a4, ws)
    lines.append(f"  train: {Train(a4).runs()}")
    for node in work.plan().nodes:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in node.env.items())
        cd = f"cd {node.cwd} && " if node.cwd else ""
        lines.append(f"    node {node.rank}: {cd}{env} {shlex.join(node.argv)}")
    if hasattr(work, "checkpoint_dir"):
        lines.append(f"    checkpoints: {work.checkpoint_dir}")
    lines.append(f"  the whole plan (env layers, 27 arguments by name): python -m a4ray.{kind} --dry-run")
    return "\n".join(lines)
