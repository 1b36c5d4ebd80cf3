"""HF -> Megatron-core checkpoint conversion as a pipeline step: parallel, memory-bounded, verified, cached.

    from a4ray.convert import convert
    from a4ray.spec import load_job

    result = convert(load_job("jobs/convert.yaml"))
    result.status        # "ran" | "cached" | "skipped"
    result.checkpoint    # the committed checkpoint directory: the trainer's --load
    result.verify        # logits and round-trip figures

Backends: `native` (Ray tasks over layer ranges, Qwen3 and Qwen3-MoE), `pai` (Pai-Megatron-Patch's
distributed converter on every node), `swift` (ms-swift's `swift export --to_mcore`).

A pipeline step that already holds a connection and a run directory runs
`ConvertWorkload(job).run_job(conn, run_dir)` (`a4ray.convert.converter`); `job.convert` is the
`convert:` section (`a4ray.spec.conversion.ConvertSpec`) a recipe embeds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from a4ray.convert.converter import ConvertResult
    from a4ray.spec.conversion import ConvertJob


def convert(spec: ConvertJob, *, address: str | None = None, local_nodes: int | None = None) -> ConvertResult:
    """Run the conversion `spec` describes (connecting as every a4ray job does) and return its result.

    Raises an `a4ray.core.errors.ConvertError` (unsupported model, bad input, too little disk or memory, a
    failed part, a failed verification) with nothing committed."""
    from a4ray.runner import run

    return run(spec, address=address, local_nodes=local_nodes)
