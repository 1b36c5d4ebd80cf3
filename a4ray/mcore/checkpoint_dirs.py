"""Megatron-LM's checkpoint directories, read without torch (the driver and the dry runs read them too):

    <save>/latest_checkpointed_iteration.txt   the tracker: the newest complete iteration, or "release"
    <save>/iter_0000020/                       an iteration's checkpoint; complete once metadata.json and
                                               DCP's .metadata are in (mcore writes them last)
    <save>/.iter_0000020.tmp/                  a save not yet renamed into place (a rank died while writing it)

What is in them, and the saving and loading: `a4ray.mcore.checkpointing`.
"""

from __future__ import annotations

from pathlib import Path

from a4ray.mcore.names import RELEASE, TRACKER


def iteration_dir(root: Path, iteration: int | str) -> Path:
    return Path(root) / (RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}")


def read_tracker(root: Path) -> int | str | None:
    """The tracker's iteration (an int, or "release"); None if there is none or it is unreadable."""
    try:
        value = (Path(root) / TRACKER).read_text().strip()
    except OSError:
        return None
    if value == RELEASE:
        return RELEASE
    try:
        return int(value)
    except ValueError:
        return None


def is_complete(directory: Path) -> bool:
    """mcore writes metadata.json after every rank's data and DCP's .metadata are in place. (common.pt, the
    non-tensor state, is a file of its own up to megatron-core 0.16; from 0.19 it is inside DCP's files.)"""
    return all((directory / name).is_file() for name in ("metadata.json", ".metadata"))


def newest_complete(save: Path) -> int | None:
    """The iteration to resume from: the tracker's, if its directory is complete, else the newest complete
    `iter_*` directory (a tracker lost or older than a renamed-in iteration)."""
    save = Path(save)
    candidates = []
    named = read_tracker(save)
    if isinstance(named, int):
        candidates.append(named)
    for d in save.glob("iter_*"):
        try:
            candidates.append(int(d.name.removeprefix("iter_")))
        except ValueError:
            continue
    for iteration in sorted(set(candidates), reverse=True):
        if is_complete(iteration_dir(save, iteration)):
            return iteration
    return None


def incomplete_after(save: Path, iteration: int | None) -> list[tuple[int, str]]:
    """Checkpoints newer than `iteration` that are not loaded, each with why: a save that died leaves its
    `.iter_NNNNNNN.tmp` (a rank killed while writing), a directory without mcore's closing metadata."""
    found: dict[int, str] = {}
    for d in Path(save).glob(".iter_*.tmp"):
        try:
            found[int(d.name.removeprefix(".iter_").removesuffix(".tmp"))] = (
                f"{d.name}: its save did not finish (a rank died while writing it)")
        except ValueError:
            continue
    for d in Path(save).glob("iter_*"):
        try:
            number = int(d.name.removeprefix("iter_"))
        except ValueError:
            continue
        if not is_complete(d):
            found.setdefault(number, f"{d.name}: incomplete (no metadata.json or .metadata)")
    return sorted((n, why) for n, why in found.items() if iteration is None or n > iteration)


def converted_dir(root: Path) -> Path:
    """The checkpoint directory a converted model's tracker names (`release` for a4ray's converter)."""
    root = Path(root)
    named = read_tracker(root)
    if named is None:
        raise FileNotFoundError(f"{root}: no {TRACKER}; not a Megatron checkpoint directory")
    directory = iteration_dir(root, named)
    if not is_complete(directory):
        raise FileNotFoundError(f"{directory}: not a complete torch_dist checkpoint "
                                "(metadata.json and .metadata expected)")
    return directory
