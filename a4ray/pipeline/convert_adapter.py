"""The pipeline's one door to checkpoint conversion, `a4ray.convert` (written on the `convert` branch).

Until that package is merged, the import fails and a convert step that has to run says so (nothing else
changes); after the merge, `convert()` and `plan()` below are plain calls into it.
"""

from __future__ import annotations

from a4ray.errors import StepError
from a4ray.spec.convert import ConvertJob


def available() -> bool:
    try:
        import a4ray.convert  # noqa: F401
    except ImportError:
        return False
    return True


def convert(job: ConvertJob):
    """`a4ray.convert.convert(job)`: a ConvertResult with status ran | cached | skipped and `.checkpoint`."""
    if not available():
        raise StepError("convert", "this a4ray has no converter (a4ray.convert is not installed)",
                        hint="skip the step with --skip convert where the converted checkpoint exists")
    from a4ray.convert import convert as run_convert

    return run_convert(job)


def plan(job: ConvertJob) -> str | None:
    """The conversion's dry-run plan (per-node commands of the pai/swift backends), if a4ray.convert is here."""
    if not available():
        return None
    from a4ray.convert.workload import ConvertWorkload

    return ConvertWorkload(job).plan().render()
