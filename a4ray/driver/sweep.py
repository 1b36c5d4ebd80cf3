"""Experiments: one spec run over a grid of overrides, one variant after another on the same cluster.

    table = a4ray.sweep(spec, {"network.env.NCCL_IB_QPS_PER_CONNECTION": [1, 2, 4],
                               "network.env.NCCL_MIN_NCHANNELS": [16, 32]})   # 6 variants: the product
    table.to_pandas()        # one row per variant: its values, ok, the result's summary, the run id
    table.result(0).plot()   # a variant's own typed result

Every variant is validated before the first one runs (a bad path or value fails the sweep at once,
naming the field). Each is an ordinary run (its own run directory: resolved spec, logs, result);
`<workspace>/sweeps/<id>/sweep.json` lists them, rewritten after each, so `a4ray.get_sweep(id)` finds the
sweep again after a kernel restart, finished variants and all.
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from a4ray.core.console import say
from a4ray.core.errors import A4RayError
from a4ray.core.results import Result, axes, load_result
from a4ray.core.rundir import RunDir
from a4ray.driver import execute, session
from a4ray.spec.job import JobSpec

Grid = Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Any]]


class Variant(BaseModel):
    params: dict[str, Any]
    run_id: str
    run_dir: str
    ok: bool = False
    verdict: str = "not run"
    summary: dict[str, Any] = {}


class SweepResult(Result):
    kind: str = "sweep"
    id: str
    job: str
    dir: str
    params: list[str]
    variants: list[Variant] = []

    def rows(self) -> list[dict[str, Any]]:
        return [{**v.params, "ok": v.ok, **v.summary, "run": v.run_id} for v in self.variants]

    def result(self, index: int) -> Result:
        """Variant `index`'s own typed result."""
        variant = self.variants[index]
        path = Path(variant.run_dir) / "result.json"
        if not path.is_file():
            raise A4RayError(f"variant {index} ({variant.params}) has no result: {variant.verdict}")
        return load_result(path)

    def plot(self, metric: str | None = None, ax=None):
        """`metric` (default: the first numeric summary column) for each variant."""
        rows = [v for v in self.variants if v.ok]
        numeric = [k for k in (rows[0].summary if rows else {}) if isinstance(rows[0].summary[k], int | float)]
        metric = metric or (numeric[0] if numeric else None)
        if metric is None:
            raise A4RayError(f"sweep {self.id}: no numeric result to plot", hint=".to_pandas() has the table")
        ax = axes(ax, title=f"{self.job}: {metric}", xlabel=", ".join(self.params), ylabel=metric)
        labels = [", ".join(str(v.params[p]) for p in self.params) for v in rows]
        ax.bar(labels, [v.summary.get(metric) or 0 for v in rows])
        return ax


def variants(spec: JobSpec, grid: Grid) -> list[tuple[dict[str, Any], JobSpec]]:
    """Each variant's values and its validated spec: the product of a {path: values} grid, or a list of
    {path: value} dicts as given."""
    if isinstance(grid, Mapping):
        paths = list(grid)
        combos = [dict(zip(paths, values)) for values in itertools.product(*(grid[p] for p in paths))]
    else:
        combos = [dict(c) for c in grid]
    if not combos:
        raise A4RayError("the sweep has no variants", hint="give each path a non-empty list of values")
    out = []
    for params in combos:
        variant = spec
        for path, value in params.items():
            variant = variant.set(path, value)
        out.append((params, variant))
    return out


def sweep(spec: JobSpec, grid: Grid, *, stop_on_failure: bool = False) -> SweepResult:
    """Run every variant of `spec` over `grid`, one after another on this process's cluster (connecting
    as `a4ray.connect()` does if not connected yet)."""
    planned = variants(spec, grid)
    cluster = session.current() or session.connect(local_nodes=spec.cluster.placed_nodes,
                                                   gpus_per_node=spec.cluster.gpus_per_node)
    workspace = cluster.workspace(spec)
    params = list(planned[0][0])
    sweep_id = f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    result = SweepResult(ok=False, verdict="running", id=sweep_id, job=spec.name, dir="", params=params)
    for index, (values, variant) in enumerate(planned):
        run_dir = RunDir.create(workspace, variant.name)
        if not result.dir:
            result.dir = str(workspace / "sweeps" / sweep_id)
            Path(result.dir).mkdir(parents=True)
        say(f"sweep {sweep_id}: variant {index + 1}/{len(planned)}: "
            + ", ".join(f"{k}={v}" for k, v in values.items()))
        entry = Variant(params=values, run_id=run_dir.id, run_dir=str(run_dir.root))
        result.variants.append(entry)
        try:
            outcome = execute.run(variant, run_dir=run_dir.root)
            entry.ok, entry.verdict, entry.summary = outcome.ok, outcome.verdict, outcome.summary()
        except A4RayError as error:
            entry.verdict = f"ERROR: {error}"
        _save(result)
        if not entry.ok and stop_on_failure:
            break
    done = sum(v.ok for v in result.variants)
    result.ok = done == len(planned)
    result.verdict = f"{'OK' if result.ok else 'FAILED'}: {done}/{len(planned)} variants passed"
    _save(result)
    say(f"sweep {sweep_id}: {result.verdict}; {result.dir}")
    return result


def _save(result: SweepResult) -> None:
    path = Path(result.dir) / "sweep.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(result.model_dump_json(indent=2))
    tmp.replace(path)


def get_sweep(sweep_id: str, workspace: str | Path | None = None) -> SweepResult:
    """The sweep `sweep_id`, as recorded (after a kernel restart too)."""
    path = session.workspace(workspace) / "sweeps" / sweep_id / "sweep.json"
    if not path.is_file():
        raise A4RayError(f"no sweep {sweep_id!r} in {path.parent.parent}")
    return SweepResult.model_validate(json.loads(path.read_text()))
