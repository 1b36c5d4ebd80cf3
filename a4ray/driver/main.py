"""The command line of every job: `python -m a4ray.<job>` and `a4ray run | convert | doctor | stage |
nccl-test | deepep-test`. One way through for all of them:

  parse the options -> load the spec (-f FILE, else the kind's defaults, or a recipe's local rehearsal
  profile when there is no cluster to join) -> --dry-run: print the plan | run it (`execute.run`) ->
  print its tables and verdict -> write --result -> exit 0 (passed) | 1 (failed) | 2 (bad input) | 130
  (cancelled: --result then says `"cancelled": true`).

Errors are printed here and only here: `a4ray: error: <what, naming the file, field or node>` and a
hint, never a traceback; with --result, the error is recorded there too.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from a4ray.core.console import say
from a4ray.core.errors import A4RayError
from a4ray.core.redact import redact
from a4ray.core.results import Result
from a4ray.driver import execute
from a4ray.driver.kinds import Job, job_for
from a4ray.pipeline import rehearsal
from a4ray.runtime import connect as connection
from a4ray.spec.job import JOB_KINDS, JobSpec
from a4ray.spec.loader import check_kind, load_job
from a4ray.spec.overrides import Given, read_yaml_file
from a4ray.spec.recipes import RECIPE_KINDS, STEPS
from a4ray.staging.stager import Staging
from a4ray.workloads.doctor import Doctor


@dataclass(frozen=True)
class Option:
    """A command's own option (beyond the options of every job), and the spec overrides it stands for."""

    flags: tuple[str, ...]
    help: str
    overrides: Callable[[Any], list[str]] = lambda value: []
    kwargs: dict = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.flags[0].lstrip("-").replace("-", "_")

    def given(self, value: Any) -> list[Given]:
        """Its overrides, each with the option as the user typed it (errors name that, not a `--set`)."""
        action = self.kwargs.get("action")
        typed = (" ".join(f"{self.flags[0]} {item}" for item in value) if action == "append" else self.flags[0]
                 if action in ("store_true", "store_false") else f"{self.flags[0]} {value}")
        return [(assignment, typed) for assignment in self.overrides(value)]


@dataclass(frozen=True)
class Command:
    """A job command: which kind it runs and how its job is made."""

    kind: str | None  # None: the kind the spec file names (-f is required unless `default_kind`)
    default_kind: str | None = None  # with no -f: the defaults of this kind
    options: tuple[Option, ...] = ()
    job: Callable[[JobSpec, argparse.Namespace], Job] | None = None  # default: the job of the spec's kind


ISOLATE = Option(("--isolate",), "on failure or low busbw, test node pairs to name the bad nodes (nccl.isolate)",
                 lambda on: ["nccl.isolate=true"] if on else [], {"action": "store_true"})
VERIFY = Option(("--verify",), "verify the checkpoint (default for the native backend)",
                lambda value: ["convert.verify.enabled=true"] if value is True else [],
                {"dest": "verify", "action": "store_true", "default": None})
NO_VERIFY = Option(("--no-verify",), "skip verification", lambda value: ["convert.verify.enabled=false"]
                   if value is False else [], {"dest": "verify", "action": "store_false"})
SKIP = Option(("--skip",), f"steps not to run ({', '.join(STEPS)}); their outputs must exist where a later step runs",
              lambda items: [f"pipeline.skip=[{','.join(s.strip() for i in items for s in i.split(',') if s.strip())}]"]
              if items else [], {"action": "append", "default": [], "metavar": "STEP[,STEP]"})
FROM = Option(("--from",), "begin at this step (earlier ones are skipped)",
              lambda step: [f"pipeline.start={step}"] if step else [], {"dest": "start", "choices": STEPS})
REPLACE = Option(("--replace",), "restage targets that hold something else, were modified, or were not staged by a4ray",
                 lambda on: ["staging.replace=true"] if on else [], {"action": "store_true"})
ONLY = Option(("--only",), "stage only this artifact (repeatable)",
              kwargs={"action": "append", "default": [], "metavar": "NAME"})
WORKSPACE = Option(("--workspace",), "resolve targets under DIR instead of the spec's workspace",
                   kwargs={"metavar": "DIR"})

COMMANDS: dict[str, Command] = {
    **{kind: Command(kind, options=(SKIP, FROM)) for kind in RECIPE_KINDS},
    "ddp_test": Command("ddp_test"),
    "nccl_test": Command("nccl_test", options=(ISOLATE,)),
    "deepep_test": Command("deepep_test"),
    "convert": Command("convert", options=(VERIFY, NO_VERIFY)),
    "run": Command(None),
    # Any job kind describes a gang; the DDP test's is a sane default.
    "doctor": Command(None, default_kind="ddp_test", job=lambda spec, args: Doctor(spec)),
    "stage": Command(None, default_kind="stage", options=(ONLY, REPLACE, WORKSPACE),
                     job=lambda spec, args: Staging(spec, only=args.only, workspace=args.workspace)),
}


def add_options(parser: argparse.ArgumentParser, command: Command) -> argparse.ArgumentParser:
    """Every job's options, then the command's own."""
    parser.add_argument("--config", "-f", metavar="FILE", help="job spec YAML" + (
        " (default: the kind's defaults)" if command.kind or command.default_kind else " (required)"))
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
    for option in command.options:
        parser.add_argument(*option.flags, help=option.help, **option.kwargs)
    return parser


def entry_parser(name: str, *, description: str | None = None) -> argparse.ArgumentParser:
    """The parser of `python -m a4ray.<name>`: every job's options, then the command's own."""
    return add_options(argparse.ArgumentParser(prog=f"python -m a4ray.{name}", description=description), COMMANDS[name])


def main(name: str, argv: list[str] | None = None, *, description: str | None = None) -> int:
    """`python -m a4ray.<name>`."""
    return run_command(COMMANDS[name], entry_parser(name, description=description).parse_args(argv))


def run_command(command: Command, args: argparse.Namespace) -> int:
    """Run one job command with parsed `args`; returns the exit code."""
    sets = _overrides(command, args)
    kind, job, rehearsing, conn = command.kind, None, False, None
    try:
        config = args.config
        if kind is None:
            kind = _kind_of(config) if config else command.default_kind
            if kind is None:
                raise A4RayError("-f/--config SPEC is required", hint="e.g. `a4ray run -f jobs/ddp_test.yaml`")
        rehearsable = JOB_KINDS[kind].rehearses_locally if kind in JOB_KINDS else False
        if config is None and not args.dry_run and rehearsable:
            config, rehearsing, conn = _rehearsal(kind, args.address)
        shape = " ".join(f"{flag} {value}" for flag, value in (("--local-nodes", args.local_nodes),
                                                                 ("--gpus-per-node", args.gpus_per_node)) if value)
        if shape and rehearsal.is_local_profile(kind, config) and kind in RECIPE_KINDS:  # the parallelism
            sets += rehearsal.fit_to_nodes(kind, config, sets, shape, make=not args.dry_run)
        spec = load_job(config, sets, kind=kind)
        job = command.job(spec, args) if command.job else job_for(spec)
        if args.dry_run:
            plan = execute.plan(spec, job)
            print(execute.render(plan), flush=True)  # redacted there
            _write_result(args.result, plan.model_dump_json(indent=2) if not isinstance(plan, str) else None)
            return 0
        run_conn, conn = conn, None  # execute.run closes it from here on
        result = execute.run(spec, job=job, address=args.address, dashboard=args.dashboard, run_dir=args.run_dir,
                             conn=run_conn)
    except A4RayError as error:
        return error_exit(error, kind, args.result)
    except KeyboardInterrupt:  # Ctrl-C, `ray job stop`, or a SIGTERM to the group (`timeout`, a CI runner)
        print(f"a4ray: cancelled{job.cancel_note if job else ''}", file=sys.stderr, flush=True)
        _write_result(args.result, json.dumps({"kind": kind, "ok": False, "cancelled": True,
                                               "verdict": "CANCELLED"}, indent=2))
        return 130
    finally:
        if conn is not None:  # opened to decide whether to rehearse, and not handed on
            conn.close()
    if result.table():
        print(redact(result.table()), flush=True)
    say(result.verdict)
    if rehearsing and result.ok:
        print(redact(rehearsal.a4_summary(kind, sets, result)), flush=True)
    _write_result(args.result, result.model_dump_json(indent=2))
    return result.exit_code


def _overrides(command: Command, args: argparse.Namespace) -> list[Given]:
    """--local-nodes / --gpus-per-node and the command's options as spec overrides, each naming the option; explicit
    --set wins."""
    sets: list[Given] = []
    if args.local_nodes is not None:
        sets.append((f"cluster.nodes={args.local_nodes}", f"--local-nodes {args.local_nodes}"))
    if args.gpus_per_node is not None:
        sets.append((f"cluster.gpus_per_node={args.gpus_per_node}", f"--gpus-per-node {args.gpus_per_node}"))
    for option in command.options:
        sets += option.given(getattr(args, option.dest))
    return sets + list(args.set)


def _kind_of(config: str) -> str:
    """The `kind:` a spec file names (loading it validates it, naming the file)."""
    data = read_yaml_file(Path(config), config)
    kind = data.get("kind") if isinstance(data, dict) else None
    if not kind:  # not a mapping, or no kind: the loader says which
        return load_job(config).kind
    check_kind(kind, config)
    return kind


def _rehearsal(kind: str, address: str | None) -> tuple[Path | None, bool, connection.Connection | None]:
    """A recipe's command with no --config: its A4 defaults on a cluster of A4 nodes; its local rehearsal profile
    where there is no cluster to join (an embedded one is started) or the cluster's nodes are simulated (`a4ray
    local up`, which has neither A4's GPUs nor its storage). Returns (profile or None, rehearsing, the
    connection opened to find out, for the run to use)."""
    if connection.will_embed(address):
        return _rehearsal_profile(kind, "no Ray cluster to join (no --address, RAY_ADDRESS or local cluster): "
                                  "rehearsing on an embedded local cluster"), True, None
    conn = connection.connect(address)
    if not conn.simulated:
        return None, False, conn
    try:
        return _rehearsal_profile(kind, f"the Ray cluster at {conn.address} is simulated A4 nodes: rehearsing on "
                                  "it"), True, conn
    except A4RayError:
        conn.close()
        raise


def _rehearsal_profile(kind: str, why: str) -> Path:
    profile = rehearsal.local_profile(kind)
    if profile is None:
        raise A4RayError(f"{why.partition(':')[0]}, and {kind} has no local rehearsal profile "
                         f"({rehearsal.shown(rehearsal.JOBS_DIR / f'{kind}_local.yaml')})",
                         hint=f"run it on a cluster of A4 nodes (`ray job submit -- python -m a4ray.{kind}`), see "
                         "its plan with --dry-run, or pass --config FILE")
    say(f"{why} with the local profile {rehearsal.shown(profile)}; on A4: `ray job submit -- python -m "
        f"a4ray.{kind}` (the recipe's defaults)")
    return profile


def error_exit(error: A4RayError, kind: str | None = None, result_path: str | None = None) -> int:
    """Print `error` the one way a4ray prints errors (and its partial result's table, if it has one);
    record it with --result; return the exit code."""
    partial = getattr(error, "result", None)
    partial = partial if isinstance(partial, Result) else None
    if partial is not None and partial.table():
        print(redact(partial.table()), flush=True)
    print(f"a4ray: error: {error}", file=sys.stderr, flush=True)
    if partial is not None:
        say(partial.verdict)
    _write_result(result_path, partial.model_dump_json(indent=2) if partial is not None else
                  json.dumps({"kind": kind, "ok": False, "error": str(error)}, indent=2))
    return error.exit_code


def _write_result(path: str | None, text: str | None) -> None:
    if path and text is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(redact(text))
