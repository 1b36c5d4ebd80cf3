"""Rehearsing a recipe where there is no A4 cluster: its local profile `jobs/<kind>_local.yaml` (tiny
stand-ins, a trainer that runs on CPUs), and afterwards what the same command runs on A4.

`python -m a4ray.<recipe>` rehearses when it would start an embedded local cluster (no --address, no
RAY_ADDRESS, no Ray cluster running here), is not a dry run and was given no --config (the driver asks
`local_profile`); after a rehearsal that passed, it prints `a4_summary`. `--local-nodes N` on a local profile
rehearses on N nodes: `fit_to_nodes` derives the expert parallelism from N and the profile's models (its
global batch is left to its default, one micro-batch per data-parallel rank).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from a4ray.core.console import say
from a4ray.core.errors import A4RayError, SpecError, UnsupportedModel
from a4ray.mcore.architecture import Architecture
from a4ray.pipeline.pipeline_result import PipelineResult
from a4ray.pipeline.runner import Pipeline
from a4ray.runtime.simulated import local_root
from a4ray.spec.loader import load_job
from a4ray.spec.overrides import Given, parse_sets
from a4ray.staging.stager import make_standins

JOBS_DIR = Path(__file__).resolve().parents[2] / "jobs"


def local_profile(kind: str) -> Path | None:
    """The recipe's local rehearsal profile, if it has one."""
    path = JOBS_DIR / f"{kind}_local.yaml"
    return path if path.is_file() else None


def is_local_profile(kind: str, config: str | Path | None) -> bool:
    profile = local_profile(kind)
    return config is not None and profile is not None and Path(config).resolve() == profile.resolve()


def fit_to_nodes(kind: str, profile: str | Path, sets: Sequence[Given], flag: str, *, make: bool = True
                 ) -> list[Given]:
    """The overrides that make a local profile fit the node count `sets` give it (`flag` names the option
    that gave it, for errors): expert parallelism, the largest that divides both the experts of every model
    the profile stages and the GPUs per pipeline stage. None where the user set it (`--set`) or it fits as is;
    an error in what they set names `flag`.
    A node count that still does not fit is an error naming `flag` and the `--set` to change. `make`: make the
    profile's stand-ins first where they are missing (not for a dry run: the models are then read where
    they are, if they are)."""
    spec = load_job(profile, sets, kind=kind)
    par, field = spec.train.parallelism()
    given = {path for path, _, _ in parse_sets(sets)}
    overrides: list[Given] = []
    experts = sorted(set(_experts(spec, make)))
    if f"{field}.ep" not in given and experts:
        ep = math.gcd(spec.cluster.world_size // (par.etp * par.pp), *experts)
        if ep != par.ep:
            overrides.append((f"{field}.ep={ep}", flag))
            say(f"{flag}: {field}.ep={ep} (expert parallelism that divides the {'/'.join(map(str, experts))} "
                f"experts of the profile's models and its {spec.cluster.world_size} GPUs); the global batch: "
                f"{load_job(profile, [*sets, *overrides], kind=kind).global_batch} (one micro-batch per "
                "data-parallel rank)")
    try:
        Pipeline(load_job(profile, [*sets, *overrides], kind=kind)).check()
    except SpecError as error:
        raise A4RayError(f"{flag}: the local profile {shown(Path(profile))} does not fit "
                         f"{spec.cluster.nodes} node(s) x {spec.cluster.gpus_per_node} GPU(s): "
                         + "; ".join(error.problems),
                         hint=f"set the field named with --set (e.g. --set {field}.ep=1), or give another node count")
    return overrides


def _experts(spec, make: bool) -> list[int]:
    """The expert counts of the models a local profile stages (their local sources' config.json; the
    stand-ins are made first where the profile makes them and `make`, as its stage step would)."""
    if make:
        make_standins(spec)
    counts = []
    for artifact in spec.artifacts:
        ref = artifact.ref
        if ref.scheme != "file":
            continue
        config = Path(os.path.normpath(local_root() / ref.location)) / "config.json"
        if not config.is_file():
            continue
        try:
            arch = Architecture.from_config(json.loads(config.read_text()), str(config))
        except (UnsupportedModel, KeyError, ValueError):
            continue
        if arch.experts:
            counts.append(arch.experts)
    return counts


def shown(path: Path) -> str:
    """`path` relative to the current directory where it is under it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def a4_summary(kind: str, sets: Sequence[Given], result: PipelineResult) -> str:
    """After a local rehearsal: its outputs, and in one line what the same command runs on A4 and where every
    node's command is (the recipe's plan, `--dry-run`: a rehearsal's stream is no place for it)."""
    lines = ["", f"outputs of this rehearsal (run directory {result.run_dir}):"]
    for step in result.steps:
        lines += [f"  {step.name}: {what}: {path}" for what, path in step.outputs.items()]
    lines.append(f"  logs: {result.run_dir}/logs/<step> (one file per node and per rank)")
    try:
        a4 = load_job(None, sets, kind=kind)
        Pipeline(a4).check()
    except A4RayError:
        a4 = load_job(None, [], kind=kind)
    c = a4.cluster
    lines += ["", f"on A4, `ray job submit -- python -m a4ray.{kind}` runs the same steps on {c.nodes} x "
              f"{c.machine_type} (train.trainer={a4.train.trainer}); every node's command and env: "
              f"python -m a4ray.{kind} --dry-run"]
    return "\n".join(lines)
