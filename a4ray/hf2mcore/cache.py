"""Where conversions go, and when one can be reused.

Every conversion has a key: a hash of the input's fingerprint (staging's manifest, else file sizes and
times), the backend, the options that change the bytes written, and the versions of what writes them.
Its checkpoint lives in `<output>/<key[:12]>/`, created only by renaming a finished, verified temporary
directory into place, and describes itself in `a4ray-convert.json`. `<output>/latest` points at the
newest good one. A second run with the same key finds the record and does nothing; a changed input or
option gets a new key and a new directory, never one written over a good checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

import psutil
from pydantic import BaseModel

from a4ray.core.console import say, warn
from a4ray.mcore.names import TRACKER

RECORD = "a4ray-convert.json"
OWNER = ".a4ray-owner"  # in a temporary directory: the process writing it
LATEST = "latest"
FAILED = ".failed"
CONVERTER_VERSION = 1  # bump when the native writer's output changes for the same input and options


class VerifyReport(BaseModel):
    ok: bool
    logits_checked: bool = False
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    logits_scale: float | None = None
    top1_agreement: float | None = None
    tolerance: float | None = None
    tensors_checked: int = 0
    tensors_equal: int = 0
    # Not identical after the round trip, yet the checkpoint holds exactly what the mapping defines: a
    # shifted slot (Qwen3-Next's gated norm, w - 1) where w - 1 is not representable in the dtype.
    tensors_rounded: int = 0
    round_trip_max_diff: float | None = None
    unexpected_keys: list[str] = []
    missing_keys: list[str] = []
    problems: list[str] = []
    duration_s: float = 0.0
    node: str = ""

    def summary(self) -> str:
        parts = []
        if self.logits_checked:
            parts.append(f"logits max |diff| {self.max_abs_diff:.3g} (rel {self.max_rel_diff:.3g}, scale "
                         f"{self.logits_scale:.3g}, tolerance {self.tolerance:g}), top-1 agreement "
                         f"{self.top1_agreement:.1%}")
        if self.tensors_checked:
            parts.append(f"round trip {self.tensors_equal}/{self.tensors_checked} HF tensors identical"
                         + (f", {self.tensors_rounded} equal up to the rounding of the zero-centred norm shift "
                            "(the checkpoint holds exactly the mapping's value)" if self.tensors_rounded else "")
                         + (f" (max |diff| {self.round_trip_max_diff:.3g})" if self.round_trip_max_diff else ""))
        return "; ".join(parts + self.problems) or "nothing checked"


class PartRecord(BaseModel):
    index: int
    groups: str  # e.g. "layers 0-11" or "embedding, layers 0-3"
    bytes: int
    node: str = ""
    seconds: float = 0.0


class ConvertRecord(BaseModel):
    """`a4ray-convert.json`: what this checkpoint is, where it came from, and how it was checked."""

    key: str
    backend: str
    created: str
    input: str
    input_fingerprint: dict
    options: dict
    versions: dict
    architecture: dict = {}
    format: str = "torch_dist"
    naming: str = "te"
    dtype: str = ""
    layout: dict = {}  # nodes, tasks per node, parts (the parallel layout of the conversion itself)
    parts: list[PartRecord] = []
    files: dict[str, int] = {}  # relative path -> size: a cheap check that nothing went missing
    bytes: int = 0
    seconds: float = 0.0
    verify: VerifyReport | None = None


def cache_key(fingerprint: dict, backend: str, options: dict, versions: dict) -> str:
    blob = json.dumps({"input": fingerprint, "backend": backend, "options": options, "versions": versions},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class OutputDir:
    """`<output>/`: committed conversions by key, temporaries, failed ones, and the `latest` pointer."""

    def __init__(self, root: Path, key: str):
        self.root = root
        self.key = key

    @property
    def final(self) -> Path:
        return self.root / self.key[:12]

    def existing(self) -> ConvertRecord | None:
        """The record of a complete conversion with this key, or None. A damaged one is moved aside."""
        record_file = self.final / RECORD
        if not record_file.is_file():
            return self._set_aside(f"it has no {RECORD}") if self.final.exists() else None
        try:
            record = ConvertRecord.model_validate_json(record_file.read_text())
        except ValueError as e:
            return self._set_aside(f"unreadable {RECORD} ({e})")
        if record.key != self.key:
            return self._set_aside(f"its key {record.key[:12]}... is not this conversion's")
        for rel, size in record.files.items():
            path = self.final / rel
            if not path.is_file() or path.stat().st_size != size:
                return self._set_aside(f"{rel} is missing or changed size")
        return record

    def _set_aside(self, why: str) -> None:
        target = self._failed_path("damaged")
        warn(f"{self.final} is not a complete conversion: {why}; moved to {target}, converting again")
        self.final.rename(target)
        return None

    def _failed_path(self, what: str) -> Path:
        (self.root / FAILED).mkdir(parents=True, exist_ok=True)
        return self.root / FAILED / f"{self.key[:12]}-{what}-{time.strftime('%Y%m%d-%H%M%S')}"

    def temporary(self) -> Path:
        """A fresh temporary directory, marked with its owner (host, pid), after removing the temporaries
        of runs that died on this host without cleaning up (killed drivers)."""
        self._sweep_stale()
        path = self.root / f".tmp-{self.key[:12]}-{uuid.uuid4().hex[:6]}"
        path.mkdir(parents=True)
        (path / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        return path

    def _sweep_stale(self) -> None:
        for tmp in self.root.glob(".tmp-*"):
            try:
                owner = json.loads((tmp / OWNER).read_text())
            except (OSError, ValueError):
                continue
            if owner.get("host") == socket.gethostname() and not psutil.pid_exists(owner.get("pid", -1)):
                say(f"removing {tmp}: left by a conversion whose process (pid {owner['pid']}) is gone")
                shutil.rmtree(tmp, ignore_errors=True)

    def commit(self, tmp: Path, record: ConvertRecord) -> Path:
        """Record the files, then rename the temporary into place. If another run committed the same
        key meanwhile, theirs stays and ours is dropped: both are the same conversion."""
        (tmp / OWNER).unlink(missing_ok=True)
        record.files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        record.bytes = sum(record.files.values())
        write_record(tmp, record)
        try:
            os.rename(tmp, self.final)
        except OSError:
            if self.existing() is None:
                raise
            say(f"another run committed {self.final} first; keeping it")
            shutil.rmtree(tmp, ignore_errors=True)
        self.point_latest()
        return self.final

    def point_latest(self) -> None:
        link = self.root / LATEST
        tmp_link = self.root / f".{LATEST}-{uuid.uuid4().hex[:6]}"
        os.symlink(self.final.name, tmp_link)
        os.replace(tmp_link, link)

    def discard(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def keep_failed(self, path: Path) -> Path:
        """Keep a checkpoint that failed verification for inspection, without its tracker file, so that
        nothing loads it as a checkpoint (and `latest` no longer points at it)."""
        (path / TRACKER).unlink(missing_ok=True)
        link = self.root / LATEST
        if link.is_symlink() and link.resolve() == path.resolve():
            link.unlink()
        target = self._failed_path("verify-failed")
        path.rename(target)
        return target


def write_record(directory: Path, record: ConvertRecord) -> None:
    tmp = directory / f".{RECORD}.tmp"
    tmp.write_text(record.model_dump_json(indent=2))
    os.replace(tmp, directory / RECORD)
