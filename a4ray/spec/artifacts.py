"""Artifacts a job stages before it runs (models, datasets, code), and how they are staged.

An artifact is one source URI published as one directory under the workspace:

    hf://<org>/<repo>[@<revision>]            a Hugging Face model repo (hf://datasets/<org>/<repo> for datasets)
    https://host/path/file | https://host/dir/ (+ files:)   plain HTTP(S), resumable ranged GETs
    gs://bucket/prefix                        Google Cloud Storage (gcsfs)
    file:///abs/path | /abs/path | rel/path   a file or directory this machine (or every node) sees
    git+https://host/repo.git@<40-hex commit> a git checkout pinned to a commit (never a branch)

Any job kind that stages something includes `Staged` (its `artifacts:` list and `staging:` options), so a
pipeline recipe embeds the same artifact list the `stage` job uses.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal, Self
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from a4ray.core.redact import redact_url
from a4ray.spec.fields import MAX_CPUS_PER_NODE, NonNegativeInt, Number, PathStr, PositiveInt, Seconds, Spec
from a4ray.spec.job import JobSpec, job_kind

SCHEMES = ("hf", "https", "http", "gs", "file", "git+https", "git+http", "git+file")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


@dataclass(frozen=True)
class SourceRef:
    """A parsed source URI. `location` is a repo id (hf), URL (https, gs, git) or local path."""

    scheme: str  # "hf" | "https" | "gs" | "file" | "git"
    location: str
    revision: str | None = None
    repo_type: Literal["model", "dataset"] = "model"

    @property
    def pinned(self) -> bool:
        return self.scheme != "hf" or self.revision is not None


def parse_source(uri: str) -> SourceRef:
    """Parse a source URI; ValueError says what is wrong and what is expected."""
    uri = uri.strip()
    if not uri:
        raise ValueError("empty source")
    if "://" not in uri:
        return SourceRef("file", uri)  # a plain path
    scheme, _, rest = uri.partition("://")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme + '://'!r} (supported: "
                         + ", ".join(s + "://" for s in SCHEMES) + ", or a plain path)")
    if scheme == "hf":
        repo, at, revision = rest.partition("@")
        repo_type: Literal["model", "dataset"] = "model"
        if repo.startswith("datasets/"):
            repo, repo_type = repo.removeprefix("datasets/"), "dataset"
        if not _REPO_ID.match(repo):
            raise ValueError(f"{scheme}:// takes <org>/<repo>[@revision] (no user or token: the Hub token comes from the "
                             "nodes, see staging.token_file)")
        if at and not revision:
            raise ValueError(f"missing revision after '@' in {redact_url(uri)!r}: give a commit, tag or branch, or drop the '@'")
        return SourceRef(scheme, repo, revision or None, repo_type)
    if scheme.startswith("git+"):
        url, at, commit = rest.rpartition("@")
        if not at or "/" in commit:
            raise ValueError(f"git sources must pin a commit: {redact_url(uri)}@<40-hex commit> (a branch would float)")
        if not _COMMIT.match(commit):
            raise ValueError(f"{commit!r} is not a full commit SHA: pin the 40-hex commit, never a branch or tag "
                             f"(a4ray stages exactly one tree per artifact)")
        return SourceRef("git", f"{scheme.removeprefix('git+')}://{url}", commit)
    if scheme == "file":
        parts = urlsplit(uri)
        if parts.netloc not in ("", "localhost"):
            raise ValueError("file:// URIs take an absolute path (file:///abs/path)")
        return SourceRef("file", parts.path)
    parts = urlsplit(uri)
    if not parts.netloc:
        raise ValueError(f"{scheme}:// needs a host or bucket")
    return SourceRef("https" if scheme == "http" else scheme, uri)


class ArtifactSpec(Spec):
    """One source, published as one directory `target` (relative to the workspace, or absolute)."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$", description="short id used in logs and metrics")
    source: str = Field(description="hf://, https://, gs://, file://, git+https://...@<commit>, or a path")
    target: PathStr = Field(description="directory the artifact is published as, relative to the workspace")
    files: list[PathStr] = Field(default_factory=list,
                             description="exact files under the source (for https: names under a URL ending in /)")
    include: list[str] = Field(default_factory=list, description="glob patterns of files to take (default: all)")
    exclude: list[str] = Field(default_factory=list, description="glob patterns of files to leave out")
    sha256: dict[str, str] = Field(default_factory=dict, description="expected sha256 by file path, checked on arrival")
    submodules: bool = Field(True, description="git: check out submodules too (pinned by the commit)")

    @field_validator("source")
    @classmethod
    def _parses(cls, source: str) -> str:
        parse_source(source)
        return source.strip()

    @field_validator("target")
    @classmethod
    def _target(cls, target: str) -> str:
        path = PurePosixPath(target)
        if not target.strip() or path == PurePosixPath("/") or ".." in path.parts or target.strip() in (".", "./"):
            raise ValueError("must name a directory below the workspace (no '..', not the workspace itself)")
        return str(path)

    @field_validator("files")
    @classmethod
    def _relative_files(cls, files: list[str]) -> list[str]:
        for f in files:
            if not f or f.startswith("/") or ".." in PurePosixPath(f).parts:
                raise ValueError(f"{f!r}: files are relative paths under the source")
        return files

    @field_validator("sha256")
    @classmethod
    def _hex(cls, digests: dict[str, str]) -> dict[str, str]:
        bad = [name for name, digest in digests.items() if not _SHA256.match(digest.lower())]
        if bad:
            raise ValueError(f"not a 64-hex sha256 for {', '.join(bad)}")
        return {name: digest.lower() for name, digest in digests.items()}

    @model_validator(mode="after")
    def _fits_scheme(self) -> Self:
        ref = self.ref
        if ref.scheme == "https" and self.source.endswith("/") and not self.files:
            raise ValueError(f"{redact_url(self.source)} is a directory URL: list the files to fetch under `files:`")
        if ref.scheme == "https" and not self.source.endswith("/") and self.files:
            raise ValueError("`files:` needs a source URL ending in '/' (the files are fetched relative to it)")
        if ref.scheme == "git" and (self.files or self.include or self.exclude):
            raise ValueError("git sources stage the whole checkout: drop files/include/exclude")
        return self

    @property
    def ref(self) -> SourceRef:
        return parse_source(self.source)

    def fingerprint(self) -> str:
        """What the published directory must have been staged from; the name is only a label."""
        request = self.model_dump(mode="json", exclude={"name"})
        # Not the credentials in its URL: a signed URL signed again (it expires) is still the same source.
        request["source"] = redact_url(request["source"])
        return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()


class StagingOptions(Spec):
    """How artifacts are staged. Tokens never go in a spec: only where to read them on the nodes."""

    token_file: PathStr | None = Field(
        None, description="file on the nodes holding the Hub token (a mounted Kubernetes Secret); "
        f"else {' or '.join(TOKEN_ENV)} from the nodes' environment")
    hf_endpoint: str | None = Field(None, description="Hub endpoint for hf:// sources (a mirror); default: "
                                    "HF_ENDPOINT on the nodes, else huggingface.co")
    max_workers: PositiveInt = Field(8, description="files downloaded in parallel per artifact")
    retries: NonNegativeInt = Field(2, description="re-runs of a staging task whose worker or node died (resuming)")
    replace: bool = Field(False, description="replace a target staged from another source, modified, or "
                          "not staged by a4ray (its files are reused where they verify)")
    cpus: Number = Field(1, gt=0, le=MAX_CPUS_PER_NODE, description="Ray CPUs each staging task holds")
    node_labels: dict[str, str] = Field(
        default_factory=dict, description="Ray node label selector for nodes that mount the workspace (default: any)")

    @field_validator("token_file")
    @classmethod
    def _absolute(cls, path: str | None) -> str | None:
        if path is not None and not path.startswith("/"):
            raise ValueError("must be an absolute path on the nodes (e.g. a mounted Secret)")
        return path


class Staged(Spec):
    """Include in any job kind that stages artifacts before it runs."""

    artifacts: list[ArtifactSpec] = Field(default_factory=list)
    staging: StagingOptions = StagingOptions()

    def write_paths(self) -> list[tuple[tuple[str | int, ...], str]]:
        return [*super().write_paths(), *((("artifacts", i, "target"), a.target) for i, a in enumerate(self.artifacts))]

    @field_validator("artifacts")
    @classmethod
    def _distinct(cls, artifacts: list[ArtifactSpec]) -> list[ArtifactSpec]:
        seen: dict[str, str] = {}
        for a in artifacts:
            if a.name in seen:
                raise ValueError(f"two artifacts are named {a.name!r}")
            seen[a.name] = a.target
        targets = sorted((PurePosixPath(a.target), a.name) for a in artifacts)
        for (outer, n1), (inner, n2) in zip(targets, targets[1:]):
            if inner == outer or outer in inner.parents:
                raise ValueError(f"targets overlap: {n1!r} ({outer}) and {n2!r} ({inner}); each artifact "
                                 "needs its own directory")
        return artifacts


@job_kind
class StageJob(Staged, JobSpec):
    """`a4ray stage -f`: stage the artifacts onto the workspace, nothing else."""

    kind: Literal["stage"] = "stage"
    timeout_s: Seconds | None = Field(None, description="wall-clock limit of the whole staging")
