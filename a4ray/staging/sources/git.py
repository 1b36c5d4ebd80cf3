"""git+https:// sources: a checkout pinned to one commit (and the submodule commits it pins).

Fetches only that commit (`git fetch --depth 1 origin <sha>`, falling back to a full fetch for servers
that refuse SHA wants), checks it out detached, and verifies HEAD is the commit with a clean tree. No
credentials are ever sent and git never prompts (GIT_TERMINAL_PROMPT=0): a private repo fails clearly.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from a4ray.core.redact import redact
from a4ray.staging.layout import walk_files
from a4ray.staging.sources.source import FetchContext, Listing, RemoteFile, Source

_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true", "GIT_LFS_SKIP_SMUDGE": "0"}


class GitSource(Source):
    scheme = "git"

    def describe(self) -> str:
        subs = " with submodules" if self.artifact.submodules else ""
        return f"git checkout of {self.ref.location} at {self.ref.revision}{subs} (depth 1)"

    def _git(self, *args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                             env={**os.environ, **_ENV}, timeout=3600)
        if check and out.returncode != 0:
            lines = (out.stderr or out.stdout).strip().splitlines()
            tail = redact(lines[-1]) if lines else f"exit code {out.returncode}"
            raise self.error(f"git {args[0]} failed for {self.ref.location}: {tail}",
                             hint="check the URL and that the commit exists there; private repos are not "
                             "supported (no credentials are sent)")
        return out

    def list(self, token: str | None) -> Listing:
        # The commit is the listing; the files are known only once it is checked out.
        return Listing([], resolved=self.ref.revision)

    def fetch(self, listing: Listing, ctx: FetchContext) -> None:
        repo, commit = ctx.partial, self.ref.revision
        if (repo / ".git").is_dir():
            head = self._git("rev-parse", "HEAD", cwd=repo, check=False).stdout.strip()
            if head == commit:
                return self._submodules(repo)
        self._git("init", "-q", cwd=repo)
        # a4ray's manifest and partial marker are not part of the tree: keep `git status` clean for users too.
        (repo / ".git" / "info").mkdir(parents=True, exist_ok=True)
        (repo / ".git" / "info" / "exclude").write_text(".a4ray-*\n")
        self._git("remote", "remove", "origin", cwd=repo, check=False)
        self._git("remote", "add", "origin", self.ref.location, cwd=repo)
        if self._git("fetch", "-q", "--depth", "1", "origin", commit, cwd=repo, check=False).returncode != 0:
            self._git("fetch", "-q", "origin", cwd=repo)
        self._git("-c", "advice.detachedHead=false", "checkout", "-q", "--force", commit, cwd=repo)
        self._submodules(repo)

    def _submodules(self, repo: Path) -> None:
        if self.artifact.submodules and (repo / ".gitmodules").exists():
            self._git("submodule", "update", "-q", "--init", "--recursive", "--depth", "1", cwd=repo)

    def verify(self, listing: Listing, ctx: FetchContext) -> None:
        head = self._git("rev-parse", "HEAD", cwd=ctx.partial).stdout.strip()
        if head != self.ref.revision:
            raise self.error(f"checked out {head}, not {self.ref.revision}")
        dirty = self._git("status", "--porcelain", "--ignore-submodules=none", cwd=ctx.partial).stdout.strip()
        if dirty:
            raise self.error(f"the checkout is not clean after fetching: {dirty.splitlines()[0]}")
        listing.files = [RemoteFile(path, st.st_size) for path, st in walk_files(ctx.partial)]
