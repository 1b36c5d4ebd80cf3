"""The generic command workload: `command.argv` on every node, with the launch contract in its env.

Every node gets NNODES, NODE_RANK, GPUS_PER_NODE, MASTER_ADDR and MASTER_PORT (the gang's rendezvous),
so a plain script can start its own per-node launcher; with `torchrun: true` a4ray starts torchrun.
"""

from __future__ import annotations

from a4ray.core.results import register_result
from a4ray.runtime.launch import GangResult, Launch, NodeContext
from a4ray.spec.command import CommandJob
from a4ray.workloads.torchrun import torchrun
from a4ray.workloads.workload import Workload, WorkloadResult


def contract_env(node: NodeContext) -> dict[str, str]:
    return {"NNODES": str(node.nnodes), "NODE_RANK": str(node.rank), "GPUS_PER_NODE": str(node.gpus),
            "MASTER_ADDR": str(node.master_addr), "MASTER_PORT": str(node.master_port)}


class Command(Workload[CommandJob]):
    kind = "command"

    def launch(self, node: NodeContext) -> Launch:
        c = self.spec.command
        env = {**contract_env(node), **c.env}
        if c.torchrun:
            nproc = c.nproc or node.gpus
            return Launch(argv=torchrun(node, c.argv, nproc=nproc), env=env, nproc=nproc)
        return Launch(argv=list(c.argv), env=env)

    def result(self, gang: GangResult) -> WorkloadResult:
        codes = ", ".join(f"node {n.rank}: {n.exit_code}" for n in gang.nodes)
        verdict = (f"PASS: {len(gang.nodes)} node(s) exited 0" if gang.ok
                   else f"FAIL: {gang.brief} ({codes})")
        return WorkloadResult(kind=self.kind, ok=gang.ok, verdict=verdict, gang=gang)


register_result(WorkloadResult, Command.kind)  # a command's result is the gang's, node by node
