"""The torchrun command line every torchrun-launched workload shares (one launcher per node)."""

from __future__ import annotations

from a4ray.runtime.gang import NodeContext


def torchrun(node: NodeContext, target: list[str], *, nproc: int | None = None) -> list[str]:
    """`python -m torch.distributed.run <rendezvous of this gang> <target...>`.

    `--tee 3` prefixes each worker line with its local rank (the node actor splits per-rank logs by it);
    `--max-restarts 0` because restarts are a gang-level decision, not one node's.
    """
    return [
        node.python, "-m", "torch.distributed.run",
        f"--nnodes={node.nnodes}", f"--node-rank={node.rank}",
        f"--nproc-per-node={nproc or node.gpus}",
        f"--master-addr={node.master_addr}", f"--master-port={node.master_port}",
        "--max-restarts=0", "--tee=3", f"--log-dir={node.log_dir}/.torchrun/node-{node.rank:02d}",
        *target,
    ]
