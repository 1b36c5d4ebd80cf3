"""Load a job spec: a YAML file (or a kind's defaults), its `kind:` picking the model, then `--set`
overrides, validated as one (`overrides` explains what is wrong, naming the file and field)."""

from __future__ import annotations

import copy
from pathlib import Path

from a4ray.core.errors import SpecError
from a4ray.spec.job import JOB_KINDS
from a4ray.spec.overrides import apply_overrides, assign_all, parse_sets, parse_yaml, validate


def load_job(path: str | Path | None, sets: list[str] | tuple[str, ...] = (), kind: str | None = None):
    """Load a job spec: YAML file (or the kind's defaults when `path` is None), then `--set` overrides."""
    if path is None:
        data, source = {}, f"<defaults of {kind}>"
    else:
        source = str(path)
        file = Path(path)
        if not file.is_file():
            raise SpecError(source, ["file not found"], hint="pass --config with a path to a YAML spec, e.g. jobs/ddp_test.yaml")
        data = parse_yaml(file.read_text(), source)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise SpecError(source, [f"the top level must be a mapping of fields, got {type(data).__name__}"])
    given = data.get("kind")
    if kind and given and given != kind:
        raise SpecError(source, [f"kind: this is a '{given}' spec, but this entry point runs '{kind}'"],
                        hint=f"use a spec with `kind: {kind}`, or the entry point for {given}")
    data.setdefault("kind", kind or given)
    cls = JOB_KINDS.get(data["kind"])
    if cls is None:
        raise SpecError(source, [f"kind: unknown job kind {data['kind']!r} (known: {', '.join(sorted(JOB_KINDS))})"])
    overrides = parse_sets(list(sets))
    try:
        spec = validate(cls, data, source)
    except SpecError:
        if not overrides:
            raise
        # The file alone may lack what an override supplies (a required field): validate them together.
        merged = copy.deepcopy(data)
        return validate(cls, merged, source, assign_all(merged, overrides))
    # Overrides apply to the full spec, defaults included, so `a.list[0].x=` reaches default lists too.
    return apply_overrides(spec, overrides)
