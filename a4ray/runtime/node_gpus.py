"""The node's GPUs: in the node's own order, and free again after a stop (a4ray's node actor is their user)."""

from __future__ import annotations

import shutil
import subprocess
import time


GPU_FREE_MB = 512  # below this a GPU counts as free again (NVRx's bound)
GPU_FREE_WAIT_S = 50.0  # how long a stopped node waits for its GPUs' memory (NVRx waits as long)


def node_gpus() -> list[str]:
    """This node's GPUs as nvidia-smi numbers them (Ray's ids are the machine's indices)."""
    import ray

    return gpu_order(ray.get_gpu_ids())


def gpu_memory_freed(gpus: list[str], below_mb: int = GPU_FREE_MB, bound_s: float = GPU_FREE_WAIT_S) -> str | None:
    """Wait until every GPU of `gpus` holds less than `below_mb` MiB, up to `bound_s`: a stopped rank's memory is
    freed by the driver after its process is gone, and a relaunch that starts sooner can run out of memory. Says
    what it found; None where there is nothing to wait for (no GPU, or no nvidia-smi: a CPU machine)."""
    smi = shutil.which("nvidia-smi")
    if not gpus or smi is None:
        return None
    start = time.monotonic()
    used: dict[str, int] = {}
    while True:
        try:
            out = subprocess.run([smi, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                  f"--id={','.join(gpus)}"], capture_output=True, text=True, timeout=10).stdout
            used = {i.strip(): int(float(mb)) for i, mb in (row.split(",") for row in out.splitlines() if "," in row)}
        except (OSError, ValueError, subprocess.TimeoutExpired) as e:
            return f"GPU memory not checked after the stop: nvidia-smi failed ({type(e).__name__})"
        waited = time.monotonic() - start
        if used and all(mb < below_mb for mb in used.values()):
            return f"GPUs {','.join(gpus)} free after the stop ({waited:.1f}s; MiB used: {used})"
        if waited >= bound_s:
            return f"GPUs {','.join(gpus)} still hold memory {bound_s:g}s after the stop (MiB used: {used})"
        time.sleep(0.2)


def gpu_order(ids) -> list[str]:
    """GPU ids in the node's ascending order. Ray hands an actor its GPUs in a set's order (`ray.get_gpu_ids()`
    collects them in a set; where the raylet has CUDA_VISIBLE_DEVICES, a set of strings in hash order), and sets
    the actor's CUDA_VISIBLE_DEVICES the same way: `gpus=1,0` was seen. Indexes sort as numbers, UUIDs after."""
    return sorted((str(g) for g in ids), key=lambda g: (not g.isdigit(), int(g) if g.isdigit() else 0, g))
