"""One `Source` per URI scheme; `source_for(artifact)` picks it."""

from __future__ import annotations

from a4ray.spec.artifacts import ArtifactSpec, StagingOptions
from a4ray.staging.sources.source import FetchContext, Listing, RemoteFile, Source


def source_for(artifact: ArtifactSpec, options: StagingOptions) -> Source:
    from a4ray.staging.sources.fs import FsSource
    from a4ray.staging.sources.git import GitSource
    from a4ray.staging.sources.http import HttpSource
    from a4ray.staging.sources.hub import HfSource

    scheme = artifact.ref.scheme
    cls = {"hf": HfSource, "https": HttpSource, "git": GitSource, "file": FsSource, "gs": FsSource}[scheme]
    return cls(artifact, options)


__all__ = ["FetchContext", "Listing", "RemoteFile", "Source", "source_for"]
