"""Secret redaction for every line a4ray prints, logs or raises.

A secret is the value of an environment variable whose name looks secret (HF_TOKEN, *_PASSWORD, ...),
or a value registered explicitly. Values are masked wherever they appear in text; names stay visible,
so a log still says *that* HF_TOKEN was set, never what it is.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Mapping

MASK = "***"

# Names whose values are secrets. Deliberately broad: a false positive only masks a value.
SECRET_NAME = re.compile(
    r"(TOKEN|SECRET|PASSW(OR)?D|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL|AUTH)", re.IGNORECASE
)
_MIN_SECRET_LEN = 4  # shorter values would mask ordinary words


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def secret_values(env: Mapping[str, str]) -> set[str]:
    return {v for k, v in env.items() if is_secret_name(k) and v and len(v) >= _MIN_SECRET_LEN}


class Redactor:
    """Masks known secret values in text and secret-named variables in env mappings."""

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
        return pattern.sub(MASK, text) if pattern else text

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        return {k: (MASK if is_secret_name(k) and v else self.text(v)) for k, v in env.items()}


# Process-wide redactor: seeded from this process's environment, extended by whoever learns a secret.
default = Redactor(secret_values(os.environ))


def redact(text: str) -> str:
    return default.text(text)


def register_secret(value: str) -> None:
    default.add([value])
