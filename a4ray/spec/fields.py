"""The base of every spec model, and the small value types specs share."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Spec(BaseModel):
    """Strict: unknown keys are errors (a typo must not silently become a default)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


def _env_value(value: Any) -> str:
    # YAML turns `4` into an int and `0.5` into a float; env values are strings. A bool is refused
    # because `true` means nothing to NCCL: the user must say 1/0 or quote the string.
    if isinstance(value, bool):
        raise ValueError("env values are strings: write 1/0 or quote the value, not true/false")
    if isinstance(value, (int, float, str)):
        return str(value)
    raise ValueError(f"env values are strings, got {type(value).__name__}")


def _env_map(value: Any) -> Any:
    if isinstance(value, dict):
        for name in value:
            if not isinstance(name, str) or not _ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not a valid environment variable name")
    return value


EnvValue = Annotated[str, BeforeValidator(_env_value)]
EnvVars = Annotated[dict[str, EnvValue], BeforeValidator(_env_map)]


def _arg(value: Any) -> Any:
    # In argv, YAML's scalars mean their text: `[true]` is the command `true`, `[sleep, 5]` sleeps.
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, (int, float)) else value


Arg = Annotated[str, BeforeValidator(_arg)]
