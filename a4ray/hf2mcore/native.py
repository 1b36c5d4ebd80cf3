"""The native backend: HF safetensors -> Megatron-core checkpoint as Ray tasks over layer ranges.

The driver plans everything from the mapping and the shard headers alone: the parts (contiguous runs
of embedding / layers / output head, balanced by bytes), every part's DCP write plan, and the global
DCP metadata. A placement group takes `tasks_per_node` CPUs (and the memory those tasks need) on each
of the job's nodes; each part is a Ray task on one of them that streams its tensors from the shards,
converts them one at a time and writes its own `__<k>_0.distcp`. Only when every part succeeded does
the driver write `.metadata`, `common.pt` and the tracker; a failed part cancels the others, and the
caller drops the temporary directory, so a failure never leaves something that looks like a checkpoint.
"""

from __future__ import annotations

import math
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from a4ray.core.console import say
from a4ray.core.errors import ConvertFailed, InsufficientResources
from a4ray.hf2mcore import writer
from a4ray.hf2mcore.cache import PartRecord
from a4ray.hf2mcore.hf import HFCheckpoint
from a4ray.hf2mcore.mapping import (
    ExtraState,
    Slot,
    Unit,
    extra_states,
    groups,
    legacy_extra_keys,
    segments,
    slots,
    units,
)
from a4ray.mcore.architecture import Architecture, Naming
from a4ray.mcore.checkpointing import model_args
from a4ray.observe import metrics, stream
from a4ray.runtime.deaths import why_died
from a4ray.spec.conversion import ConvertJob

_TASK_OVERHEAD = 512 * 2**20  # interpreter and torch: what a task holds besides tensors
UNIT_BYTES = 512 * 2**20  # experts of a layer are written together up to this much (one record each)


@dataclass
class Part:
    index: int
    label: str
    units: list[Unit]  # what it writes, in order
    extras: list[ExtraState]
    nbytes: int  # bytes of tensor data it writes
    peak: int  # memory it may hold at once


@dataclass
class NativePlan:
    arch: Architecture
    naming: Naming
    format: str
    dtype: torch.dtype
    parts: list[Part]
    nodes: int
    tasks_per_node: int
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(p.nbytes for p in self.parts)

    @property
    def task_memory(self) -> int:
        return max(p.peak for p in self.parts)

    def describe(self) -> list[str]:
        model = self.arch.describe()
        lines = [model, f"writes {self.format} ({self.naming} naming, {str(self.dtype).removeprefix('torch.')}), "
                 f"{size(self.nbytes)} in {len(self.parts)} part(s) on {self.nodes} node(s) x "
                 f"{self.tasks_per_node} task(s), up to {size(self.task_memory)} memory per task"]
        lines += [f"  part {p.index}: {p.label} ({size(p.nbytes)})" for p in self.parts]
        return lines


def size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _label(names: list[str]) -> str:
    layers = [int(n.split()[1]) for n in names if n.startswith("layer ")]
    out = [n for n in names if n == "embedding"]
    if layers:
        out.append(f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}")
    return ", ".join(out + [n for n in names if n == "head"])


def plan(hf: HFCheckpoint, arch: Architecture, job: ConvertJob, dtype: torch.dtype) -> NativePlan:
    """Split the model into contiguous parts of about equal bytes, one task each: as many as the nodes' task
    slots, fewer where parts would fall below `convert.min_part_mb` (never fewer than the nodes)."""
    c = job.convert
    nodes = job.cluster.nodes
    runs = [(name, run, sum(s.numel for s in run) * dtype.itemsize) for name, run in groups(slots(arch))]
    extras = {name: run for name, run in groups(extra_states(arch, c.naming))}
    total = sum(r[2] for r in runs)
    # One part per task slot, but none below min_part_mb while fewer parts still give every node one.
    worth = max(nodes, math.ceil(total / (c.min_part_mb * 1e6))) if c.min_part_mb else nodes * c.tasks_per_node
    count = 1 if c.format == "legacy" else min(len(runs), nodes * c.tasks_per_node, worth)
    # Each group goes to the part its middle byte falls in: contiguous, balanced, every part non-empty
    # unless one group outweighs a whole part's share (then fewer, larger parts).
    buckets: list[list] = [[] for _ in range(count)]
    done = 0
    for run in runs:
        buckets[min(count - 1, int((done + run[2] / 2) * count / max(total, 1)))].append(run)
        done += run[2]
    parts = []
    for bucket in (b for b in buckets if b):
        part_units = [u for r in bucket for u in units(r[1], dtype.itemsize, UNIT_BYTES)]
        nbytes = sum(r[2] for r in bucket)
        # A task holds one unit's tensor and (to change dtype) one source tensor at a time; the legacy
        # format holds the whole model.
        biggest = max(u.numel for u in part_units) * dtype.itemsize + max(
            math.prod(shape) * hf.tensors[name].dtype.itemsize for u in part_units for s in u.slots
            for name, shape in s.sources)
        peak = _TASK_OVERHEAD + biggest + (nbytes if c.format == "legacy" else 0)
        parts.append(Part(len(parts), _label([r[0] for r in bucket]), part_units,
                          [e for r in bucket for e in extras.get(r[0], [])], nbytes, peak))
    return NativePlan(arch, c.naming, c.format, dtype, parts, nodes, c.tasks_per_node)


# --------------------------------------------------------------------------------- resources


def check_disk(output_root: Path, need: int) -> None:
    output_root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(output_root).free
    if need * 1.05 + 2**20 > free:
        raise InsufficientResources(
            f"output {output_root}: the conversion writes about {size(need)}, the filesystem has {size(free)} free",
            hint="free space there, or point convert.output at a larger filesystem")


def check_memory(job: ConvertJob, per_node: int, what: str) -> None:
    """Refuse up front, naming the numbers, instead of leaving a placement group pending forever."""
    c = job.cluster
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get(c.node_resource, 0) >= 1]
    fitting = [n for n in nodes if n["Resources"].get("memory", 0) >= per_node]
    if len(fitting) < c.nodes:
        have = ", ".join(f"{n['NodeManagerAddress']}: {size(int(n['Resources'].get('memory', 0)))}" for n in nodes[:8])
        raise InsufficientResources(
            f"{what} needs {size(per_node)} of Ray memory on each of {c.nodes} '{c.node_resource}' node(s); "
            f"{len(fitting)} of {len(nodes)} have that ({have or 'none alive'})",
            hint="lower convert.tasks_per_node, add nodes, or use nodes with more memory")


# -------------------------------------------------------------------------------------- tasks


@dataclass
class PartResult:
    index: int
    results: list  # DCP WriteResults (empty for the legacy format)
    nbytes: int
    seconds: float
    node: str


class _Throttle:
    """Caps a task's write rate (convert.max_mb_s_per_task)."""

    def __init__(self, mb_s: float | None):
        self.rate = mb_s * 1e6 if mb_s else None
        self.start = time.monotonic()
        self.bytes = 0

    def __call__(self, nbytes: int) -> None:
        if self.rate is None:
            return
        self.bytes += nbytes
        ahead = self.bytes / self.rate - (time.monotonic() - self.start)
        if ahead > 0:
            time.sleep(ahead)


class SlotBuilder:
    """Assembles mcore tensors from their HF rows (`mapping.segments`). Where the dtype stays, a tensor is
    a `Splice`: where its rows lie in the shards, for the writer to copy file to file in the kernel, so
    the bytes never pass through this process. To change the dtype (or shift the values, `Slot.shift`), the
    rows are read (pread, no memory map to fault in) into a reused staging buffer and converted into a
    reused output buffer: a task holds one tensor at a time either way."""

    def __init__(self, reader, arch: Architecture, dtype: torch.dtype):
        self.reader, self.arch, self.dtype = reader, arch, dtype
        self._out = bytearray()
        self._stage = bytearray()

    def splice(self, slots: tuple[Slot, ...], shape: tuple[int, ...]) -> writer.Splice | None:
        """The slots' tensors one after another, as runs of the shards; None if a dtype or a value changes."""
        runs = []
        for slot in slots:
            if slot.shift:
                return None
            for i, first, rows in segments(slot, self.arch):
                name = slot.sources[i][0]
                if self.reader.info(name).dtype != self.dtype:
                    return None
                runs.append(self.reader.locate(name, first, rows))
        return writer.Splice(shape, self.dtype, runs)

    def build(self, slots: tuple[Slot, ...], own_memory: bool = False) -> torch.Tensor:
        """The slots' tensors one after another, as one flat tensor of the target dtype in memory."""
        nbytes = sum(s.numel for s in slots) * self.dtype.itemsize
        if own_memory or not nbytes:
            out = torch.empty(nbytes, dtype=torch.uint8)
        else:
            if len(self._out) < nbytes:
                self._out = bytearray(nbytes)
            # Exactly nbytes of storage: torch.save writes a tensor's whole storage.
            out = torch.frombuffer(self._out, dtype=torch.uint8, count=nbytes)
        at = 0
        for slot in slots:
            for i, first, rows in segments(slot, self.arch):
                name = slot.sources[i][0]
                info = self.reader.info(name)
                n = rows * info.row_bytes
                if info.dtype == self.dtype and not slot.shift:
                    self.reader.read_rows(name, first, memoryview(out[at:at + n].numpy()))
                    at += n
                    continue
                if len(self._stage) < n:
                    self._stage = bytearray(n)
                stage = torch.frombuffer(self._stage, dtype=torch.uint8, count=n)
                self.reader.read_rows(name, first, memoryview(stage.numpy()))
                m = n // info.dtype.itemsize * self.dtype.itemsize
                source = stage.view(info.dtype)
                # As `mapping.to_mcore`: a shift in fp32, then one rounding to the target dtype.
                out[at:at + m].view(self.dtype).copy_(source.float() + slot.shift if slot.shift else source)
                at += m
        return out.view(self.dtype)


def write_part(hf: HFCheckpoint, release_dir: str, part: Part, dcp_plan, arch: Architecture, naming: Naming,
               dtype: torch.dtype, max_mb_s: float | None) -> PartResult:
    """One conversion task: stream this part's tensors from the shards into its own DCP file."""
    t0 = time.monotonic()
    reader, throttle = hf.reader(), _Throttle(max_mb_s)
    builder = SlotBuilder(reader, arch, dtype)
    by_index = {writer.tensor_item(u, arch, naming, dtype).index: u for u in part.units}

    def produce(item):
        if item.type == writer.WriteItemType.BYTE_IO:
            return writer.extra_state_bytes()
        unit = by_index[item.index]
        shape = unit.chunk(arch)[1]
        throttle(unit.numel * dtype.itemsize)
        return builder.splice(unit.slots, shape) or builder.build(unit.slots).view(shape)

    try:
        results = writer.write_part(Path(release_dir), dcp_plan, produce)
    finally:
        reader.close()
    return PartResult(part.index, results, part.nbytes, time.monotonic() - t0, socket.gethostname())


def write_legacy(hf: HFCheckpoint, release_dir: str, part: Part, arch: Architecture, naming: Naming,
                 dtype: torch.dtype, args) -> PartResult:
    """The legacy format is one torch.save of the whole state dict: one task, the whole model in memory."""
    t0 = time.monotonic()
    reader = hf.reader()
    builder = SlotBuilder(reader, arch, dtype)
    try:
        state: dict = {s.state_key(naming): builder.build((s,), own_memory=True).view(s.shape)
                       for u in part.units for s in u.slots}
    finally:
        reader.close()
    state.update({key: None for key in legacy_extra_keys(arch, naming)})
    writer.write_legacy(Path(release_dir), state, args)
    return PartResult(part.index, [], part.nbytes, time.monotonic() - t0, socket.gethostname())


# -------------------------------------------------------------------------------------- driver


class Placement:
    """The conversion's share of the job's nodes: one bundle of CPUs and memory on each, for its tasks."""

    def __init__(self, job: ConvertJob, task_memory: int):
        """Asks for the placement; `wait()` waits for it (the driver plans meanwhile)."""
        self.cluster = c = job.cluster
        self.nodes = c.nodes
        self.tasks_per_node = job.convert.tasks_per_node
        self.bundle = {"CPU": self.tasks_per_node, c.node_resource: 1, "memory": self.tasks_per_node * task_memory}
        self.pg = placement_group([dict(self.bundle)] * c.nodes, strategy="STRICT_SPREAD",
                                  name=f"a4ray-{job.name}-convert")
        self.bundle_nodes: dict[int, str] = {}

    def wait(self) -> None:
        c = self.cluster
        ready, _ = ray.wait([self.pg.ready()], timeout=c.start_timeout_s)
        if not ready:
            raise InsufficientResources(
                f"the conversion's placement ({c.nodes} '{c.node_resource}' node(s) with {self.tasks_per_node} "
                f"CPUs and {size(self.bundle['memory'])} memory free on each) was not placed within "
                f"cluster.start_timeout_s={c.start_timeout_s:g}s",
                hint="other jobs may hold the nodes; lower convert.tasks_per_node or cluster.nodes")
        host_label = c.topology.host_label
        names = {n["NodeID"]: " ".join(filter(None, (n["NodeManagerHostname"], n["NodeManagerAddress"],
                                                      n.get("Labels", {}).get(host_label))))
                 for n in ray.nodes()}
        table = placement_group_table(self.pg)["bundles_to_node_id"]
        self.bundle_nodes = {i: names.get(node_id, node_id) for i, node_id in table.items()}

    def options(self, index: int, **kw) -> dict:
        bundle = index % self.nodes
        return dict(scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
                    max_retries=0, **kw)

    def close(self) -> None:
        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 - already gone with the cluster
            pass


def convert(hf: HFCheckpoint, native: NativePlan, job: ConvertJob, root: Path, placement: Placement,
            logs: Path) -> list[PartRecord]:
    """Write the checkpoint into `root` (a temporary directory); returns what each part did. What the parts'
    tasks print goes to `logs` (the run's), and to the stream by its rules."""
    release_dir = root / writer.RELEASE
    release_dir.mkdir(parents=True)
    arch, naming, dtype = native.arch, native.naming, native.dtype
    args = model_args(arch, dtype, naming, native.format)
    max_mb_s = job.convert.max_mb_s_per_task
    hf_ref = ray.put(hf)  # the shard index, shipped to the tasks once
    refs, task_logs = {}, [stream.TaskLog.open(logs, f"part {p.index}") for p in native.parts]
    remote = ray.remote(stream.captured)
    if native.format == "legacy":
        placement.wait()
        part = native.parts[0]
        task = remote.options(**placement.options(0, num_cpus=1, memory=part.peak,
                                                  name=f"a4ray-convert-{job.name}-legacy"))
        refs[task.remote(str(task_logs[0].path), f"{__name__}:write_legacy", hf_ref, str(release_dir), part, arch,
                         naming, dtype, args)] = part
    else:
        items = [[writer.tensor_item(u, arch, naming, dtype) for u in p.units]
                 + [writer.object_item(e) for e in p.extras] for p in native.parts]
        dcp_plans, metadata = writer.global_plan(items)
        placement.wait()
        for part, dcp_plan in zip(native.parts, dcp_plans):
            task = remote.options(**placement.options(part.index, num_cpus=1, memory=part.peak,
                                                      name=f"a4ray-convert-{job.name}-part-{part.index}"))
            refs[task.remote(str(task_logs[part.index].path), f"{__name__}:write_part", hf_ref, str(release_dir),
                             part, dcp_plan, arch, naming, dtype, max_mb_s)] = part
    try:
        done = _gather(refs, placement, job.name)
    finally:
        stream.relay(task_logs)
    if native.format != "legacy":
        writer.finish(release_dir, metadata, [r.results for r in done], args)
    for side in hf.side_files():
        shutil.copy2(side, root / side.name)
    writer.write_tracker(root)
    return [PartRecord(index=r.index, groups=native.parts[r.index].label, bytes=r.nbytes, node=r.node,
                       seconds=round(r.seconds, 3)) for r in done]


def _gather(refs: dict, placement: Placement, job: str) -> list[PartResult]:
    """Wait for every part. On the first failure (or Ctrl-C) stop the others, and wait until they have
    stopped, so that the caller can remove the temporary directory with nothing still writing into it."""
    pending, done, n = dict(refs), [], len(refs)
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            part = pending.pop(ready[0])
            try:
                result: PartResult = ray.get(ready[0])
            except Exception as error:  # noqa: BLE001 - any task failure fails the conversion
                where = placement.bundle_nodes.get(part.index % placement.nodes, "?")
                raise ConvertFailed(
                    f"conversion part {part.index} ({part.label}) failed on {where}: {why_failed(error)}; "
                    f"{len(pending)} other part(s) cancelled, nothing committed",
                    hint="fix the cause and run again: the conversion starts over in a new temporary directory",
                ) from None
            result.node = placement.bundle_nodes.get(part.index % placement.nodes, result.node)
            done.append(result)
            metrics.record_conversion_part(job, result.node, result.nbytes, result.seconds)
            say(f"part {result.index + 1}/{n} ({part.label}, {size(result.nbytes)}) written on {result.node} in "
                f"{result.seconds:.1f}s ({result.nbytes / 1e6 / max(result.seconds, 1e-9):.0f} MB/s)")
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        ray.wait(list(pending), num_returns=len(pending), timeout=60)
        raise
    return sorted(done, key=lambda r: r.index)


def why_failed(error: Exception) -> str:
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.cause if getattr(error, "cause", None) is not None else error
        text = " ".join(str(cause).split())
        return f"{type(cause).__name__}: {text[:400]}{' ...' if len(text) > 400 else ''}"
    if isinstance(error, (ray.exceptions.WorkerCrashedError, ray.exceptions.OutOfMemoryError)):
        return f"its worker process died ({why_died(error)})"
    if isinstance(error, ray.exceptions.TaskCancelledError):
        return "it was cancelled"
    return f"{type(error).__name__}: {error}"
