"""The embedded cluster a benchmark runs on: simulated nodes on this machine, this process connected to it."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import ray

from a4ray.runtime.connect import NAMESPACE
from a4ray.runtime.simulated import SimulatedCluster


@contextmanager
def embedded_cluster(nodes: int, gpus_per_node: int, **options) -> Iterator[SimulatedCluster]:
    """`nodes` simulated nodes of `gpus_per_node` GPUs each (`options`: SimulatedCluster's), joined in a4ray's
    namespace, shut down on the way out."""
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="r", dir="/tmp"))  # short: Ray's socket paths
    os.environ.pop("RAY_ADDRESS", None)
    cluster = SimulatedCluster(nodes, gpus_per_node, **options)
    cluster.start()
    ray.init(address=cluster.address, namespace=NAMESPACE)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
