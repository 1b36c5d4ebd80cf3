"""Secret redaction for every line a4ray prints, logs, records or raises, and the one rule for secrets in specs.

A secret is the value of an environment variable whose name looks secret (HF_TOKEN, *_PASSWORD, ...),
a value registered explicitly (a Hub token read on a node, the cluster's Ray token), or a credential
inside a URL: its userinfo (`https://user:TOKEN@host/`) and query parameters such as `token`, `sig`,
`X-Goog-Signature`, `access_token`. Values are masked wherever they appear in text; names stay visible,
so a log still says *that* HF_TOKEN was set, and which URL was fetched, never the secret itself.

Secrets never go in a spec (`secret_in_spec`): a spec is printed by --dry-run, recorded in the run
directory and, on GKE, rendered into manifests. They reach the nodes through their environment.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Mapping

MASK = "***"

# Names whose values are secrets: a word of the name (split at `_`, `.`, `-`) is one of these, so
# HF_TOKEN, RAY_AUTH_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, DB_PASSWORD and hf_token are secret,
# while TOKENIZERS_PARALLELISM, MAX_TOKENS and RAY_AUTH_MODE are not. A false positive masks a value.
SECRET_NAME = re.compile(
    r"(?:^|[_.-])(?:[A-Z0-9]*TOKEN|SECRETS?|PASSW(?:OR)?D|PASSPHRASE|CREDENTIALS?|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY"
    r"|SIGNATURE)(?:$|[_.-])|(?:^|[_.-])AUTH(?:ORIZATION)?$",
    re.IGNORECASE,
)
# Query parameters of a URL whose values are credentials (signed URLs of GCS, S3, Azure; OAuth; API keys).
SECRET_QUERY = re.compile(
    r"^(?:token|access_token|id_token|refresh_token|auth|authorization|sig|signature|key|api_?key|apikey|"
    r"password|passwd|secret|client_secret|code|x-goog-signature|x-goog-credential|x-amz-signature|"
    r"x-amz-credential|x-amz-security-token)$",
    re.IGNORECASE,
)
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>`]*[^\s'\"<>`,.;:)\]]")
_USERINFO = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)([^/?#@\s]*)@")
_QUERY_PARAM = re.compile(r"([?&;])([^=&#\s]+)=([^&#\s]*)")
_MIN_SECRET_LEN = 4  # shorter values would mask ordinary words


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def secret_values(env: Mapping[str, str]) -> set[str]:
    return {v for k, v in env.items() if is_secret_name(k) and v and len(v) >= _MIN_SECRET_LEN}


def redact_url(url: str) -> str:
    """`url` with its credentials masked: the password of its userinfo (a user name alone is masked too:
    `https://TOKEN@github.com` is a token) and the values of credential query parameters."""
    def userinfo(m: re.Match) -> str:
        user, colon, _ = m.group(2).partition(":")
        return f"{m.group(1)}{user}:{MASK}@" if colon else f"{m.group(1)}{MASK}@"

    def param(m: re.Match) -> str:
        name = m.group(2)
        secret = SECRET_QUERY.match(name) or is_secret_name(name)
        return f"{m.group(1)}{name}={MASK}" if secret and m.group(3) else m.group(0)

    return _QUERY_PARAM.sub(param, _USERINFO.sub(userinfo, url, count=1))


def redact_urls(text: str) -> str:
    """Every URL in `text` with its credentials masked."""
    return _URL.sub(lambda m: redact_url(m.group(0)), text) if "://" in text else text


def has_url_credentials(text: str) -> bool:
    return redact_urls(text) != text


def is_secret_value(name: str, value: str) -> bool:
    """Whether a spec's env var `name`=`value` puts a secret in the spec. A value that is an absolute path names
    the file holding a secret (a mounted Kubernetes Secret, GOOGLE_APPLICATION_CREDENTIALS): not a secret."""
    return bool(value) and is_secret_name(name) and not value.startswith("/")


def secret_in_spec(field: str) -> str:
    """Why a secret value at spec field `field` (e.g. network.env.HF_TOKEN) is refused, and what to do: the one
    policy of `run`, `submit`, `render` and the Python API (the spec models apply it)."""
    return (f"{field} holds a secret value; a spec is printed by --dry-run, recorded in the run directory and "
            "rendered into manifests, so secrets never go in one. Give it to the nodes' environment instead: on "
            "GKE a Kubernetes Secret (kuberay.secrets); locally the environment `a4ray local up` (or the job) "
            "starts in; for the Hub token also staging.token_file")


class Redactor:
    """Masks known secret values and URL credentials in text, and secret-named variables in env mappings."""

    def __init__(self, values: Iterable[str] = ()):
        self._lock = threading.Lock()
        self._values: set[str] = set()
        self._pattern: re.Pattern[str] | None = None
        self.add(values)

    def add(self, values: Iterable[str]) -> None:
        new = {v for v in values if v and len(v) >= _MIN_SECRET_LEN}
        with self._lock:
            if new - self._values:
                self._values |= new
                # Longest first, so a secret that contains another is masked whole.
                alternatives = sorted(self._values, key=len, reverse=True)
                self._pattern = re.compile("|".join(re.escape(v) for v in alternatives))

    def add_env(self, env: Mapping[str, str]) -> None:
        self.add(secret_values(env))

    def text(self, text: str) -> str:
        pattern = self._pattern
        return redact_urls(pattern.sub(MASK, text) if pattern else text)

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        return {k: (MASK if is_secret_name(k) and v else self.text(v)) for k, v in env.items()}


# Process-wide redactor: seeded from this process's environment, extended by whoever learns a secret.
default = Redactor(secret_values(os.environ))


def redact(text: str) -> str:
    return default.text(text)


def register_secret(value: str) -> None:
    default.add([value])
