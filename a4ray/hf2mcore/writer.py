"""A Megatron checkpoint on disk, written without a model and without a process group.

Layout (what Megatron-LM's `load_checkpoint` and mcore's `dist_checkpointing.load` read)::

    <root>/latest_checkpointed_iteration.txt   "release" (a converted model, like Pai's converter writes)
    <root>/release/metadata.json               torch_dist backend marker
    <root>/release/common.pt                   args, checkpoint_version, iteration, content_metadata
    <root>/release/.metadata                   torch.distributed.checkpoint (DCP) index: global shapes, chunks
    <root>/release/__<k>_0.distcp              tensor data written by conversion part k
    legacy format: <root>/release/mp_rank_00/model_optim_rng.pt (one file, TP=PP=EP=1)

DCP saves in four steps: each rank plans its writes, the coordinator merges the plans into a global plan
and the metadata, each rank writes its file, the coordinator writes `.metadata`. Here the ranks are Ray
tasks and the coordinator is the driver: `global_plan` does the first two steps from the mapping alone
(no tensors; DCP checks that the chunks tile every tensor), `write_part` the third inside a task, pulling
each tensor from a producer only when it is written, and `finish` the fourth (DCP's own code for both
ends; `write_part` writes the same file layout as DCP's FileSystemWriter, see there why). Until `finish`, the
directory has no `.metadata` and no tracker, so no reader takes a half-written checkpoint for a checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from a4ray.hf2mcore.mapping import ExtraState, Unit
from a4ray.mcore.architecture import Architecture, Naming
from a4ray.mcore.names import CHECKPOINT_VERSION, RELEASE, TRACKER

TORCH_DIST_MARKER = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}
# What Megatron-LM 0.13+ records about how the sharded state dict was built; mcore's defaults.
CONTENT_METADATA = {"singleton_local_shards": False}
LEGACY_FILE = "mp_rank_00/model_optim_rng.pt"

Producer = Callable[[WriteItem], "torch.Tensor | Splice | io.BytesIO"]


def tensor_item(unit: Unit, arch: Architecture, naming: Naming, dtype: torch.dtype) -> WriteItem:
    offsets, sizes = unit.chunk(arch)
    return WriteItem(
        index=MetadataIndex(unit.sharded_key(naming), torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(unit.slots[0].global_shape(arch)),
        ),
    )


def object_item(extra: ExtraState) -> WriteItem:
    return WriteItem(index=MetadataIndex(extra.fqn), type=WriteItemType.BYTE_IO)


@functools.cache
def _extra_state_payload() -> bytes:
    # mcore stores a ShardedObject as torch.save([obj]); None is what a module without FP8 state has,
    # and what TE's set_extra_state accepts as "nothing to restore".
    buffer = io.BytesIO()
    torch.save([None], buffer)
    return buffer.getvalue()


def extra_state_bytes() -> io.BytesIO:
    return io.BytesIO(_extra_state_payload())


def global_plan(parts: list[list[WriteItem]]) -> tuple[list[SavePlan], Metadata]:
    """The coordinator's half of planning: merged metadata, and each part's plan with its file prefix."""
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    plans, metadata = planner.create_global_plan([SavePlan(items) for items in parts])
    return FileSystemWriter(".").prepare_global_plan(plans), metadata


@contextlib.contextmanager
def _without_crc32():
    """torch.save checksums every zip record with miniz's CRC32, which costs ~10x writing the bytes.
    Nothing reads it: PyTorch builds its zip reader with MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS, and
    `torch.serialization.set_crc32_options` documents that torch.load reads such files."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


@dataclass(frozen=True)
class Splice:
    """A tensor whose bytes are runs of other files: (fd, offset, length), in order. The writer copies them
    into place in the kernel (copy_file_range), never through this process's memory."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    runs: list[tuple[int, int, int]]


class _RecordingFile(io.FileIO):
    """Notes where torch.save under `skip_data` leaves a storage's bytes out (it seeks over them)."""

    def __init__(self, path: Path):
        super().__init__(path, "wb")
        self.holes: list[tuple[int, int]] = []

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR and pos > 0:
            self.holes.append((self.tell(), pos))
        return super().seek(pos, whence)


def _copy_range(src: int, dst: int, length: int, src_offset: int, dst_offset: int) -> None:
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src, dst, length - done, src_offset + done, dst_offset + done)
        except OSError as error:
            if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            break  # not between these filesystems: copy through memory below
        if n == 0:
            raise OSError(errno.EIO, f"source ended {length - done} bytes early (fd {src}, offset {src_offset})")
        done += n
    chunk = 64 * 2**20
    while done < length:
        data = os.pread(src, min(chunk, length - done), src_offset + done)
        if not data:
            raise OSError(errno.EIO, f"source ended {length - done} bytes early (fd {src}, offset {src_offset})")
        os.pwrite(dst, data, dst_offset + done)
        done += len(data)


def _save_splice(stream: _RecordingFile, splice: Splice) -> None:
    """torch.save's record for the tensor, with its bytes copied in from the runs.

    torch.save under `skip_data` writes a record's framing and leaves room for the storage's bytes; the
    runs are copied into that room. Should a torch version lay the room out otherwise, the record is
    written again the ordinary way."""
    start = stream.tell()
    stand_in = torch.empty(splice.shape, dtype=splice.dtype)  # never touched: framing only
    stream.holes.clear()
    with torch.serialization.skip_data():
        torch.save(stand_in, stream)
    nbytes = stand_in.numel() * stand_in.element_size()
    if [length for _, length in stream.holes] == [nbytes]:
        at = stream.holes[0][0]
        for fd, offset, length in splice.runs:
            _copy_range(fd, stream.fileno(), length, offset, at)
            at += length
        return
    stream.seek(start)
    stream.truncate()
    data = bytearray()
    for fd, offset, length in splice.runs:
        data += os.pread(fd, length, offset)
    torch.save(torch.frombuffer(data, dtype=splice.dtype).view(splice.shape), stream)


def write_part(release_dir: Path, plan: SavePlan, produce: Producer) -> list[WriteResult]:
    """Write one part's file, `__<k>_0.distcp`, item by item as DCP's FileSystemWriter lays it out (each
    tensor a torch.save record, each object its bytes), fsync it, and say where each item landed.

    Written here rather than by `FileSystemWriter.write_data`, which holds every tensor until the file is
    done and only writes tensors from memory: here a tensor is a `Splice` of the input's bytes, copied
    file to file by the kernel (or, to change its dtype, one tensor in a reused buffer)."""
    name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
    results = []
    with _RecordingFile(release_dir / name) as stream, _without_crc32():
        for item in plan.items:
            offset = stream.tell()
            data = produce(item)
            if item.type == WriteItemType.BYTE_IO:
                stream.write(data.getbuffer())
            elif isinstance(data, Splice):
                _save_splice(stream, data)
            else:
                torch.save(data, stream)
            length = stream.tell() - offset
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(name, offset, length)))
        os.fsync(stream.fileno())
    return results


def finish(release_dir: Path, metadata: Metadata, results: list[list[WriteResult]], args: argparse.Namespace) -> None:
    """The coordinator's last step: `.metadata` (atomically, fsynced), `common.pt`, `metadata.json`."""
    FileSystemWriter(release_dir, sync_files=True).finish(metadata, results)
    torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0,
                "content_metadata": CONTENT_METADATA}, release_dir / "common.pt")
    (release_dir / "metadata.json").write_text(json.dumps(TORCH_DIST_MARKER))


def write_legacy(release_dir: Path, model_state: dict, args: argparse.Namespace) -> Path:
    path = release_dir / LEGACY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0, "model": model_state}, path)
    return path


def write_tracker(root: Path) -> None:
    (root / TRACKER).write_text(RELEASE)


