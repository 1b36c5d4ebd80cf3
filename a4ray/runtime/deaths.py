"""Ray's own word on why an actor or a task's worker died, in one line a report can carry.

Ray puts the cause in the error: "The actor is dead because its worker process has died. Worker exit type:
SYSTEM_ERROR ..." (a SIGKILL, the kernel's OOM killer, a crash), "... because its node has died: ... health
check failed", "... killed by `ray.kill`", "The actor ... is unavailable: ... Socket closed" (its connection
broke before Ray declared it dead), or, from its memory monitor, "1 worker(s) were killed due to the node
running low on memory. Memory on the node (IP: ...) was 22.9GB used / 24.0GB limit" and the node's top memory
users. A report that says only "the actor died" leaves the user to dig that out of the raylet's logs."""

from __future__ import annotations

import re
from pathlib import Path

import ray

# What a ray.get on an actor's call raises when the actor is gone: it died (or its node did), or Ray's memory
# monitor killed its worker (OutOfMemoryError is no RayActorError).
ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)

_CAP = 480
_TOP_USERS = 3
# Where Ray's words stop being about this death and turn to generic advice.
_ADVICE = re.compile(r"\s(?:Some common causes|There are some potential root causes|Refer to the documentation|"
                     r"To see more information|Set max_restarts|If the process was killed)")
_NODE_ID = re.compile(r",? (?:ID|Node Id): [0-9a-f]{16,}\.?")
# The actor's particulars Ray lists before the cause: the report says which node, in its own words.
_ACTOR_FIELD = re.compile(r"\t(?:class_name|actor_id|pid|name|namespace|ip): ")
_UNAVAILABLE = re.compile(r"is unavailable: (?:The actor is temporarily unavailable: )?(.*?)\.? The task may or "
                          r"may not")
_MEMORY_USER = re.compile(r"(\d+)\t([\d.]+)\t(.*)")


def why_died(error: BaseException) -> str:
    """The cause Ray gives for `error` (an actor's death, an OOM-killed or crashed worker), condensed."""
    text = getattr(error, "error_msg", None) or str(error)
    unavailable = _UNAVAILABLE.search(text)
    if unavailable:  # the call's connection broke before Ray declared the actor (or its node) dead
        return f"The actor is unavailable: {unavailable.group(1)}"
    lines = [line for line in text.splitlines()
             if line.strip() and not _ACTOR_FIELD.match(line) and line != ray.exceptions.ActorDiedError.BASE_ERROR_MSG]
    if not lines:
        return type(error).__name__
    why = _NODE_ID.sub("", lines[0])
    if len(lines) > 1 and lines[1].startswith("\t"):  # a node's death: why the node went ("health check failed")
        why = f"{why.rstrip('. ')}: {lines[1].strip()}"
    why = " ".join(_ADVICE.split(why, 1)[0].split())
    top = _top_memory_users(lines)
    if top:
        why += f"; the node's top memory users: {top}"
    return why if len(why) <= _CAP else why[:_CAP].rsplit(" ", 1)[0] + " ..."


def _top_memory_users(lines: list[str]) -> str:
    """From the table Ray's memory monitor appends ("Top 10 memory users: PID MEM(GB) COMMAND", one per line)."""
    start = next((i for i, line in enumerate(lines) if line.startswith("Top 10 memory users")), None)
    if start is None:
        return ""
    users = [m.groups() for line in lines[start + 1:start + 1 + _TOP_USERS] if (m := _MEMORY_USER.match(line))]
    return ", ".join(f"pid {pid} {gb} GB ({_program(command)})" for pid, gb, command in users)


def _program(command: str) -> str:
    """What a process runs, without its arguments (a command line may carry a token): `python -m a4ray.mcore`,
    `ray::NodeActor.poll`."""
    words = command.split()
    if not words:
        return "?"
    module = next((words[i + 1] for i in range(min(len(words) - 1, 4)) if words[i] == "-m"), None)
    return Path(words[0]).name + (f" -m {module}" if module else "")
