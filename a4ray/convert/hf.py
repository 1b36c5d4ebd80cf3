"""The input side of a conversion: a Hugging Face checkpoint directory (config.json + safetensors shards).

`HFCheckpoint.open` checks what can be checked before any work starts (config, shard files, every
tensor's presence and shape against the config) and says everything that is wrong at once. Tensors are
then read one at a time (`TensorReader`), straight from the shard files, never the whole model.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from a4ray.convert.mapping import Architecture, Slot
from a4ray.errors import ConvertInputError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
STAGING_MANIFEST = "manifest.json"  # written by a4ray's staging step next to the files it staged
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_MAX_LISTED = 8


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class HFCheckpoint:
    def __init__(self, path: Path, config: dict, tensors: dict[str, TensorInfo]):
        self.path = path
        self.config = config
        self.tensors = tensors

    @classmethod
    def open(cls, path: str | Path) -> HFCheckpoint:
        from safetensors import safe_open

        path = Path(path)
        if not path.is_dir():
            raise ConvertInputError(f"input {path}: not a directory",
                                    hint="convert.input must be an HF checkpoint directory (config.json + *.safetensors)")
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
            with safe_open(path / name, framework="pt") as f:
                for key in f.keys():
                    s = f.get_slice(key)
                    dtype = _SAFETENSORS_DTYPES.get(s.get_dtype())
                    if dtype is None:
                        raise ConvertInputError(f"input {path}/{name}: tensor {key} has dtype {s.get_dtype()}, "
                                                f"not one of {', '.join(_SAFETENSORS_DTYPES)}")
                    tensors[key] = TensorInfo(name, dtype, tuple(s.get_shape()))
        return cls(path, config, tensors)

    def architecture(self) -> Architecture:
        return Architecture.from_config(self.config, f"input {self.path}")

    def check(self, slots: list[Slot]) -> None:
        """Every tensor the conversion reads exists, with the shape the config implies."""
        problems = []
        for slot in slots:
            for name, shape in slot.sources:
                info = self.tensors.get(name)
                if info is None:
                    problems.append(f"{name}: missing")
                elif info.shape != shape:
                    problems.append(f"{name} in {info.file}: shape {list(info.shape)}, config.json implies "
                                    f"{list(shape)}")
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
    """Reads single tensors from the shards, keeping each shard open (memory-mapped) once opened."""

    def __init__(self, checkpoint: HFCheckpoint):
        self.checkpoint = checkpoint
        self._open: dict[str, object] = {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        info = self.checkpoint.tensors[name]
        handle = self._open.get(info.file)
        if handle is None:
            handle = self._open[info.file] = safe_open(self.checkpoint.path / info.file, framework="pt")
        return handle.get_tensor(name)


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
