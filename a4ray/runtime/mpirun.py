"""MPI launches through the gang: the hostfile, the mpirun command line, and the per-node launches.

Node 0 runs mpirun; every other node is a standby with the same env, whose node actor starts
OpenMPI's daemon (orted) when mpirun asks through `a4ray.runtime.rsh` instead of ssh. From then on
OpenMPI's daemons talk to each other directly. The hostfile lists the gang's nodes in rank (topology)
order with `slots` processes each and mpirun maps by slot, so MPI rank r runs on node r // slots and
node 0 of the hostfile is the gang's master: the same order torchrun and DeepEP see.

Each rank inherits its node's launch env (gIB sourced on that node) through its orted; `-x` forwards
the job-level variables from node 0 as well, as the seeds did.
"""

from __future__ import annotations

import json

from a4ray.runtime.launch import Launch, NodeContext, Peer
from a4ray.runtime.rsh import GANG_VAR
from a4ray.spec.mpi import MpiSpec


def hostfile(peers: list[Peer], slots: int) -> str:
    """OpenMPI hostfile in rank order, by IP (what the node actors are found by)."""
    return "".join(f"{p.ip} slots={slots}\n" for p in peers)


def rsh_gang(node: NodeContext) -> str:
    """What the rsh agent needs to reach the gang's node actors: JSON for A4RAY_RSH_GANG."""
    hosts = {p.ip: p.actor for p in node.peers}
    names = [p.hostname for p in node.peers]
    # Hostnames too, where they name one node (a hand-written hostfile may use them).
    hosts.update({p.hostname: p.actor for p in node.peers if names.count(p.hostname) == 1})
    return json.dumps({"address": node.ray_address, "namespace": node.namespace, "hosts": hosts})


def mpirun_argv(node: NodeContext, program: list[str], *, slots: int, hostfile_path: str,
                forward: list[str] = (), mpi: MpiSpec | None = None, tag_output: bool = False) -> list[str]:
    mpi = mpi or MpiSpec()
    argv = [
        mpi.mpirun, "--allow-run-as-root", "--hostfile", hostfile_path, "-np", str(slots * node.nnodes),
        "--map-by", "slot", "--bind-to", "none",
        # rsh: the daemons start through a4ray's agent, whatever launcher the image picks (a sandboxed GPU
        # machine sets OMPI_MCA_plm=isolated, under which mpirun starts no remote daemon at all and says
        # "All nodes which are allocated for this job are already filled").
        "--mca", "plm", "rsh", "--mca", "plm_rsh_agent", f"{node.python} -m a4ray.runtime.rsh",
        # mpirun starts every daemon itself (no tree spawn: nodes need not reach each other's agents),
        # and keeps each daemon attached to its agent, so a daemon lives exactly as long as its exec
        # on the node actor (a daemonized orted would escape the node's process-tree supervision).
        "--mca", "plm_rsh_no_tree_spawn", "1", "--leave-session-attached",
        "--mca", "orte_keep_fqdn_hostnames", "1",
    ]
    if tag_output:
        argv.append("--tag-output")
    for name in dict.fromkeys(forward):
        argv += ["-x", name]
    return argv + list(mpi.extra_args) + list(program)


def mpi_launch(node: NodeContext, program: list[str], *, slots: int, env: dict[str, str] | None = None,
               forward: list[str] = (), env_scripts: list[str] = (), mpi: MpiSpec | None = None,
               tag_output: bool = False, cwd: str | None = None) -> Launch:
    """Node `node`'s part of an MPI launch of `program` with `slots` ranks per node: mpirun on node 0,
    a standby elsewhere. `env` is every node's (and forwarded with -x, as are the names in `forward`)."""
    env = dict(env or {})
    if node.rank != 0:
        return Launch(argv=[], env=env, env_scripts=list(env_scripts), cwd=cwd)
    path = f"{node.log_dir}/mpi/hostfile-{node.launch_id}"
    argv = mpirun_argv(node, program, slots=slots, hostfile_path=path, forward=[*env, *forward], mpi=mpi,
                       tag_output=tag_output)
    return Launch(argv=argv, env={**env, GANG_VAR: rsh_gang(node)}, env_scripts=list(env_scripts),
                  files={path: hostfile(node.peers, slots)}, cwd=cwd)
