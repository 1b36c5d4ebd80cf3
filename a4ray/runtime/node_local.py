"""What a node holds of a run besides its processes: its local checkpoints (each rank's part, and the replicas it
holds of ranks on other nodes: a4ray.mcore.local_checkpoints), in node-local storage that goes with the node.

A node keeps them in its RAM disk (/dev/shm) unless the job says where (`storage.local_checkpoints`). A simulated
node has a directory of its own instead, named by `NODE_LOCAL_ENV` (runtime/simulated.py): simulated nodes share one
machine's /dev/shm, and a lost node must take its parts along, as a lost machine does.
"""

from __future__ import annotations

import os
from pathlib import Path

NODE_LOCAL_ENV = "A4RAY_NODE_LOCAL_DIR"
LOCAL_CHECKPOINTS = "a4ray-local-checkpoints"


def local_checkpoints_root(configured: str | None = None) -> Path:
    """Where this node keeps local checkpoints: `configured`, else its own storage (a simulated node's directory, a
    real node's /dev/shm)."""
    if configured:
        return Path(configured)
    return Path(os.environ.get(NODE_LOCAL_ENV) or "/dev/shm") / LOCAL_CHECKPOINTS
