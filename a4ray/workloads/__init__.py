"""Workloads: what a node of the gang runs. Importing this registers every workload by job kind."""

from a4ray.workloads import command, ddp_test, deepep, nccl_test  # noqa: F401
from a4ray.convert import workload as _convert  # noqa: F401  (the `convert` job kind)
from a4ray.workloads.base import WORKLOADS, Plan, Workload, WorkloadResult

__all__ = ["WORKLOADS", "Plan", "Workload", "WorkloadResult"]
