"""A conversion's typed result (`result.json` of `kind: convert`), apart from the converter so that reading
one back, or any driver that does not convert, never imports torch."""

from __future__ import annotations

from typing import Literal

from a4ray.core.console import table
from a4ray.hf2mcore.cache import PartRecord, VerifyReport
from a4ray.workloads.workload import WorkloadResult


class ConvertResult(WorkloadResult):
    kind: str = "convert"
    status: Literal["ran", "cached", "skipped", "failed"]
    backend: str
    checkpoint: str = ""  # the committed checkpoint root: give it to the trainer as --load
    key: str = ""
    seconds: float = 0.0
    bytes: int = 0
    parts: list[PartRecord] = []
    verify: VerifyReport | None = None

    def table(self) -> str:
        if not self.parts:
            return ""
        rows = [[p.index, p.groups, p.node, f"{p.bytes / 1e6:.1f}", f"{p.seconds:.2f}",
                 f"{p.bytes / 1e6 / max(p.seconds, 1e-9):.0f}"] for p in self.parts]
        return table("conversion parts", ["part", "groups", "node", "MB", "s", "MB/s"], rows)
