"""hf:// sources (the Hugging Face Hub, or any Hub-compatible endpoint) through huggingface_hub.

hf://: the revision is resolved to a commit first (`HfApi.repo_info`), the tree listed at that commit
(sizes, LFS sha256, git blob ids), then `snapshot_download(local_dir=<partial>, allow_patterns=...)`
moves the bytes: Xet (hf_xet) where the repo and package allow it, otherwise HTTP; files already
complete in the partial directory (its `.cache/huggingface` metadata) are skipped on a rerun. Every file
is then checked against the listing: LFS files by sha256, the others by their git blob id.
The endpoint is `staging.hf_endpoint`, else `HF_ENDPOINT` (a mirror, or the tests' local Hub-compatible server).
"""

from __future__ import annotations

from pathlib import Path

from a4ray.staging.sources.source import FetchContext, Listing, RemoteFile, Source, select


class HfSource(Source):
    scheme = "hf"
    uses_token = True

    def describe(self) -> str:
        rev = self.ref.revision or "main (resolved to a commit when staged; pin @<commit> to fix it)"
        kind = "dataset" if self.ref.repo_type == "dataset" else "model"
        return (f"huggingface_hub snapshot_download of {kind} {self.ref.location} at {rev} "
                f"(hf_xet where available), sha256-checked against the LFS listing")

    def _api(self, token: str | None):
        from huggingface_hub import HfApi

        # token=False: never fall back to a token cached in ~/.cache; only the one a4ray was told about.
        return HfApi(endpoint=self.options.hf_endpoint, token=token or False)

    def _explain(self, error: Exception, token: str | None) -> Exception:
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        src = self.artifact.source
        status = getattr(getattr(error, "response", None), "status_code", None)
        token_hint = ("the token was sent: check that it can read this repo" if token else
                      "no token was found: set HF_TOKEN on the nodes or staging.token_file (a mounted Secret)")
        if isinstance(error, RevisionNotFoundError):
            return self.error(f"revision {self.ref.revision!r} not found in {self.ref.location}",
                              hint="check the commit, tag or branch")
        if isinstance(error, GatedRepoError):
            return self.error(f"{src} is gated (HTTP {status})",
                              hint=f"accept its terms on the Hub with the token's account; {token_hint}")
        if status == 401 or isinstance(error, RepositoryNotFoundError):
            return self.error(f"{src}: not found or not authorized (HTTP {status})",
                              hint=f"check the repo id; private repos need a token ({token_hint})")
        if isinstance(error, HfHubHTTPError):
            return self.error(f"{src}: the Hub answered HTTP {status}", hint="retry later")
        return self.error(f"{src}: cannot reach the Hub ({type(error).__name__})",
                          hint="check the nodes' network, or HF_ENDPOINT if a mirror is used")

    def list(self, token: str | None) -> Listing:
        from huggingface_hub.hf_api import RepoFile

        api = self._api(token)
        try:
            info = api.repo_info(self.ref.location, repo_type=self.ref.repo_type, revision=self.ref.revision)
            commit = info.sha
            tree = {f.path: f for f in api.list_repo_tree(self.ref.location, repo_type=self.ref.repo_type,
                                                          revision=commit, recursive=True)
                    if isinstance(f, RepoFile)}
        except Exception as e:  # noqa: BLE001 - every client error becomes one clear StagingError
            raise self._explain(e, token) from None
        names = select(tree, self.artifact)
        files = []
        for name in names:
            f = tree[name]
            digests = {"sha256": f.lfs.sha256} if f.lfs is not None else {"git-sha1": f.blob_id}
            files.append(RemoteFile(name, f.size, digests))
        self.commit = commit
        return Listing(files, resolved=commit)

    def fetch(self, listing: Listing, ctx: FetchContext) -> None:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # a4ray reports progress itself (job log + Ray metrics)
        try:
            snapshot_download(
                self.ref.location, repo_type=self.ref.repo_type, revision=listing.resolved,
                local_dir=ctx.partial, allow_patterns=[f.path for f in listing.files],
                token=ctx.token or False, max_workers=ctx.max_workers, endpoint=self.options.hf_endpoint,
            )
        except OSError:
            raise  # disk full and friends: the task explains them with the target's free space
        except Exception as e:  # noqa: BLE001
            raise self._explain(e, ctx.token) from None

    def junk(self, partial: Path) -> list[Path]:
        return [partial / ".cache"]  # huggingface_hub's download metadata for local_dir

