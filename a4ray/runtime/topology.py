"""Node facts and the rank order of a gang.

Rank order follows the physical topology (block, subblock, host labels, as GKE and the pod launcher
set them), so neighbours in rank are neighbours in the fabric and node 0 (the rendezvous master) is the
same node for torchrun, MPI hostfiles and DeepEP. Nodes without labels sort after labelled ones, by IP.
"""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel

from a4ray.spec.cluster import TopologySpec


class NodeFacts(BaseModel):
    """What a node actor reports about the node it runs on."""

    node_id: str
    ip: str
    hostname: str
    labels: dict[str, str] = {}
    gpu_ids: list[str] = []
    python: str = "python3"

    def location(self, topology: TopologySpec) -> tuple[str, str, str]:
        return tuple(self.labels.get(k, "") for k in topology.label_keys)  # type: ignore[return-value]

    def short_name(self, topology: TopologySpec) -> str:
        """The host label where the node has one (unique per machine), else its hostname."""
        return self.labels.get(topology.host_label) or self.hostname

    def describe(self, topology: TopologySpec) -> str:
        where = "/".join(p for p in self.location(topology) if p)
        return f"{self.hostname} ({self.ip}{', ' + where if where else ''})"


def _ip_key(ip: str) -> tuple:
    try:
        addr = ipaddress.ip_address(ip)
        return (addr.version, int(addr))
    except ValueError:
        return (9, ip)


def rank_order(nodes: list[NodeFacts], topology: TopologySpec) -> list[NodeFacts]:
    """Nodes sorted into rank order. Stable and total: ties break on IP, then node id."""

    def key(node: NodeFacts) -> tuple:
        if topology.order == "ip":
            return (_ip_key(node.ip), node.node_id)
        location = node.location(topology)
        unlabelled = not any(location)
        return (unlabelled, location, _ip_key(node.ip), node.node_id)

    return sorted(nodes, key=key)
