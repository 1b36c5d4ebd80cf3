"""On-disk state of one artifact: where it is staged, its lock, its manifest, and the atomic publish.

For a target `<parent>/<name>`:

    <parent>/<name>/                    published: exactly the source's files + `.a4ray-manifest.json`
    <parent>/.<name>.a4ray-partial/     being staged; kept across crashes so the next run resumes; never
                                        looks done (no manifest until the rename that publishes it)
    <parent>/.<name>.a4ray-lock         flock held by whichever process stages it (a second line of defence
                                        behind the staging service: it also holds across Ray clusters)

The manifest lists every file with its size and mtime, so a cache check is a `stat` per file, never a
re-hash, and still notices a file truncated, replaced or edited in place since it was staged.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

MANIFEST = ".a4ray-manifest.json"
PARTIAL_MARKER = ".a4ray-partial.json"
MANIFEST_VERSION = 1
# Not part of an artifact: VCS internals change on every `git status`, and tools' download caches.
_SKIP_DIRS = {".git"}


class FileRecord(BaseModel):
    path: str
    size: int
    mtime_ns: int
    sha256: str | None = None


class Manifest(BaseModel):
    a4ray_manifest: int = MANIFEST_VERSION
    artifact: str
    source: str
    fingerprint: str
    resolved: str | None = None
    bytes: int
    files: list[FileRecord]
    staged_at: str
    staged_on: str
    duration_s: float


@dataclass(frozen=True)
class ArtifactPaths:
    target: Path

    @property
    def partial(self) -> Path:
        return self.target.parent / f".{self.target.name}.a4ray-partial"

    @property
    def lock_file(self) -> Path:
        return self.target.parent / f".{self.target.name}.a4ray-lock"

    @property
    def manifest(self) -> Path:
        return self.target / MANIFEST


def walk_files(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(relative posix path, stat) of every regular file under `root`, minus VCS internals and our own files."""
    stack = [root]
    while stack:
        current = stack.pop()
        with os.scandir(current) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name not in _SKIP_DIRS:
                        stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    rel = Path(entry.path).relative_to(root).as_posix()
                    if rel not in (MANIFEST, PARTIAL_MARKER):
                        yield rel, entry.stat(follow_symlinks=False)


def tree_bytes(root: Path) -> int:
    """Bytes under `root`, everything included (for progress: tools' temporary files count too)."""
    total = 0
    stack = [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(Path(entry.path))
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:  # a temporary file renamed under us
                        pass
        except FileNotFoundError:
            pass
    return total


CacheState = Literal["hit", "absent", "other-source", "modified", "unmanaged"]


@dataclass
class CacheCheck:
    state: CacheState
    detail: str = ""
    manifest: Manifest | None = None


def read_manifest(paths: ArtifactPaths) -> Manifest | None:
    try:
        return Manifest.model_validate_json(paths.manifest.read_bytes())
    except (OSError, ValueError):  # absent, the target is a file, or not a manifest we can read
        return None


def check_published(paths: ArtifactPaths, fingerprint: str) -> CacheCheck:
    """Is the target published from this fingerprint and unchanged since? One stat per file, no hashing."""
    if not paths.target.exists():
        return CacheCheck("absent")
    manifest = read_manifest(paths)
    if manifest is None:
        return CacheCheck("unmanaged", f"{paths.target} exists but has no a4ray manifest (staged by hand or "
                          "by another tool)")
    if manifest.fingerprint != fingerprint:
        return CacheCheck("other-source", f"{paths.target} holds {manifest.source} staged with other settings "
                          f"(artifact {manifest.artifact!r})", manifest)
    for record in manifest.files:
        try:
            st = os.stat(paths.target / record.path)
        except FileNotFoundError:
            return CacheCheck("modified", f"{record.path} is missing from {paths.target}", manifest)
        if st.st_size != record.size or st.st_mtime_ns != record.mtime_ns:
            what = "size" if st.st_size != record.size else "modification time"
            return CacheCheck("modified", f"{record.path} in {paths.target} changed since it was staged "
                              f"({what} differs)", manifest)
    return CacheCheck("hit", manifest=manifest)


@contextlib.contextmanager
def locked(paths: ArtifactPaths, on_wait: Callable[[float], None] | None = None,
           poll_s: float = 2.0) -> Iterator[None]:
    """Hold the artifact's flock. The kernel drops it when the holder dies, so a crash never wedges it."""
    paths.lock_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(paths.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        started = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if on_wait:
                    on_wait(time.monotonic() - started)
                time.sleep(poll_s)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_marker(partial: Path, data: dict) -> None:
    (partial / PARTIAL_MARKER).write_text(json.dumps(data, sort_keys=True))


def read_marker(partial: Path) -> dict | None:
    try:
        return json.loads((partial / PARTIAL_MARKER).read_text())
    except (FileNotFoundError, ValueError):
        return None


def remove_tree(path: Path) -> None:
    """Delete a directory by renaming it aside first, so a crash mid-delete leaves no half tree in place."""
    if not path.exists():
        return
    aside = path.parent / f".{path.name}.a4ray-trash-{uuid.uuid4().hex[:8]}"
    path.rename(aside)
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some network filesystems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def publish(paths: ArtifactPaths, manifest: Manifest) -> str:
    """Write the manifest into the partial directory, then make it the target with one rename.

    Returns the manifest's sha256. A crash before the rename leaves only the partial directory; after it,
    the complete artifact. There is no moment where a target exists without all its files.
    """
    body = manifest.model_dump_json(indent=2).encode()
    with open(paths.partial / MANIFEST, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    (paths.partial / PARTIAL_MARKER).unlink(missing_ok=True)
    _fsync_path(paths.partial)
    os.rename(paths.partial, paths.target)
    _fsync_path(paths.target.parent)
    return hashlib.sha256(body).hexdigest()
