"""The command line that starts a node's ranks of every torchrun workload (one launcher per node)."""

from __future__ import annotations

from a4ray.runtime.launch import NodeContext


def torchrun(node: NodeContext, target: list[str], *, nproc: int | None = None) -> list[str]:
    """Start `target` (a script or `-m module`, with its args) as `nproc` ranks on this node, with
    torchrun's env contract and the gang's rendezvous, by `cluster.launcher`:

    - `a4ray`: a4ray.runtime.ranks, the gang's own rank launcher (no elastic agent: no torch import,
      no second rendezvous per node);
    - `torchrun`: `python -m torch.distributed.run`, `--tee 3` so lines carry the same local-rank
      prefixes, `--max-restarts 0` because restarts are a gang-level decision, not one node's.
    """
    nproc = nproc or node.gpus
    if node.launcher == "torchrun":
        return [
            node.python, "-m", "torch.distributed.run",
            f"--nnodes={node.nnodes}", f"--node-rank={node.rank}", f"--nproc-per-node={nproc}",
            f"--master-addr={node.master_addr}", f"--master-port={node.master_port}",
            "--max-restarts=0", "--tee=3", f"--log-dir={node.log_dir}/.torchrun/node-{node.rank:02d}",
            *target,
        ]
    return [
        node.python, "-m", "a4ray.runtime.ranks",
        f"--nnodes={node.nnodes}", f"--node-rank={node.rank}", f"--nproc={nproc}",
        f"--master-addr={node.master_addr}", f"--master-port={node.master_port}",
        f"--run-id={node.launch_id or 'none'}", f"--restart-count={node.attempt}", f"--grace-s={node.grace_s:g}",
        "--", *target,
    ]
