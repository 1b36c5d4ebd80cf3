"""file:// (and plain paths) and gs:// sources, through fsspec (gcsfs for gs://).

A file is copied to `<name>.a4ray-part` and renamed when complete, so a rerun skips finished files and
redoes only the one that was cut. Local copies use `copy_file_range` (in-kernel, like `cp`); GCS objects
are checked against the md5 the bucket stores.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from pathlib import Path

import fsspec

from a4ray.staging.sources.source import FetchContext, Listing, RemoteFile, Source, parallel, select

PART = ".a4ray-part"


class FsSource(Source):
    scheme = "file"

    def __init__(self, artifact, options):
        super().__init__(artifact, options)
        uri = self.ref.location
        if self.ref.scheme == "file":
            uri = os.path.abspath(uri)
        self.fs, self.root = fsspec.core.url_to_fs(uri)
        self.local = self.ref.scheme == "file"
        self.single = False  # the source is one file, not a directory (set by list())

    def describe(self) -> str:
        how = "copy_file_range per file" if self.local else "gcsfs (fsspec) per object, md5-checked"
        return f"{self.ref.location}: {how}, files in parallel"

    def list(self, token: str | None) -> Listing:
        try:
            info = self.fs.info(self.root)
        except FileNotFoundError:
            hint = ("create it first (the local stand-ins: `a4ray standins`)" if self.local
                    else "check the bucket and prefix, and that the nodes' credentials can read them")
            raise self.error(f"source {self.artifact.source} does not exist", hint=hint) from None
        except PermissionError as e:
            raise self.error(f"cannot read {self.artifact.source}: {e}",
                             hint="grant the nodes' service account read access") from None
        if info["type"] != "directory":
            name = self.root.rstrip("/").rsplit("/", 1)[-1]
            entries = {name: info}
            self.single = True
        else:
            base = self.root.rstrip("/") + "/"
            entries = {path[len(base):]: d for path, d in self.fs.find(self.root, detail=True).items()
                       if d.get("type") == "file" and path.startswith(base)}
            self.single = False
        names = select(entries, self.artifact)
        # A local directory can change under its path (regenerated stand-ins): its version is what each
        # file's stat says, recorded in the manifest and checked on every cache hit.
        version = _stat_digest({n: entries[n] for n in names}) if self.local else None
        return Listing([RemoteFile(n, int(entries[n]["size"]), _digests(entries[n])) for n in names], resolved=version)

    def version(self) -> str | None:
        return self.list(None).resolved if self.local else None

    def _remote(self, name: str) -> str:
        return self.root if self.single else f"{self.root.rstrip('/')}/{name}"

    def fetch(self, listing: Listing, ctx: FetchContext) -> None:
        def one(remote: RemoteFile) -> None:
            final = ctx.partial / remote.path
            if final.is_file() and final.stat().st_size == remote.size:
                return  # finished by an earlier attempt (verified below with everything else)
            final.parent.mkdir(parents=True, exist_ok=True)
            part = final.with_name(final.name + PART)
            if self.local:
                _copy_local(self._remote(remote.path), part)
            else:
                self.fs.get_file(self._remote(remote.path), str(part))
            os.rename(part, final)

        parallel(one, listing.files, ctx.max_workers)

    def junk(self, partial: Path) -> list[Path]:
        return list(partial.rglob(f"*{PART}"))


def _stat_digest(entries: dict[str, dict]) -> str:
    stats = sorted((name, int(info["size"]), float(info.get("mtime", 0))) for name, info in entries.items())
    return "stat:" + hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]


def _digests(info: dict) -> dict[str, str]:
    md5 = info.get("md5Hash")  # GCS: base64 md5 of the object (absent for composite objects)
    return {"md5": base64.b64decode(md5).hex()} if md5 else {}


def _copy_local(src: str, dst: Path) -> None:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        copied = 0
        try:
            while copied < size:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), min(size - copied, 1 << 30))
                if n == 0:
                    break
                copied += n
        except OSError:
            copied = -1  # e.g. EXDEV on old kernels: fall back below
        if copied != size:
            fin.seek(0)
            fout.seek(0)
            fout.truncate()
            shutil.copyfileobj(fin, fout, 16 * 2**20)
