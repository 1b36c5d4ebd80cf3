"""https:// sources: one file, or `files:` under a directory URL, fetched with resumable ranged GETs.

Each file streams into `<name>.a4ray-part`; a dropped connection (or a killed task, next run) resumes
with `Range: bytes=<have>-` and `If-Range: <etag>`, so a file that changed on the server restarts from
zero instead of being spliced. sha256 is computed as the bytes arrive, so verification re-reads nothing.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import requests

from a4ray.staging.sources.source import FetchContext, Listing, RemoteFile, Source, parallel

PART = ".a4ray-part"
_CHUNK = 2**20  # also what a dropped connection can cost: a chunk cut short is not written
_TIMEOUT = (30, 120)  # connect, read (seconds without a byte)
_ATTEMPTS = 6  # consecutive failures without progress before giving up


class HttpSource(Source):
    scheme = "https"

    def describe(self) -> str:
        return f"{len(self._urls())} file(s) by ranged GET (requests), resumable, sha256 on the fly"

    def _urls(self) -> dict[str, str]:
        src = self.artifact.source
        if self.artifact.files:
            return {name: urljoin(src, name) for name in self.artifact.files}
        return {os.path.basename(urlsplit(src).path) or "download": src}

    def _explain(self, url: str, status: int) -> Exception:
        hints = {401: "the server wants credentials; a4ray sends none to plain https sources",
                 403: "access denied: check the URL (signed URLs expire) and the bucket's policy",
                 404: "check the URL; the file may have moved"}
        return self.error(f"{url} answered HTTP {status}", hint=hints.get(status, "retry later; check the URL"))

    def list(self, token: str | None) -> Listing:
        self.etags: dict[str, str] = {}
        files = []
        for name, url in self._urls().items():
            try:
                r = requests.head(url, allow_redirects=True, timeout=_TIMEOUT)
            except requests.RequestException as e:
                raise self.error(f"cannot reach {url}: {type(e).__name__}",
                                 hint="check the URL and that the nodes can reach the host") from None
            if r.status_code == 405:  # no HEAD: ask for the first byte instead
                r = requests.get(url, headers={"Range": "bytes=0-0"}, stream=True, timeout=_TIMEOUT)
                r.close()
            if r.status_code >= 400:
                raise self._explain(url, r.status_code)
            size = _total_size(r)
            if r.headers.get("ETag"):
                self.etags[name] = r.headers["ETag"]
            files.append(RemoteFile(name, size))
        return Listing(files)

    def fetch(self, listing: Listing, ctx: FetchContext) -> None:
        urls = self._urls()
        parallel(lambda remote: self._get(urls[remote.path], remote, ctx), listing.files, ctx.max_workers)

    def _get(self, url: str, remote: RemoteFile, ctx: FetchContext) -> None:
        final = ctx.partial / remote.path
        if final.is_file() and (remote.size is None or final.stat().st_size == remote.size):
            return
        final.parent.mkdir(parents=True, exist_ok=True)
        part = final.with_name(final.name + PART)
        failures = 0
        while True:
            have = part.stat().st_size if part.exists() else 0
            if remote.size is not None and have == remote.size:
                break
            try:
                if self._stream(url, remote, part, have, ctx):
                    break
                failures = 0
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
                grew = (part.stat().st_size if part.exists() else 0) > have
                failures = 0 if grew else failures + 1
                if failures >= _ATTEMPTS:
                    raise self.error(f"{url}: connection failed {failures} times in a row without progress "
                                     f"({type(e).__name__})", hint="run again: it resumes where it stopped") from None
                time.sleep(min(2 ** failures, 30) if not grew else 0.2)
        os.rename(part, final)

    def _stream(self, url: str, remote: RemoteFile, part: Path, have: int, ctx: FetchContext) -> bool:
        """One GET from `have` on. True when the file is complete; False to go round again."""
        headers = {"Accept-Encoding": "identity"}
        etag = self.etags.get(remote.path)
        if have:
            headers["Range"] = f"bytes={have}-"
            if etag and not etag.startswith("W/"):
                headers["If-Range"] = etag
        with requests.get(url, headers=headers, stream=True, timeout=_TIMEOUT) as r:
            if r.status_code == 416 and have:  # asked past the end: what we have is all there is, or stale
                if remote.size is None or have == remote.size:
                    return True
                part.unlink()
                return False
            if r.status_code >= 400:
                raise self._explain(url, r.status_code)
            resumed = r.status_code == 206
            if resumed and not r.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
                raise self.error(f"{url}: the server answered the range request for bytes {have}- with "
                                 f"{r.headers.get('Content-Range')!r}")
            sha = hashlib.sha256()
            if resumed:
                _hash_prefix(part, have, sha)
            mode = "ab" if resumed else "wb"  # 200 to a range request: the file changed or ranges are ignored
            with open(part, mode) as f:
                for chunk in r.iter_content(_CHUNK):
                    f.write(chunk)
                    sha.update(chunk)
            size = part.stat().st_size
            expected = remote.size if remote.size is not None else _total_size(r, have if resumed else 0)
            if expected is not None and size < expected:
                return False  # the body ended early without an error: resume
            ctx.computed[remote.path] = {"sha256": sha.hexdigest()}
            return True


def _total_size(r: requests.Response, offset: int = 0) -> int | None:
    content_range = r.headers.get("Content-Range", "")
    if "/" in content_range and not content_range.endswith("/*"):
        return int(content_range.rsplit("/", 1)[1])
    length = r.headers.get("Content-Length")
    return offset + int(length) if length is not None and r.status_code in (200, 206) else None


def _hash_prefix(path: Path, length: int, sha) -> None:
    with open(path, "rb") as f:
        remaining = length
        while remaining:
            chunk = f.read(min(_CHUNK, remaining))
            if not chunk:
                break
            sha.update(chunk)
            remaining -= len(chunk)
