"""Load a job spec: a YAML file (or a kind's defaults), its `kind:` picking the model, then `--set`
overrides, validated as one (`overrides` explains what is wrong, naming the file and field)."""

from __future__ import annotations

import copy
import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from a4ray.core.errors import SpecError
from a4ray.spec.job import JOB_KINDS
from a4ray.spec.overrides import Given, apply_overrides, assign_all, parse_sets, read_yaml_file, validate


def load_job(path: str | Path | None, sets: Sequence[Given] = (), kind: str | None = None):
    """Load a job spec: YAML file (or the kind's defaults when `path` is None), then `--set` overrides (and
    those an option stands for, `(assignment, option)`: `overrides.Given`)."""
    if path is None:
        data, source = {}, f"<defaults of {kind}>"
    else:
        source = str(path)
        data = read_yaml_file(Path(path), source)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise SpecError(source, [f"the top level must be a mapping of fields (kind: ..., cluster: ...), got "
                                     f"a {type(data).__name__}"], hint="see jobs/ddp_test.yaml for the shape")
    given = data.get("kind")
    if given is not None:
        check_kind(given, source)
    if kind and given and given != kind:
        raise SpecError(source, [f"kind: this is a '{given}' spec, but this entry point runs '{kind}'"],
                        hint=f"use a spec with `kind: {kind}`, or the entry point for {given}")
    data.setdefault("kind", kind or given)
    if data["kind"] is None:
        raise SpecError(source, [f"kind: missing: the spec must say which job it is (one of {', '.join(sorted(JOB_KINDS))})"],
                        hint="add e.g. `kind: ddp_test` at the top, or run it with the job's own command "
                        "(python -m a4ray.ddp_test -f FILE)")
    check_kind(data["kind"], source)
    cls = JOB_KINDS[data["kind"]]
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


def check_kind(kind: Any, source: str) -> None:
    """Refuse a `kind:` that names no job kind (or is not a name at all), suggesting the closest."""
    if isinstance(kind, str) and kind in JOB_KINDS:
        return
    known = sorted(JOB_KINDS)
    if not isinstance(kind, str):
        raise SpecError(source, [f"kind: expected a job kind name (one of {', '.join(known)}), got a "
                                 f"{type(kind).__name__}"])
    close = difflib.get_close_matches(kind, known, n=1, cutoff=0.5)
    raise SpecError(source, [f"kind: unknown job kind {kind!r}" + (f"; did you mean '{close[0]}'?" if close else "")
                             + f" (known: {', '.join(known)})"])
