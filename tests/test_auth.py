"""The token of a4ray's local clusters (a4ray.runtime.auth): made once, readable by its user only, masked
everywhere, and offered only to clusters on this machine."""

from __future__ import annotations

import os

import pytest
import ray._private.ray_constants as ray_constants
from ray._private.authentication.authentication_utils import is_token_auth_enabled
from ray._raylet import Config

from a4ray.core.redact import redact
from a4ray.runtime import auth


def test_the_token_is_made_once_for_this_user_only_and_masked(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "ray" / "auth_token"))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    token = auth.ensure_token()
    assert len(token) == 64 and auth.ensure_token() == token
    assert oct((tmp_path / "ray" / "auth_token").stat().st_mode & 0o777) == "0o600"
    assert token not in redact(f"Authorization: Bearer {token}")
    assert "RAY_AUTH_TOKEN_PATH=" in auth.submit_hint("http://127.0.0.1:8265")


@pytest.fixture
def ray_config_restored():
    """Ray caches its config (token mode among it) per process: `use_token_for`'s undo re-reads it with this test's
    environment, so once the environment is back (monkeypatch's undo runs before this one's), read it again, or this
    process's later calls to the session cluster go without the token."""
    yield
    Config.initialize("")


def test_the_token_is_offered_to_this_machine_only_and_taken_back(ray_config_restored, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "auth_token"))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    monkeypatch.setattr(auth, "_holds", {})  # as in a process with no local cluster (this one's session cluster holds)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    auth.ensure_token()
    single_machine = ray_constants.ENABLE_RAY_CLUSTER
    undo = auth.use_token_for("10.1.2.3:6379")  # another host: never
    assert os.environ.get("RAY_AUTH_MODE") is None
    undo()
    for address in ("127.0.0.1:6379", "http://127.0.0.1:8265", "ray://localhost:10001"):
        undo = auth.use_token_for(address)
        assert os.environ["RAY_AUTH_MODE"] == "token" and is_token_auth_enabled()
        assert ray_constants.ENABLE_RAY_CLUSTER is False  # Ray keeps 127.0.0.1 as it is
        undo()
        assert os.environ.get("RAY_AUTH_MODE") is None and ray_constants.ENABLE_RAY_CLUSTER is single_machine


def test_two_local_clusters_in_one_process_keep_token_auth_until_the_last_one_ends(ray_config_restored, tmp_path,
                                                                                   monkeypatch):
    """A process that starts local cluster A, then B, then shuts A down (a test module's cluster beside the session's,
    a notebook's second cluster) still offers B the token: with A's undo putting back what was there before A, this
    process's next `ray.init` to B waited forever for a GCS that refused it (found when a subset of the suite hung
    20 minutes in `Node._init_gcs_client`). The setting goes only with the last holder, in any order."""
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "auth_token"))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    monkeypatch.setattr(auth, "_holds", {})
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    a = [auth.enable_token_auth(), auth.loopback_only()]  # what SimulatedCluster.start takes
    b = [auth.enable_token_auth(), auth.loopback_only()]
    for undo in reversed(a):  # A shuts down first
        undo()
        undo()  # twice: a release counts once
    assert os.environ["RAY_AUTH_MODE"] == "token" and is_token_auth_enabled()
    assert ray_constants.ENABLE_RAY_CLUSTER is False
    for undo in reversed(b):
        undo()
    assert os.environ.get("RAY_AUTH_MODE") is None and not is_token_auth_enabled()
    assert ray_constants.ENABLE_RAY_CLUSTER is True and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ
