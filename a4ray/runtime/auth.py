"""A closed local control plane: Ray token authentication and loopback binding for a4ray's local clusters
(`a4ray local up`, the embedded cluster, the test clusters), and the token for a4ray's own clients.

How Ray (>= 2.52; 2.60 here) does it, per https://docs.ray.io/en/latest/ray-security/token-auth.html:
`RAY_AUTH_MODE=token` in a process's environment turns token authentication on for it: a head started
with it (GCS, raylets, dashboard and job API, Ray Client server) refuses requests without the token, and a
client with it (`ray.init`, Ray Client, `ray job submit`, `JobSubmissionClient`) sends the token. The token
is `RAY_AUTH_TOKEN`, else the file named by `RAY_AUTH_TOKEN_PATH`, else `~/.ray/auth_token`. So the same
user submits to an a4ray local cluster with `RAY_AUTH_MODE=token ray job submit ...`: the token is in the
default file, which a4ray creates (mode 0600) when there is none. The token is a secret: it is registered
with the redactor here and never printed by a4ray (Ray's `ray get-auth-token` prints it, for the dashboard).

Ray binds a head to loopback only when the head's node address is 127.0.0.1, and it rewrites 127.0.0.1 in an
address to the machine's external IP unless it runs as single-machine Ray (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`,
what it does on macOS): `loopback_only()` sets that for this process and everything it starts.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import ray._private.ray_constants as ray_constants
from ray._raylet import Config

from a4ray.core.redact import register_secret

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
LOOPBACK = "127.0.0.1"
_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def token_file() -> Path:
    """Where Ray reads the token from when RAY_AUTH_TOKEN is not set."""
    return Path(os.environ.get(TOKEN_PATH_ENV) or Path.home() / ".ray" / "auth_token")


def _read_token() -> str | None:
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip()
    try:
        return token_file().read_text().strip() or None
    except OSError:
        return None


def ensure_token() -> str:
    """The token this user's local clusters use, made (256 random bits, readable by this user only) if none."""
    token = _read_token()
    if token is None:
        # Written aside and linked into place, which fails if another process made one meanwhile (two clusters
        # started at once, as pytest-xdist's workers do): all then use the one token, never a half-written file.
        path = token_file()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, aside = tempfile.mkstemp(dir=path.parent, prefix=".auth_token.")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
        finally:
            os.unlink(aside)
        token = _read_token()
        assert token
    register_secret(token)
    return token


Undo = Callable[[], None]


_holds: dict[str, list] = {}  # env var -> [holders, its value before the first hold]
_holds_lock = threading.Lock()


def _hold_env(name: str, value: str, applied: Callable[[], None] = lambda: None) -> Undo:
    """Set this process's environment variable `name` to `value` for as long as anything holds it; returns the
    release. The first hold saves what was there and the last release puts it back, in whatever order the holders
    go: two local clusters in one process (a notebook's and a test's), the first shut down first, must not take
    the setting from the second while it runs. `applied()` runs after the variable is set and after it is put
    back (Ray caches some of what it reads)."""
    with _holds_lock:
        if name not in _holds:
            _holds[name] = [0, os.environ.get(name)]
        _holds[name][0] += 1
        if _holds[name][0] == 1 or os.environ.get(name) != value:  # (set again where something else changed it)
            os.environ[name] = value
            applied()
    released = False

    def release() -> None:
        nonlocal released
        with _holds_lock:
            if released:
                return
            released = True
            _holds[name][0] -= 1
            if _holds[name][0] == 0:
                before = _holds.pop(name)[1]
                if before is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = before
                applied()

    return release


def enable_token_auth() -> Undo:
    """Token authentication on for this process and every process it starts (a local cluster's head and nodes,
    their workers and job drivers), until the returned undo (the last one, where several hold it): after it,
    this process no longer offers the token to clusters it connects to later (another host's must never get
    it). An explicit RAY_AUTH_MODE=disabled is overridden: a4ray's local clusters always authenticate (an open
    Jobs API is remote code execution for whoever reaches it)."""
    ensure_token()
    # Ray caches its config; this process must see token mode too (as ray.init does)
    return _hold_env(AUTH_MODE_ENV, "token", applied=lambda: Config.initialize(""))


def use_token_for(address: str | None) -> Undo:
    """Before a4ray connects to `address` as a client: send this user's token where Ray would (a cluster on this
    machine) if RAY_AUTH_MODE does not say otherwise. Never to another host: the token is this machine's.
    Returns what undoes it (when the connection closes)."""
    undo: list[Undo] = []
    if os.environ.get(AUTH_MODE_ENV) is None and (address is None or is_loopback(address)) and _read_token():
        undo.append(enable_token_auth())
    if address is not None and is_loopback(address):
        undo.append(loopback_only())
    return lambda: _undo_all(undo)


def _undo_all(undo: list[Undo]) -> None:
    for step in reversed(undo):
        step()


def is_loopback(address: str) -> bool:
    """Whether `address` (host, host:port, or a URL: http://, ray://) is this machine's loopback."""
    host = address.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_only() -> Undo:
    """Ray in this process and every process it starts keeps 127.0.0.1 as it is (single-machine Ray), until
    the returned undo (the last one, where several hold it)."""
    def applied() -> None:  # read when Ray resolves this machine's address
        ray_constants.ENABLE_RAY_CLUSTER = ray_constants.env_bool(_SINGLE_MACHINE_ENV, not ray_constants.IS_WINDOWS_OR_OSX)

    return _hold_env(_SINGLE_MACHINE_ENV, "0", applied)


def submit_hint(dashboard_url: str) -> str:
    """How the same user submits a job to a local cluster with `ray job submit` (the token is in its file)."""
    where = "" if not os.environ.get(TOKEN_PATH_ENV) else f" RAY_AUTH_TOKEN_PATH={token_file()}"
    return f"RAY_AUTH_MODE=token{where} RAY_ADDRESS={dashboard_url} ray job submit --working-dir . -- "
