"""Pydantic specs: the one source of truth for every job. Importing this registers every job kind."""

from a4ray.spec.artifacts import ArtifactSpec, Staged, StageJob, StagingOptions
from a4ray.spec.cluster import ClusterSpec, NetworkSpec, StorageSpec, TopologySpec
from a4ray.spec.command import CommandJob, CommandSpec
from a4ray.spec.conversion import ConvertJob, ConvertSpec
from a4ray.spec.ddp import DDPTestJob, DDPTestSpec
from a4ray.spec.deepep import DeepEPJob, DeepEPSpec
from a4ray.spec.job import JOB_KINDS, ClusterJob, JobSpec, job_kind
from a4ray.spec.kuberay import KubeRaySpec
from a4ray.spec.loader import load_job
from a4ray.spec.mpi import MpiSpec
from a4ray.spec.nccl import NcclTestJob, NcclTestSpec
from a4ray.spec.overrides import parse_sets
from a4ray.spec.recipes import Qwen3Job, Qwen3NextJob, RecipeJob, SwiftDPOJob

__all__ = [
    "JOB_KINDS", "ArtifactSpec", "ClusterJob", "ClusterSpec", "CommandJob", "CommandSpec", "ConvertJob", "ConvertSpec",
    "DDPTestJob", "DDPTestSpec", "DeepEPJob", "DeepEPSpec", "JobSpec", "KubeRaySpec", "MpiSpec", "NcclTestJob",
    "NcclTestSpec", "NetworkSpec", "Qwen3Job", "Qwen3NextJob", "RecipeJob", "StageJob", "Staged", "StagingOptions",
    "StorageSpec", "SwiftDPOJob", "TopologySpec", "job_kind", "load_job", "parse_sets",
]
