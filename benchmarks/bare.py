"""The baseline side of the gang benchmarks: the same program without Ray.

`torchrun_as_nodes` starts N plain torchrun processes on 127.0.0.1 as N nodes, node i seeing the GPUs that
simulated node i sees, so NCCL picks the same transports as the gang does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def env(**extra: str) -> dict[str, str]:
    """This environment with the checkout importable and no Ray address to pick up."""
    out = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), out.get("PYTHONPATH", "")) if p)
    return {**out, **extra}


def torchrun_as_nodes(nodes: int, gpus_per_node: int, gpus: list[str], port: int, program: list[str],
                      cwd: Path | str) -> list[str]:
    """Run `torchrun ... <program>` as `nodes` nodes; each node's combined stdout and stderr, in node order."""
    procs = []
    for node in range(nodes):
        node_env = env()
        if gpus:
            node_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[node * gpus_per_node:(node + 1) * gpus_per_node])
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={node}",
               f"--nproc-per-node={gpus_per_node}", "--master-addr=127.0.0.1", f"--master-port={port}", *program]
        procs.append(subprocess.Popen(cmd, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, cwd=cwd))
    return [p.communicate()[0] for p in procs]
