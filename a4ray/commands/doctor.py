"""`a4ray doctor -f SPEC`: preflight checks on every node of the job's gang (see a4ray/workloads/doctor.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from a4ray.entry import add_job_options, shorthand_sets


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = add_job_options(sub.add_parser("doctor", help="check every node of a job's gang before training"))
    p.set_defaults(func=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from a4ray.core.errors import A4RayError
    from a4ray.workloads.doctor import doctor, report
    from a4ray.spec.loader import load_job, parse_yaml

    try:
        kind = None if args.config else "ddp_test"  # any job kind describes a gang; the DDP test's is a sane default
        if args.config:
            kind = (parse_yaml(Path(args.config).read_text(), args.config) or {}).get("kind")
        spec = load_job(args.config, shorthand_sets(args), kind=kind)
        result = doctor(spec, address=args.address, local_nodes=args.local_nodes)
    except A4RayError as error:
        print(f"a4ray: error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    report(result)
    if args.result:
        Path(args.result).write_text(result.model_dump_json(indent=2))
    return 0 if result.ok else 1
