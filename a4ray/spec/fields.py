"""The base of every spec model, and the small value types specs share."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict
from pydantic_core import PydanticCustomError

from a4ray.core.redact import is_secret_value

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Spec(BaseModel):
    """Strict: unknown keys are errors (a typo must not silently become a default), and so are infinite and
    NaN numbers (`.inf` seconds would sleep forever or overflow the OS's timers)."""

    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)


# --------------------------------------------------------------------------- the limits of numbers
# Every number a spec holds has an upper bound, so well-formed but absurd input (a count with many zeros) is
# refused at once, naming the field and the limit, instead of being worked on for minutes or handed to a tool
# that overflows. tests/test_bad_input.py holds every numeric field of every spec to this.

# Counts (steps, layers, batch sizes, workers, ...): what the tools a4ray hands them to hold, a C int
# (torch, Megatron-LM's and ms-swift's argparse ints, nccl-tests' and DeepEP's C arguments).
INT_MAX = 2**31 - 1
# Seconds (timeouts, grace periods, hang windows, backoffs): a year is already far past any of them.
MAX_SECONDS = 366 * 24 * 3600
# A gang's size: no GKE cluster holds more A4 nodes than this (it is 32,768 B200 GPUs), and every node
# count a4ray plans for is worked through node by node.
MAX_NODES = 4096
# GPUs per node: no GCE machine type has more (A4: 8; a2-megagpu-16g: 16).
MAX_GPUS_PER_NODE = 16
# Ray CPUs per node: a4-highgpu-8g has 224 vCPUs; no machine type reaches this.
MAX_CPUS_PER_NODE = 1024


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("float_type", "Input should be a number")
    return value


# Every number of every spec is one of these two, because Python's bool is an int and pydantic takes `true` as
# 1: YAML's `nodes: true` would be a gang of one. An integer is strict: written as one, never a bool, 2.0 (a
# count with a fraction point is a slip, refused at once rather than guessed) or text. A real number takes an
# integer and the text of a number (PyYAML reads `1e3` as text, YAML 1.2 as a float), never a bool.
# tests/test_bad_input.py holds every number of every spec to this.
Integer = Annotated[int, Strict()]
Number = Annotated[float, BeforeValidator(_not_a_bool)]

PositiveInt = Annotated[Integer, Field(gt=0, le=INT_MAX)]
NonNegativeInt = Annotated[Integer, Field(ge=0, le=INT_MAX)]
PositiveFloat = Annotated[Number, Field(gt=0)]
NonNegativeFloat = Annotated[Number, Field(ge=0)]
Seconds = Annotated[Number, Field(gt=0, le=MAX_SECONDS)]
NonNegativeSeconds = Annotated[Number, Field(ge=0, le=MAX_SECONDS)]
ExitCode = Annotated[Integer, Field(ge=0, le=255)]


def _env_value(value: Any) -> str:
    # YAML turns `4` into an int and `0.5` into a float; env values are strings. A bool is refused
    # because `true` means nothing to NCCL: the user must say 1/0 or quote the string.
    if isinstance(value, bool):
        raise ValueError("env values are strings: write 1/0 or quote the value, not true/false")
    if isinstance(value, (int, float, str)):
        return _no_nul(str(value), "an environment value")
    raise ValueError(f"env values are strings, got {type(value).__name__}")


def _no_nul(text: str, what: str) -> str:
    # The OS takes argv, env and paths as C strings: a NUL would end them early (Python refuses it at exec).
    if "\0" in text:
        raise ValueError(f"{what} cannot hold a NUL character (\\0)")
    return text


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


Arg = Annotated[str, BeforeValidator(_arg), AfterValidator(lambda arg: _no_nul(arg, "a command argument"))]


# --------------------------------------------------------------------------- paths

PATH_MAX = 4095  # bytes of a whole path (Linux's PATH_MAX, less its NUL)
NAME_MAX = 255  # bytes of one component (ext4, xfs, NFS, Lustre, gcsfuse)


def _path_chars(path: str) -> str:
    """A path the OS can hold: no NUL or other control character, no component over NAME_MAX bytes, the whole
    within PATH_MAX bytes. A path that breaks these would be accepted here and fail later, deep in the OS."""
    bad = next((c for c in path if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise ValueError(f"a path cannot hold the control character {bad!r} (NUL, newline, tab, ...)")
    if len(path.encode()) > PATH_MAX:
        raise ValueError(f"a path of {len(path.encode())} bytes is longer than any the OS takes ({PATH_MAX})")
    long = next((part for part in path.split("/") if len(part.encode()) > NAME_MAX), None)
    if long is not None:
        raise ValueError(f"the path component {long[:20]!r}... is {len(long.encode())} bytes; a file or directory "
                         f"name holds at most {NAME_MAX}")
    return path


PathStr = Annotated[str, AfterValidator(_path_chars)]

# Directories of the OS itself: a workspace there (or the root) would make every "stays inside the workspace"
# guarantee empty, and write run directories among the system's files.
SYSTEM_DIRS = ("/", "/bin", "/boot", "/etc", "/lib", "/lib32", "/lib64", "/opt", "/run", "/sbin", "/srv", "/usr",
               "/var", "/home", "/tmp")
PSEUDO_FILESYSTEMS = ("/proc", "/sys", "/dev")


def workspace_problem(path: str) -> str | None:
    """Why `path` cannot be a workspace root, or None: the filesystem root, a directory of the OS itself, or
    anything on a pseudo-filesystem (/proc, /sys, /dev)."""
    pure = PurePosixPath(path)
    if not pure.is_absolute():
        return None
    normal = PurePosixPath("/", *(part for part in pure.parts[1:] if part not in ("", ".")))
    if ".." in normal.parts:
        return f"{path!r} has '..' in it: name the workspace directory itself"
    if str(normal) in SYSTEM_DIRS or any(_under(normal, root) for root in PSEUDO_FILESYSTEMS):
        return (f"{path!r} is the filesystem root or one of the OS's own directories: every path the job writes "
                "would be 'inside' it; name a directory of its own, e.g. /mnt/a4ray or /lustre/a4ray")
    return None


# --------------------------------------------------------------------------- paths a job writes


def on_nodes(workspace: str, path: str) -> str:
    """A spec path as the nodes see it: absolute as given, else under the workspace root."""
    return path if path.startswith("/") else str(PurePosixPath(workspace) / path)


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
