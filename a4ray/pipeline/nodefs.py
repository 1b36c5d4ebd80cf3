"""Small file operations on a node of the job's machine type, where the shared workspace is mounted.

The driver of a Ray job need not mount the workspace (`ray job submit` runs it on the head pod), so what
a pipeline checks or records there (a skipped step's outputs, a trainer's inputs, step markers) goes
through one short Ray task on a node the gang could use.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ray

from a4ray.spec.cluster import ClusterSpec

_TIMEOUT_S = 120


def _exists(paths: list[str]) -> list[bool]:
    return [os.path.exists(p) for p in paths]


def _read(path: str, limit: int) -> str | None:
    try:
        with open(path) as f:
            return f.read(limit)
    except (OSError, UnicodeDecodeError):
        return None


def _write(path: str, text: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, target)


def _on_node(cluster: ClusterSpec, fn, *args):
    task = ray.remote(fn).options(num_cpus=0, resources={cluster.node_resource: 0.001}, max_retries=1)
    return ray.get(task.remote(*args), timeout=_TIMEOUT_S)


def missing(cluster: ClusterSpec, needed: dict[str, str]) -> list[str]:
    """`what (path)` for each entry of {what: path} that does not exist on a node."""
    if not needed:
        return []
    present = _on_node(cluster, _exists, list(needed.values()))
    return [f"{what} ({path})" for (what, path), ok in zip(needed.items(), present) if not ok]


def read_text(cluster: ClusterSpec, path: str, limit: int = 1 << 20) -> str | None:
    return _on_node(cluster, _read, path, limit)


def read_json(cluster: ClusterSpec, path: str) -> dict | None:
    text = read_text(cluster, path)
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def write_text(cluster: ClusterSpec, path: str, text: str) -> None:
    _on_node(cluster, _write, path, text)
