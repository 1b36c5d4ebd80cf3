"""The input side of a conversion: a Hugging Face checkpoint directory (config.json + safetensors shards).

`HFCheckpoint.open` checks what can be checked before any work starts (config, shard files complete,
every tensor's presence and shape against the config) and says everything that is wrong at once.
`TensorReader` then reads tensors, or runs of their rows, with pread() straight into memory the caller
gives (no memory map to fault in page by page, never the whole model), or says where they lie, for the
writer to copy them file to file.
(The safetensors format is a little-endian u64 header length, a JSON header with each tensor's dtype,
shape and byte range, then the data: https://github.com/huggingface/safetensors#format.)
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from a4ray.core.errors import ConvertInputError
from a4ray.mcore.architecture import Architecture

if TYPE_CHECKING:  # imported where a checkpoint is opened: a plan that reads none (a dry run's) needs no torch
    import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
STAGING_MANIFEST = "manifest.json"  # written by a4ray's staging step next to the files it staged
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # torch's names
_MAX_LISTED = 8


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset of the data in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file; refuses a truncated or foreign file, naming it."""
    import torch

    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length <= size - 8:
            raise ConvertInputError(f"input {path}: not a safetensors file (header length {length}, file {size} bytes)")
        header = json.loads(f.read(length))
    base, tensors = 8 + length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise ConvertInputError(f"input {path}: tensor {name} has dtype {entry['dtype']}, "
                                    f"not one of {', '.join(_SAFETENSORS_DTYPES)}")
        dtype = getattr(torch, _SAFETENSORS_DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        if base + end > size:
            raise ConvertInputError(f"input {path}: truncated ({size} bytes; tensor {name} ends at byte {base + end})",
                                    hint="the download or staging did not finish; stage the input again")
        tensors[name] = TensorInfo(path.name, dtype, tuple(entry["shape"]), base + begin, end - begin)
    return tensors


class HFCheckpoint:
    def __init__(self, path: Path, config: dict, tensors: dict[str, TensorInfo]):
        self.path = path
        self.config = config
        self.tensors = tensors

    @classmethod
    def open(cls, path: str | Path) -> HFCheckpoint:
        path = Path(path)
        if not path.is_dir():
            raise ConvertInputError(f"input {path}: not a directory",
                                    hint="convert.input must be an HF checkpoint directory "
                                    "(config.json + *.safetensors)")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConvertInputError(f"input {path}: config.json is missing", hint="stage the complete HF checkpoint")
        config = json.loads(config_file.read_text())
        if (path / INDEX).is_file():
            weight_map = json.loads((path / INDEX).read_text()).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        elif (path / SINGLE).is_file():
            files = [SINGLE]
        else:
            legacy = sorted(p.name for p in path.glob("*.bin"))
            raise ConvertInputError(
                f"input {path}: no {INDEX} or {SINGLE}" + (f" (found {', '.join(legacy[:3])})" if legacy else ""),
                hint="the native backend reads safetensors; stage the safetensors files of the model")
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise ConvertInputError(
                f"input {path}: {len(missing)} of {len(files)} shard(s) named in {INDEX} are missing: "
                + ", ".join(missing[:_MAX_LISTED]) + (" ..." if len(missing) > _MAX_LISTED else ""),
                hint="the download or staging did not finish; stage the input again")
        tensors: dict[str, TensorInfo] = {}
        for name in files:
            tensors.update(read_header(path / name))
        return cls(path, config, tensors)

    def architecture(self) -> Architecture:
        return Architecture.from_config(self.config, f"input {self.path}")

    def check(self, wanted: dict[str, tuple[int, ...]]) -> None:
        """Every tensor the conversion reads (`mapping.hf_tensors`) exists, with the shape the config implies."""
        problems = []
        for name, shape in wanted.items():
            info = self.tensors.get(name)
            if info is None:
                problems.append(f"{name}: missing")
            elif info.shape != shape:
                problems.append(f"{name} in {info.file}: shape {list(info.shape)}, config.json implies {list(shape)}")
        if problems:
            shown = "\n".join(f"  - {p}" for p in problems[:_MAX_LISTED])
            more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
            raise ConvertInputError(
                f"input {self.path}: {len(problems)} tensor(s) do not match config.json:\n{shown}{more}",
                hint="the shards and config.json come from different models, or the download is incomplete")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights are stored in (that of the embedding)."""
        info = self.tensors.get("model.embed_tokens.weight")
        return info.dtype if info else next(iter(self.tensors.values())).dtype

    @property
    def nbytes(self) -> int:
        return sum((self.path / f).stat().st_size for f in {t.file for t in self.tensors.values()})

    def reader(self) -> TensorReader:
        return TensorReader(self)

    def side_files(self) -> list[Path]:
        """Tokenizer and config files a Megatron checkpoint dir carries along (Pai loads the tokenizer
        from --load): top-level files that are not weights, indexes or manifests."""
        skip_suffixes = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")
        return sorted(p for p in self.path.iterdir()
                      if p.is_file() and not p.name.startswith(".") and not p.name.endswith(skip_suffixes)
                      and not p.name.endswith(".index.json") and p.name != STAGING_MANIFEST
                      and p.stat().st_size < 64 * 2**20)


class TensorReader:
    """Reads tensors, or runs of their rows, from the shards (pread), or says where they are in them."""

    def __init__(self, checkpoint: HFCheckpoint):
        self.checkpoint = checkpoint
        self._fds: dict[str, int] = {}

    def info(self, name: str) -> TensorInfo:
        return self.checkpoint.tensors[name]

    def locate(self, name: str, first: int, rows: int) -> tuple[int, int, int]:
        """(open file descriptor, byte offset, byte length) of rows first .. first+rows-1 of `name`."""
        info = self.checkpoint.tensors[name]
        fd = self._fds.get(info.file)
        if fd is None:
            fd = self._fds[info.file] = os.open(self.checkpoint.path / info.file, os.O_RDONLY)
        return fd, info.start + first * info.row_bytes, rows * info.row_bytes

    def read_rows(self, name: str, first: int, into: memoryview) -> None:
        """Fill `into` with the rows of `name` from row `first` on (as many as `into` holds)."""
        fd, offset, _ = self.locate(name, first, 0)
        done = 0
        while done < len(into):  # a network filesystem may return short reads
            n = os.preadv(fd, [into[done:]], offset + done)
            if n <= 0:
                shard = self.checkpoint.path / self.checkpoint.tensors[name].file
                raise ConvertInputError(f"input {shard}: ended while reading {name}")
            done += n

    def get(self, name: str) -> torch.Tensor:
        import torch

        info = self.checkpoint.tensors[name]
        out = torch.empty(info.nbytes, dtype=torch.uint8)
        self.read_rows(name, 0, memoryview(out.numpy()))
        return out.view(info.dtype).view(info.shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def fingerprint(path: str | Path) -> dict:
    """What identifies the input for the cache: staging's manifest if there is one, else every file's
    relative path, size and modification time."""
    path = Path(path)
    manifest = path / STAGING_MANIFEST
    if manifest.is_file():
        data = manifest.read_bytes()
        return {"kind": "staging-manifest", "digest": hashlib.sha256(data).hexdigest()}
    entries = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if name.startswith("."):
                continue
            st = (Path(root) / name).stat()
            entries.append(f"{(Path(root) / name).relative_to(path)}\t{st.st_size}\t{st.st_mtime_ns}")
    return {"kind": "files", "files": len(entries), "digest": hashlib.sha256("\n".join(entries).encode()).hexdigest()}
