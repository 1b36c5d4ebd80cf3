"""Checkpoints of the built-in trainer, in Megatron's layout so the same tools read them:

    <save>/latest_checkpointed_iteration.txt     the newest complete iteration (written last, atomically)
    <save>/iter_0000020/model/                   a Hugging Face checkpoint (config, safetensors, tokenizer)
    <save>/iter_0000020/trainer.pt               optimizer, LR schedule, iteration, RNG states
    <save>/run_config.json                       what was trained (a resume must ask for the same)

An iteration directory is written under a temporary name and renamed into place before the tracker
names it, so a crash mid-save leaves the previous checkpoint as the latest. (torch is imported where used:
the driver reads the tracker without it.)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from a4ray.mcore.names import TRACKER

RUN_CONFIG = "run_config.json"
TOKENIZER_GLOBS = ("tokenizer*", "vocab.json", "merges.txt", "special_tokens_map.json", "chat_template*")


def iteration_dir(save: Path, iteration: int) -> Path:
    return save / f"iter_{iteration:07d}"


def latest(save: Path) -> int | None:
    try:
        return int((save / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return None


def check_config(save: Path, config: dict) -> list[str]:
    """Differences between what `save` was trained with and `config` (empty: resumable)."""
    try:
        before = json.loads((save / RUN_CONFIG).read_text())
    except (OSError, ValueError):
        return []
    return [f"{k}: {before.get(k)!r} there, {config.get(k)!r} now" for k in sorted(set(before) | set(config))
            if before.get(k) != config.get(k)]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save(save_dir: Path, iteration: int, model, optimizer, scheduler, config: dict, tokenizer_dir: Path,
         keep: int) -> Path:
    """Write iteration `iteration` (call on one rank; the model is the unwrapped module)."""
    import torch

    save_dir.mkdir(parents=True, exist_ok=True)
    final = iteration_dir(save_dir, iteration)
    tmp = save_dir / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp / "model")
    for pattern in TOKENIZER_GLOBS:
        for f in tokenizer_dir.glob(pattern):
            if f.is_file():
                shutil.copy2(f, tmp / "model" / f.name)
    state = {"iteration": iteration, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": {"torch": torch.get_rng_state(),
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}
    torch.save(state, tmp / "trainer.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write(save_dir / RUN_CONFIG, json.dumps(config, indent=1, sort_keys=True))
    _atomic_write(save_dir / TRACKER, str(iteration))
    for old in sorted(save_dir.glob("iter_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(save_dir: Path, iteration: int) -> dict:
    import torch

    return torch.load(iteration_dir(save_dir, iteration) / "trainer.pt", map_location="cpu", weights_only=False)
