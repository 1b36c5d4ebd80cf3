"""Rehearsing a recipe where there is no A4 cluster: its local profile `jobs/<kind>_local.yaml` (tiny
stand-ins, a trainer that runs on CPUs), and afterwards what the same command runs on A4.

`python -m a4ray.<recipe>` rehearses when it would start an embedded local cluster (no --address, no
RAY_ADDRESS, no Ray cluster running here), is not a dry run and was given no --config (the driver asks
`local_profile`); after a rehearsal that passed, it prints `a4_summary`.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from a4ray.core.errors import A4RayError
from a4ray.pipeline.runner import Pipeline, PipelineResult
from a4ray.pipeline.steps import Convert, Train, steps_of
from a4ray.spec.loader import load_job

JOBS_DIR = Path(__file__).resolve().parents[2] / "jobs"


def local_profile(kind: str) -> Path | None:
    """The recipe's local rehearsal profile, if it has one."""
    path = JOBS_DIR / f"{kind}_local.yaml"
    return path if path.is_file() else None


def shown(path: Path) -> str:
    """`path` relative to the current directory where it is under it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def a4_summary(kind: str, sets: list[str], result: PipelineResult) -> str:
    """After a local rehearsal: the outputs, and what the same pipeline launches on A4 (the recipe's defaults)."""
    lines = ["", f"outputs of this rehearsal (run directory {result.run_dir}):"]
    for step in result.steps:
        lines += [f"  {step.name}: {what}: {path}" for what, path in step.outputs.items()]
    lines.append(f"  logs: {result.run_dir}/logs/train (one file per node and per rank)")
    try:
        a4 = load_job(None, sets, kind=kind)
        Pipeline(a4).check()
        note = f" with {' '.join('--set ' + s for s in sets)}" if sets else ""
    except A4RayError:
        a4, note = load_job(None, [], kind=kind), " (your --set values do not apply to A4; shown without them)"
    ws, c = a4.storage.workspace, a4.cluster
    lines += ["", f"on A4, `python -m a4ray.{kind}`{note} runs the same steps on {c.nodes} x {c.machine_type} "
              f"({c.gpus_per_node} GPUs each), workspace {ws}:",
              f"  stage: {len(a4.artifacts)} artifact(s):"]
    lines += [f"    {a.name} <- {a.source}" for a in a4.artifacts]
    steps = {step.name: step for step in steps_of(a4, ws)}
    convert, train = steps[Convert.name], steps[Train.name]
    if convert.not_needed():
        lines.append(f"  convert: skipped: {convert.not_needed()}")
    else:
        lines.append(f"  convert: {convert.runs()} -> {a4.converted(ws)}")
        lines += [f"    {line}" for line in convert.plan(ws)[1:]]
    lines.append("  preflight: a4ray doctor on every node of the gang")
    lines.append(f"  train: {train.runs()}")
    for node in train.trainer.plan().nodes:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in node.env.items())
        cd = f"cd {node.cwd} && " if node.cwd else ""
        lines.append(f"    node {node.rank}: {cd}{env} {shlex.join(node.argv)}")
    lines.append(f"    checkpoints: {train.trainer.checkpoints}")
    lines.append(f"  the whole plan (env layers, 27 arguments by name): python -m a4ray.{kind} --dry-run")
    return "\n".join(lines)
