"""The base of every spec model, and the small value types specs share."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError

from a4ray.core.redact import is_secret_value

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
        for name, item in value.items():
            if isinstance(item, (str, int, float)) and is_secret_value(name, str(item)):
                # `key` extends the error's location to the variable (overrides.validate reads it), so the
                # error names network.env.HF_TOKEN; the policy's words are core.redact's, the one rule.
                raise PydanticCustomError("secret_in_spec", "{key} holds a secret value", {"key": name})
    return value


EnvValue = Annotated[str, BeforeValidator(_env_value)]
EnvVars = Annotated[dict[str, EnvValue], BeforeValidator(_env_map)]


def _arg(value: Any) -> Any:
    # In argv, YAML's scalars mean their text: `[true]` is the command `true`, `[sleep, 5]` sleeps.
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, (int, float)) else value


Arg = Annotated[str, BeforeValidator(_arg)]


# --------------------------------------------------------------------------- paths a job writes


def _under(path: PurePosixPath, root: str) -> bool:
    root_path = PurePosixPath(root)
    return path == root_path or root_path in path.parents


def write_path_problem(path: str, workspace: str, local_workspace: str) -> str | None:
    """Why `path`, which a spec names for writing (relative to the workspace unless absolute), may lead outside
    the workspace, from the spec alone; None if it cannot. The nodes' workspace is `workspace` (shared storage)
    or, on simulated nodes, `local_workspace`; symlinks are checked where the workspace is known
    (`escapes_workspace`)."""
    pure = PurePosixPath(path)
    if ".." in pure.parts:
        return f"{path!r} leaves the workspace through '..'; name a path inside it"
    roots = [workspace] + ([local_workspace] if local_workspace.startswith("/") else [])
    if pure.is_absolute() and not any(_under(pure, root) for root in roots):
        return (f"{path!r} is outside the workspace ({' or '.join(roots)}); give a path relative to the workspace "
                "(or an absolute one under storage.workspace)")
    return None


def escapes_workspace(workspace: Path, path: str | Path) -> Path | None:
    """Where `path` (relative to `workspace` unless absolute) really leads, symlinks followed, if that is outside
    `workspace`; None if it stays inside."""
    root = workspace.resolve()
    real = (workspace / path).resolve()  # an absolute `path` replaces `workspace`
    return None if real == root or root in real.parents else real
