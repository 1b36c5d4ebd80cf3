"""a4ray: Ray-based orchestration for training and testing LLMs on multi-node GKE A4 clusters.

    import a4ray

    cluster = a4ray.connect()                      # an embedded local cluster of simulated A4 nodes if no other
    result = a4ray.run(a4ray.load("jobs/ddp_test.yaml"))
    run = a4ray.submit(a4ray.load("jobs/nccl_test.yaml").set("cluster.nodes", 2))
    run.status(); run.logs(); run.result().plot(); run.cancel()
    a4ray.sweep(spec, {"network.env.NCCL_IB_QPS_PER_CONNECTION": [1, 2, 4]})

The names are imported on first use, so the processes a4ray launches on nodes (which import `a4ray.*`
modules, not Ray) stay light. See `a4ray.api`.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "connect": "a4ray.api", "current": "a4ray.api", "load": "a4ray.api", "plan": "a4ray.api", "run": "a4ray.api",
    "submit": "a4ray.api", "runs": "a4ray.api", "get_run": "a4ray.api", "Cluster": "a4ray.api",
    "nodes": "a4ray.api", "forget_node": "a4ray.api", "goodput": "a4ray.api", "project_ettr": "a4ray.api",
    "Run": "a4ray.driver.handle", "sweep": "a4ray.driver.sweep", "get_sweep": "a4ray.driver.sweep",
    "SweepResult": "a4ray.driver.sweep", "Result": "a4ray.core.results", "load_result": "a4ray.core.results",
    "A4RayError": "a4ray.core.errors", "SpecError": "a4ray.core.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'a4ray' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
