"""Rank order from physical topology labels, with IP as the fallback."""

from __future__ import annotations

from a4ray.runtime.topology import NodeFacts, rank_order
from a4ray.spec.cluster import GKE_BLOCK_LABEL as B
from a4ray.spec.cluster import GKE_HOST_LABEL as H
from a4ray.spec.cluster import GKE_SUBBLOCK_LABEL as S
from a4ray.spec.cluster import TopologySpec


def node(ip: str, block: str = "", sub: str = "", host: str = "", node_id: str | None = None) -> NodeFacts:
    labels = {k: v for k, v in ((B, block), (S, sub), (H, host)) if v}
    return NodeFacts(node_id=node_id or ip, ip=ip, hostname=f"h-{ip}", labels=labels)


def ips(nodes: list[NodeFacts]) -> list[str]:
    return [n.ip for n in nodes]


def test_physical_order_is_block_subblock_host_not_ip():
    nodes = [
        node("10.0.0.1", "b2", "s1", "h9"),
        node("10.0.0.2", "b1", "s2", "h1"),
        node("10.0.0.3", "b1", "s1", "h7"),
        node("10.0.0.4", "b1", "s1", "h3"),
    ]
    assert ips(rank_order(nodes, TopologySpec())) == ["10.0.0.4", "10.0.0.3", "10.0.0.2", "10.0.0.1"]


def test_unlabelled_nodes_follow_in_numeric_ip_order():
    nodes = [node("10.0.0.10"), node("10.0.0.9"), node("10.0.1.1", "b1", "s1", "h1"), node("10.0.0.100")]
    assert ips(rank_order(nodes, TopologySpec())) == ["10.0.1.1", "10.0.0.9", "10.0.0.10", "10.0.0.100"]


def test_ip_order_ignores_labels_and_ties_break_on_node_id():
    nodes = [node("10.0.0.2", "a", "a", "a"), node("10.0.0.1", "z", "z", "z"),
             node("10.0.0.1", "b", "b", "b", node_id="aaa")]
    ordered = rank_order(nodes, TopologySpec(order="ip"))
    assert [(n.ip, n.node_id) for n in ordered] == [
        ("10.0.0.1", "10.0.0.1"), ("10.0.0.1", "aaa"), ("10.0.0.2", "10.0.0.2")]


def test_custom_label_keys():
    topo = TopologySpec(block_label="rack", subblock_label="row", host_label="slot")
    nodes = [NodeFacts(node_id="x", ip="1.1.1.1", hostname="x", labels={"rack": "2"}),
             NodeFacts(node_id="y", ip="1.1.1.2", hostname="y", labels={"rack": "1"})]
    assert [n.node_id for n in rank_order(nodes, topo)] == ["y", "x"]
