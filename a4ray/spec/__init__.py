"""Pydantic specs: the one source of truth for every job. Importing this registers every job kind."""

from a4ray.spec.cluster import ClusterSpec, NetworkSpec, StorageSpec, TopologySpec
from a4ray.spec.convert import ConvertJob, ConvertSpec
from a4ray.spec.ddp import DDPTestJob, DDPTestSpec
from a4ray.spec.job import JOB_KINDS, JobSpec, job_kind
from a4ray.spec.loader import load_job, parse_sets

__all__ = [
    "JOB_KINDS", "ClusterSpec", "ConvertJob", "ConvertSpec", "DDPTestJob", "DDPTestSpec", "JobSpec", "NetworkSpec",
    "StorageSpec", "TopologySpec", "job_kind", "load_job", "parse_sets",
]
