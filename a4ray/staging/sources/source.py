"""What every source scheme provides: a listing (files, sizes, digests the source vouches for) and a
resumable fetch into the partial directory. Verification and publishing are shared (`a4ray.staging.task`).
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from a4ray.core.errors import StagingError
from a4ray.spec.artifacts import ArtifactSpec, SourceRef, StagingOptions

_CHUNK = 8 * 2**20


@dataclass
class RemoteFile:
    path: str  # relative path inside the artifact
    size: int | None  # None: the source does not say (an HTTP server without Content-Length)
    digests: dict[str, str] = field(default_factory=dict)  # algorithm -> hex: sha256, md5, git-sha1


@dataclass
class Listing:
    files: list[RemoteFile]
    resolved: str | None = None  # the immutable version staged (commit, ...), for the manifest

    @property
    def total(self) -> int | None:
        sizes = [f.size for f in self.files]
        return None if any(s is None for s in sizes) else sum(sizes)  # type: ignore[arg-type]


@dataclass
class FetchContext:
    partial: Path
    max_workers: int
    token: str | None = None
    # Digests computed while the bytes streamed past (path -> algorithm -> hex), so they are not re-read.
    computed: dict[str, dict[str, str]] = field(default_factory=dict)


class Source(ABC):
    """One scheme. `list()` talks to the source (cheap); `fetch()` moves the bytes, resuming what is there."""

    scheme: ClassVar[str]
    uses_token: ClassVar[bool] = False

    def __init__(self, artifact: ArtifactSpec, options: StagingOptions):
        self.artifact = artifact
        self.options = options
        self.ref: SourceRef = artifact.ref

    def version(self) -> str | None:
        """The source's current version where it can change under the same URI (a local directory), so a
        cache hit can be checked against it; None for immutable sources (a commit, a pinned revision)."""
        return None

    def error(self, message: str, hint: str | None = None) -> StagingError:
        return StagingError(self.artifact.name, message, hint=hint)

    @abstractmethod
    def describe(self) -> str:
        """One line for a dry run: what is fetched, with which library."""

    @abstractmethod
    def list(self, token: str | None) -> Listing:
        ...

    @abstractmethod
    def fetch(self, listing: Listing, ctx: FetchContext) -> None:
        ...

    def verify(self, listing: Listing, ctx: FetchContext) -> None:
        """Every listed file is there with its size and every digest the source vouches for."""
        verify_files(self, listing.files, ctx)

    def junk(self, partial: Path) -> list[Path]:
        """Tool state inside the partial directory that is not part of the artifact (removed before publish)."""
        return []


def select(names: Iterable[str], artifact: ArtifactSpec) -> list[str]:
    """The source's files this artifact takes: `files` (each must exist) plus `include` globs, minus `exclude`."""
    from huggingface_hub.utils import filter_repo_objects  # the Hub's glob semantics, for every scheme alike

    names = list(names)
    wanted = set(artifact.files)
    missing = wanted - set(names)
    if missing:
        raise StagingError(artifact.name, f"not in {artifact.source}: {', '.join(sorted(missing))}",
                           hint="check `files:` against the source (names are relative to it)")
    chosen = set(names)
    if artifact.files or artifact.include:
        matched = set(filter_repo_objects(names, allow_patterns=artifact.include)) if artifact.include else set()
        chosen = wanted | matched
    if artifact.exclude:
        chosen = set(filter_repo_objects(sorted(chosen), ignore_patterns=artifact.exclude))
    if not chosen:
        raise StagingError(artifact.name, f"no files of {artifact.source} match include={artifact.include} "
                           f"exclude={artifact.exclude}", hint="fix the patterns")
    return sorted(chosen)


def file_digest(path: Path, algorithm: str) -> str:
    """Hex digest of a file: sha256 / md5, or `git-sha1` (the git blob id the Hub lists for small files)."""
    if algorithm == "git-sha1":
        h = hashlib.sha1(f"blob {os.path.getsize(path)}\0".encode())
    else:
        h = hashlib.new(algorithm)
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def parallel(fn: Callable, items: list, workers: int) -> list:
    """Map `fn` over `items` on threads; the first exception propagates after the others finish."""
    if len(items) <= 1 or workers <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="a4ray-stage") as pool:
        return list(pool.map(fn, items))


def verify_files(source: Source, files: list[RemoteFile], ctx: FetchContext) -> None:
    expected_sha = source.artifact.sha256

    def check(remote: RemoteFile) -> str | None:
        path = ctx.partial / remote.path
        if not path.is_file():
            return f"{remote.path}: missing after download"
        size = path.stat().st_size
        if remote.size is not None and size != remote.size:
            return f"{remote.path}: {size} bytes, the source says {remote.size}"
        wanted = dict(remote.digests)
        if remote.path in expected_sha:
            wanted["sha256"] = expected_sha[remote.path]
        known = ctx.computed.setdefault(remote.path, {})
        for algorithm, digest in wanted.items():
            actual = known.get(algorithm) or file_digest(path, algorithm)
            known[algorithm] = actual
            if actual != digest:
                path.unlink()  # never resume from, or publish, bytes known to be wrong
                return f"{remote.path}: {algorithm} {actual} does not match {digest}"
        return None

    problems = [p for p in parallel(check, files, ctx.max_workers) if p]
    unknown = set(expected_sha) - {f.path for f in files}
    problems += [f"sha256 given for {name}, which is not among the staged files" for name in sorted(unknown)]
    if problems:
        raise source.error("verification failed: " + "; ".join(problems[:5])
                           + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""),
                           hint="bad files were deleted; run again to fetch them anew. If it repeats, the "
                           "source changed or the expected digests are wrong")
