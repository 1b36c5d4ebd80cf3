"""Spec of the network test: nccl-tests (or a4ray's torch benchmark) across the gang, with verdicts."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Self

from pydantic import BeforeValidator, Field, model_validator

from a4ray.spec.toolbuilds import BuildSpec, nccl_tests_build
from a4ray.spec.fields import MAX_NODES, Integer, NonNegativeInt, Number, PathStr, PositiveFloat, PositiveInt, Spec
from a4ray.spec.job import job_kind
from a4ray.spec.mpi import FabricTestJob

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "alltoall"]
COLLECTIVES: tuple[str, ...] = Collective.__args__  # type: ignore[attr-defined]

# Where images ship nccl-tests' binaries, searched in this order when nccl.binaries_dir is not set:
# docker/a4ray.Dockerfile builds them into /opt/nccl-tests (the DeepEP image inherits it); Google's gIB
# installer image (the A4 recipes' nccl-tests) has them in /third_party/nccl-tests.
NCCL_TESTS_DIRS = ("/opt/nccl-tests/build", "/third_party/nccl-tests/build")

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(value: Any) -> int:
    """Bytes from an int or from nccl-tests' notation: `1G` = 2**30 (K, M, G, T are powers of 1024)."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 8G or 1048576")
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError("expected a size such as 8G, 512M or 1048576")
    return int(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " ")


def format_size(n: int) -> str:
    for unit, scale in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


# The largest size: a collective's buffer is in one GPU's memory, and no GPU has a terabyte of it.
MAX_SIZE = 2**40
Size = Annotated[int, Field(gt=0, le=MAX_SIZE), BeforeValidator(parse_size)]


def _count_key(key: Any) -> Any:
    # A mapping's keys are text in JSON (a spec with overrides applied goes through it) and in `--set
    # nccl.thresholds.all_reduce.4=250`: there the node count 4 is "4". A bool stays refused.
    return int(key) if isinstance(key, str) and key.isdigit() else key


NodeCount = Annotated[Integer, Field(gt=0, le=MAX_NODES), BeforeValidator(_count_key)]

# Expected bus bandwidth (GB/s) at the largest size, by collective and node count (the entry with the
# largest node count <= the gang's applies). For whole A4 nodes: 8 x B200, each with its own 400 Gb/s
# ConnectX-7 RoCE NIC, so a node has 400 GB/s to the fabric and the ring/tree bound of all_reduce,
# all_gather and reduce_scatter busbw across nodes is about 400 GB/s. The defaults are 75% of that
# bound: far above what a TCP fallback or a dead rail gives, below what a healthy fabric reaches. They
# are a starting point, not a measurement: set your fleet's figures here. alltoall has no default (its
# bound depends on the node count and on what share of traffic stays on NVLink).
A4_THRESHOLDS: dict[str, dict[int, float]] = {
    "all_reduce": {2: 300.0},
    "all_gather": {2: 300.0},
    "reduce_scatter": {2: 300.0},
}


class NcclTestSpec(Spec):
    """The collectives measured, their sizes, and the bus bandwidth and transport they must show."""

    collectives: list[Collective] = Field(
        default_factory=lambda: list(COLLECTIVES), description="which collectives to measure, in this order"
    )
    min_bytes: Size = Field(parse_size("1G"), description="-b: smallest size (nccl-tests notation: 1G = 2^30)")
    max_bytes: Size = Field(parse_size("8G"), description="-e: largest size; busbw here is the verdict's figure")
    factor: Integer = Field(2, ge=2, le=1024, description="-f: size multiplier between rows")
    iters: PositiveInt = Field(5, description="-n: timed iterations per size")
    warmup: NonNegativeInt = Field(5, description="-w: untimed iterations before each size")
    dtype: Literal["float", "half", "bfloat16"] = Field("float", description="-d: the data type")
    check: bool = Field(True, description="-c: check results (the #wrong column)")
    implementation: Literal["auto", "nccl-tests", "torch"] = Field(
        "auto", description="auto: nccl-tests where its binaries (the image's, else built: see build) and mpirun "
        "are on every node, else the built-in torch.distributed benchmark (torchrun)",
    )
    build: BuildSpec = Field(
        default_factory=nccl_tests_build, description="where no binaries_dir is set and the image lacks "
        "the binaries: build nccl-tests (v2.17.6, make MPI=1) on the nodes, once per toolchain")
    binaries_dir: PathStr = Field(
        "", description="where the *_perf binaries are; default: the first of NCCL_TESTS_DIRS (a4ray's images, "
        "then Google's gIB installer image) that has them on every node")
    cpu_min_bytes: Size = Field(parse_size("1M"), description="smallest size on CPU (gloo): a rehearsal")
    cpu_max_bytes: Size = Field(parse_size("16M"), description="largest size on CPU (gloo): a rehearsal")
    expect_transport: Literal["auto", "gib", "ib", "rdma", "socket", "any"] = Field(
        "auto", description="what NCCL must use between nodes; auto: gib if network.gib=on, else rdma "
        "(gIB or IB); any on simulated or single-node gangs",
    )
    thresholds: dict[Collective, dict[NodeCount, PositiveFloat]] = Field(
        default_factory=lambda: {k: dict(v) for k, v in A4_THRESHOLDS.items()},
        description="minimum busbw (GB/s) at the largest size, by collective then node count (the largest "
        "count <= the gang's applies); defaults: 75% of whole A4 nodes' bound; {} for none",
    )
    isolate: bool = Field(False, description="when the all-node result fails or is below threshold, test "
                          "node pairs to name the slow or broken nodes")
    isolate_ratio: Number = Field(0.8, gt=0, le=1, description="a pair below this share of the best pair's busbw "
                                 "is slow (used where no threshold applies)")

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if not self.collectives:
            raise ValueError("collectives: name at least one")
        if len(set(self.collectives)) != len(self.collectives):
            raise ValueError("collectives: each at most once")
        for low, high in (("min_bytes", "max_bytes"), ("cpu_min_bytes", "cpu_max_bytes")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(f"{low} ({format_size(getattr(self, low))}) is above {high} "
                                 f"({format_size(getattr(self, high))})")
        return self

    def threshold(self, collective: str, nodes: int) -> float | None:
        table = self.thresholds.get(collective, {})  # type: ignore[call-overload]
        counts = [n for n in table if n <= nodes]
        return table[max(counts)] if counts else None


@job_kind
class NcclTestJob(FabricTestJob):
    """Is the network right? nccl-tests (or a torch benchmark) across the gang, with a verdict."""

    kind: Literal["nccl_test"] = "nccl_test"
    nccl: NcclTestSpec = NcclTestSpec()
