"""A local HTTP server for the staging tests, standing in for the outside services this machine cannot reach.

- A Hugging Face Hub-compatible endpoint (point `HF_ENDPOINT` at it): the routes `snapshot_download` uses
  (`/api/models/<repo>/revision/<rev>`, `/api/models/<repo>/tree/<rev>`, `/<repo>/resolve/<rev>/<file>`),
  with the Hub's headers (X-Repo-Commit, ETag = sha256 for LFS files or the git blob id, X-Error-Code on
  errors), private repos that answer 401 without the right bearer token, and LFS listings (sha256).
- Plain files under `/files/<name>` with HEAD, ETag and Range (206), for the https source; a file can be
  set to drop the connection mid-body on its first GETs, and every body can be throttled.

Every request is recorded (method, path, Range, Authorization) so tests can count downloads and check
which credentials were sent.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    token: str | None = None  # private: only this bearer token may read it
    lfs_min: int = 1024  # files this large or larger are LFS files (listed with their sha256)

    @property
    def commit(self) -> str:
        h = hashlib.sha1()
        for path in sorted(self.files):
            h.update(path.encode() + b"\0" + hashlib.sha256(self.files[path]).digest())
        return h.hexdigest()

    def etag(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if len(data) >= self.lfs_min else git_blob_id(data)

    def tree(self) -> list[dict]:
        out = []
        for path, data in sorted(self.files.items()):
            entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}
            if len(data) >= self.lfs_min:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            out.append(entry)
        return out


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None


@dataclass
class LocalServer:
    repos: dict[str, Repo] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    drop_after: dict[str, int] = field(default_factory=dict)  # file -> bytes sent before the connection drops
    drops: dict[str, int] = field(default_factory=dict)  # file -> how many GETs drop (then it is served whole)
    rate: float | None = None  # bytes/s for every body (None: as fast as possible)
    claimed_sizes: dict[str, int] = field(default_factory=dict)  # file -> size HEAD claims (a disk-full test)
    log: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> LocalServer:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()

    def gets(self, suffix: str) -> int:
        """GET requests (content downloads) whose path ends with `suffix`."""
        return sum(1 for r in self.log if r.method == "GET" and r.path.endswith(suffix))

    def record(self, request: Request) -> None:
        with self._lock:
            self.log.append(request)


def _handler(server: LocalServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        # ---------------------------------------------------------------------------------- routing
        def _route(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            server.record(Request("HEAD" if head else "GET", path, self.headers.get("Range"),
                                  self.headers.get("Authorization")))
            parts = path.strip("/").split("/")
            if parts[0] == "files":
                name = "/".join(parts[1:])
                if name not in server.files:
                    return self._error(404)
                return self._body(server.files[name], etag=hashlib.sha256(server.files[name]).hexdigest(),
                                  head=head, drop_key=name)
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._api(parts[2] + "/" + parts[3], parts[4:])
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), head)
            self._error(404)

        def _repo(self, repo_id: str, revision: str | None) -> Repo | None:
            repo = server.repos.get(repo_id)
            if repo is None:
                self._error(404, code="RepoNotFound")
                return None
            if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                self._error(401, code="RepoNotFound")  # as the Hub: a private repo is not admitted to exist
                return None
            if revision not in (None, "main", repo.commit):
                self._error(404, code="RevisionNotFound")
                return None
            return repo

        def _api(self, repo_id: str, rest: list[str]) -> None:
            if rest[:1] == ["tree"]:
                repo = self._repo(repo_id, rest[1] if len(rest) > 1 else None)
                if repo:
                    self._json(repo.tree())
                return
            revision = rest[1] if rest[:1] == ["revision"] and len(rest) > 1 else None
            repo = self._repo(repo_id, revision)
            if repo:
                self._json({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": bool(repo.token),
                            "siblings": [{"rfilename": p} for p in sorted(repo.files)]})

        def _resolve(self, repo_id: str, revision: str, file: str, head: bool) -> None:
            repo = self._repo(repo_id, revision)
            if repo is None:
                return
            if file not in repo.files:
                return self._error(404, code="EntryNotFound", extra={"X-Repo-Commit": repo.commit})
            self._body(repo.files[file], etag=repo.etag(file), head=head, drop_key=f"{repo_id}/{file}",
                       extra={"X-Repo-Commit": repo.commit})

        # --------------------------------------------------------------------------------- answers
        def _error(self, status: int, code: str | None = None, extra: dict | None = None) -> None:
            body = json.dumps({"error": code or "error"}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, data) -> None:
            body = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self, data: bytes, *, etag: str, head: bool, drop_key: str, extra: dict | None = None) -> None:
            start, status = 0, 200
            wanted = self.headers.get("Range")
            if_range = self.headers.get("If-Range")
            if wanted and (if_range is None or if_range.strip('"') == etag):
                start = int(wanted.removeprefix("bytes=").split("-")[0])
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status = 206
            self.send_response(status)
            self.send_header("ETag", f'"{etag}"')
            self.send_header("Accept-Ranges", "bytes")
            claimed = server.claimed_sizes.get(drop_key) if head else None
            self.send_header("Content-Length", str(claimed if claimed is not None else len(data) - start))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if head:
                return
            body = memoryview(data)[start:]
            cut = None
            with server._lock:
                if server.drops.get(drop_key, 0) > 0:
                    server.drops[drop_key] -= 1
                    cut = server.drop_after.get(drop_key, len(body) // 2)
            self._send(body[:cut] if cut is not None else body)
            if cut is not None:  # the connection drops mid-file, as flaky networks and proxies do
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

        def _send(self, body: memoryview) -> None:
            step = 64 * 1024
            for i in range(0, len(body), step):
                self.wfile.write(body[i:i + step])
                if server.rate:
                    time.sleep(step / server.rate)

    return Handler
