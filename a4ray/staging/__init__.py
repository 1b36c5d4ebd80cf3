"""Staging: models, datasets and code onto the shared workspace as Ray tasks, exactly once, resumable, verified.

    from a4ray.staging import stage
    result = stage(spec)            # on the connected cluster: any spec with `artifacts:`, or a list of them
    result.artifacts[0].status      # "ran" | "cached" | "joined" (waited for another job's staging)

Layout on disk: `layout`; one module per source scheme: `sources/`; the exactly-once owner: `service`;
one artifact's staging on a node: `task`; progress and metrics: `display`;
the `stage` job: `stager.Staging`; local stand-ins: `standins`.
"""

from a4ray.staging.stager import StageResult, Staging, stage
from a4ray.staging.task import ArtifactOutcome

__all__ = ["ArtifactOutcome", "StageResult", "Staging", "stage"]
