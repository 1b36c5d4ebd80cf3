"""Staging one artifact, as its Ray task runs it on a node that mounts the target:

    lock -> cache check (stat only) -> list the source -> fetch into the partial directory (resuming)
         -> verify (sizes, digests the source vouches for) -> manifest -> one atomic rename

Whatever stops it (error, kill, node loss) leaves at most the partial directory, which the next run
resumes; a published target is always complete and verified.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import socket
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, field_validator

from a4ray.core.errors import A4RayError, StagingError
from a4ray.core.redact import redact_url, register_secret
from a4ray.spec.artifacts import TOKEN_ENV, ArtifactSpec, StagingOptions
from a4ray.staging.display import Progress, Reporter, human_bytes
from a4ray.staging.layout import (
    ArtifactPaths,
    FileRecord,
    Manifest,
    check_published,
    locked,
    publish,
    read_marker,
    remove_tree,
    tree_bytes,
    walk_files,
    write_marker,
)
from a4ray.staging.sources import FetchContext, Listing, Source, source_for

Status = Literal["ran", "cached", "joined", "failed"]


class StageRequest(BaseModel):
    artifact: ArtifactSpec
    options: StagingOptions
    target: str  # absolute
    workspace: str  # absolute; must exist on the node (the shared mount)
    job: str = ""  # who asked, for messages
    log: str = ""  # where the task's output goes (the requesting run's logs: observe/stream.py); "": Ray's own way


class ArtifactOutcome(BaseModel):
    """What happened to one artifact. `joined`: another request was staging it; this one waited for it."""

    name: str
    source: str
    target: str
    status: Status
    duration_s: float = 0.0
    bytes: int = 0
    files: int = 0
    fetched_bytes: int = 0  # moved by this staging
    resumed_bytes: int = 0  # already in the partial directory from an earlier, interrupted one
    resolved: str | None = None
    manifest: str = ""
    manifest_sha256: str = ""
    node: str = ""
    error: str | None = None

    @field_validator("source")
    @classmethod
    def _no_credentials(cls, source: str) -> str:
        return redact_url(source)  # an outcome is printed and recorded: never a URL's credentials


def read_token(options: StagingOptions, artifact: str) -> str | None:
    """The Hub token on this node: staging.token_file, else HF_TOKEN / HUGGING_FACE_HUB_TOKEN. Masked from here on."""
    token = None
    if options.token_file:
        try:
            token = Path(options.token_file).read_text().strip()
        except OSError as e:
            raise StagingError(artifact, f"cannot read staging.token_file {options.token_file} on "
                               f"{socket.gethostname()}: {e.strerror}",
                               hint="mount the Secret holding the token at that path on every node") from None
        if not token:
            raise StagingError(artifact, f"staging.token_file {options.token_file} is empty")
    else:
        token = next((os.environ[name] for name in TOKEN_ENV if os.environ.get(name)), None)
    if token:
        register_secret(token)
    return token


def _disk_full(error: BaseException) -> bool:
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = error.__cause__ or error.__context__
    return False


class _Staging:
    def __init__(self, request: StageRequest, reporter: Reporter):
        self.req = request
        self.artifact = request.artifact
        self.paths = ArtifactPaths(Path(request.target))
        self.reporter = reporter
        self.fingerprint = request.artifact.fingerprint()
        self.started = time.monotonic()

    def error(self, message: str, hint: str | None = None) -> StagingError:
        return StagingError(self.artifact.name, message, hint=hint)

    def outcome(self, status: Status, manifest: Manifest, manifest_sha: str, **extra) -> ArtifactOutcome:
        return ArtifactOutcome(
            name=self.artifact.name, source=self.artifact.source, target=str(self.paths.target), status=status,
            duration_s=time.monotonic() - self.started, bytes=manifest.bytes, files=len(manifest.files),
            resolved=manifest.resolved, manifest=str(self.paths.manifest), manifest_sha256=manifest_sha,
            node=socket.gethostname(), **extra,
        )

    def run(self) -> ArtifactOutcome:
        workspace = Path(self.req.workspace)
        if not workspace.is_dir():
            raise self.error(f"the workspace {workspace} does not exist on node {socket.gethostname()}",
                             hint="mount the shared workspace (storage.workspace) on every node, or select the "
                             "nodes that have it with staging.node_labels")
        try:
            self.paths.target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self.error(f"cannot create {self.paths.target.parent}: {e.strerror}",
                             hint="check the permissions of the workspace") from None
        with locked(self.paths, on_wait=self._waiting):
            self._claim_lock()
            return self._run_locked()

    def _claim_lock(self) -> None:
        # Who holds it, for anyone who waits (read in _waiting); the flock itself is the guarantee.
        self.paths.lock_file.write_text(f"{socket.gethostname()} pid {os.getpid()} job {self.req.job}\n")

    def _waiting(self, seconds: float) -> None:
        try:
            holder = self.paths.lock_file.read_text().strip()
        except OSError:
            holder = "another process"
        self.reporter.update(phase="waiting", note=f"locked by {holder} for {seconds:.0f}s")

    def _run_locked(self) -> ArtifactOutcome:
        check = check_published(self.paths, self.fingerprint)
        source = source_for(self.artifact, self.req.options)
        if check.state == "hit":
            assert check.manifest is not None
            version = source.version()
            if version is None or version == check.manifest.resolved:
                digest = hashlib.sha256(self.paths.manifest.read_bytes()).hexdigest()
                return self.outcome("cached", check.manifest, digest)
            # The source itself changed since it was staged (a regenerated local directory): restage it.
            self.reporter.update(phase="listing", note="the source changed since it was staged")
            self._set_aside(source)
        elif check.state != "absent":
            if not self.req.options.replace:
                raise self.error(check.detail, hint="restage it with --replace (staging.replace=true; files "
                                 "that verify are reused), or give this artifact another target")
            self._set_aside(source)
        token = read_token(self.req.options, self.artifact.name) if source.uses_token else None
        self.reporter.update(phase="listing", note="")
        listing = source.list(token)
        resumed = self._prepare_partial(listing)
        self._check_space(listing, resumed)
        # A local source is copied, not downloaded: the line a person watches says which.
        moving = "copying" if self.artifact.ref.scheme == "file" else "downloading"
        self.reporter.update(phase=moving, total=listing.total, bytes=resumed)
        ctx = FetchContext(self.paths.partial, self.req.options.max_workers, token)
        try:
            with self.reporter.watching(self.paths.partial):
                source.fetch(listing, ctx)
            self.reporter.update(phase="verifying", rate=0.0)
            source.verify(listing, ctx)
        except A4RayError:
            raise
        except OSError as e:
            if _disk_full(e):
                raise self._disk_full_error() from None
            raise self.error(f"staging into {self.paths.partial} failed: {e}") from None
        self.reporter.update(phase="publishing", bytes=listing.total or 0)
        manifest = self._manifest(source, listing, ctx)
        digest = publish(self.paths, manifest)
        fetched = max(0, manifest.bytes - resumed)
        return self.outcome("ran", manifest, digest, fetched_bytes=fetched, resumed_bytes=min(resumed, manifest.bytes))

    def _set_aside(self, source: Source) -> None:
        """--replace: the old target becomes the partial directory when the source can re-verify its files."""
        if source.scheme in ("hf", "git") and self.paths.target.is_dir() and not self.paths.partial.exists():
            (self.paths.target / ".a4ray-manifest.json").unlink(missing_ok=True)
            os.rename(self.paths.target, self.paths.partial)
        else:
            remove_tree(self.paths.target)

    def _prepare_partial(self, listing: Listing) -> int:
        """Keep what an earlier attempt left if it staged the same thing; returns the bytes found."""
        partial = self.paths.partial
        marker = read_marker(partial)
        wanted = {"fingerprint": self.fingerprint, "resolved": listing.resolved}
        if marker is not None and marker != wanted:
            remove_tree(partial)  # staged from other settings or another revision: nothing to trust
        partial.mkdir(parents=True, exist_ok=True)
        write_marker(partial, wanted)
        return sum(st.st_size for _, st in walk_files(partial))

    def _check_space(self, listing: Listing, present: int) -> None:
        if listing.total is None:
            return
        need = listing.total - present
        free = shutil.disk_usage(self.paths.partial).free
        if need > free:
            raise self.error(f"needs {human_bytes(need)} more on {self.paths.target.parent}, which has "
                             f"{human_bytes(free)} free", hint="free space there or choose another target; "
                             "nothing was downloaded")

    def _disk_full_error(self) -> StagingError:
        free = shutil.disk_usage(self.paths.target.parent).free
        have = tree_bytes(self.paths.partial)
        return self.error(f"the disk filled up while staging into {self.paths.target.parent} ({human_bytes(free)} "
                          f"free now)", hint=f"free space and run again: the {human_bytes(have)} already "
                          f"downloaded in {self.paths.partial} are kept and resumed")

    def _manifest(self, source: Source, listing: Listing, ctx: FetchContext) -> Manifest:
        for junk in source.junk(self.paths.partial):
            if junk.is_dir():
                shutil.rmtree(junk, ignore_errors=True)
            else:
                junk.unlink(missing_ok=True)
        listed = {f.path for f in listing.files}
        records = []
        for path, st in sorted(walk_files(self.paths.partial)):
            if path not in listed:  # left by an older version of the artifact: not part of this one
                (self.paths.partial / path).unlink()
                continue
            sha = ctx.computed.get(path, {}).get("sha256")
            records.append(FileRecord(path=path, size=st.st_size, mtime_ns=st.st_mtime_ns, sha256=sha))
        return Manifest(
            artifact=self.artifact.name, source=redact_url(self.artifact.source), fingerprint=self.fingerprint,
            resolved=listing.resolved, bytes=sum(r.size for r in records), files=records,
            staged_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), staged_on=socket.gethostname(),
            duration_s=round(time.monotonic() - self.started, 3),
        )


def run_stage(request: StageRequest, sink=None) -> ArtifactOutcome:
    """Stage one artifact here and now (the body of the Ray task). Raises StagingError on failure."""
    reporter = Reporter(request.artifact.name, request.target, sink)
    try:
        outcome = _Staging(request, reporter).run()
    except BaseException:
        reporter.update(phase="failed", rate=0.0)
        reporter.finished("failed")
        raise
    reporter.update(phase="done", rate=0.0, bytes=outcome.bytes, total=outcome.bytes)
    reporter.finished(outcome.status)
    return outcome


__all__ = ["ArtifactOutcome", "Progress", "StageRequest", "read_token", "run_stage"]
