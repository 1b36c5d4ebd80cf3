"""The job spec: what every job has (cluster, network, storage, limits) plus one section per workload.

Each job kind subclasses `JobSpec` with `kind: Literal["..."]` and registers itself with `@job_kind`,
so a YAML file's `kind:` picks its model and `extra="forbid"` applies to every section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from a4ray.core.errors import SpecError
from a4ray.core.redact import MASK, is_secret_name
from a4ray.spec.cluster import ClusterSpec, NetworkSpec, StorageSpec
from a4ray.spec.fields import Seconds, Spec, escapes_workspace, write_path_problem
from a4ray.spec.kuberay import KubeRaySpec
from a4ray.spec.overrides import apply_overrides, dotted, dump_yaml, parse_sets
from a4ray.spec.resilience import DoctorSpec, ObserveSpec, RestartSpec

JOB_KINDS: dict[str, type[JobSpec]] = {}


def job_kind(cls: type[JobSpec]) -> type[JobSpec]:
    """Register a JobSpec subclass under the default of its `kind` field."""
    kind = cls.model_fields["kind"].default
    if not isinstance(kind, str) or kind in JOB_KINDS:
        raise TypeError(f"{cls.__name__} needs a unique default for `kind` (got {kind!r})")
    JOB_KINDS[kind] = cls
    return cls


class JobSpec(Spec):
    kind: str = Field(description="which job this is; picks the model the rest of the spec is read as")
    name: str = Field(
        "", pattern=r"^([a-z]([-a-z0-9]{0,38}[a-z0-9])?)?$",
        description="job name (DNS label, <= 40 chars); defaults to the kind",
    )
    cluster: ClusterSpec = ClusterSpec()
    network: NetworkSpec = NetworkSpec()
    storage: StorageSpec = StorageSpec()
    timeout_s: Seconds | None = Field(None, description="wall-clock limit of a launch (each restart gets its own)")
    observe: ObserveSpec = ObserveSpec()
    restart: RestartSpec = RestartSpec()
    doctor: DoctorSpec = DoctorSpec()
    kuberay: KubeRaySpec = Field(KubeRaySpec(), description="how `a4ray render` / `a4ray up` run it on GKE")

    # Where the spec came from, for error messages ("jobs/x.yaml", "<python>").
    _source: str = PrivateAttr("<python>")
    entry_module: ClassVar[str] = ""
    # True where the kind's defaults are an A4 run: with no cluster to join, its command rehearses the
    # kind's local profile instead (a4ray.pipeline.rehearsal).
    rehearses_locally: ClassVar[bool] = False

    @model_validator(mode="after")
    def _default_name(self) -> Self:
        if not self.name:
            self.name = self.kind.replace("_", "-")
        return self

    @model_validator(mode="after")
    def _spares_stand_by_for_a_restart(self) -> Self:
        spares = self.cluster.spare_nodes
        if spares and not self.restart.max_restarts:
            raise PydanticCustomError(
                "spares_without_restarts", "{problem}", {"path": ("cluster", "spare_nodes"), "problem": (
                    f"{spares} spare node(s) would stand by for a restart that restart.max_restarts=0 never makes: "
                    "set restart.max_restarts >= 1, or cluster.spare_nodes to 0")})
        return self

    @model_validator(mode="after")
    def _writes_inside_the_workspace(self) -> Self:
        for loc, path in self.write_paths():
            problem = write_path_problem(path, self.storage.workspace, self.storage.local_workspace)
            if problem:  # `path` extends the error's location to the field (overrides.validate reads it)
                raise PydanticCustomError("outside_workspace", "{problem}", {"path": loc, "problem": problem})
        return self

    def write_paths(self) -> list[tuple[tuple[str | int, ...], str]]:
        """(field, path) of every path this job writes by name, relative to the workspace unless absolute. Each
        must stay inside the workspace: checked from the spec here, symlinks followed where the workspace is
        known (the driver). Run directories are always `<workspace>/runs/<id>`. Kinds that write more add theirs."""
        return [(("storage", "compile_cache"), self.storage.compile_cache)] if self.storage.compile_cache else []

    def check_writes(self, workspace: Path, extra: list[tuple[str, str | Path]] = ()) -> None:
        """Refuse, before anything runs, a write path (and `extra` ones: (what, path)) that resolves outside
        `workspace`, the nodes' workspace root, once symlinks are followed."""
        named = [(dotted(loc), path) for loc, path in self.write_paths()] + list(extra)
        problems = [f"{what}: {str(path)!r} resolves to {real}, outside the workspace {workspace} (a symlink leads out)"
                    for what, path in named if (real := escapes_workspace(workspace, path)) is not None]
        if problems:
            raise SpecError(self.source, problems, hint="point the symlink into the workspace, or name a path that "
                            "stays in it")

    @property
    def source(self) -> str:
        return self._source

    def set(self, path: str, value: Any) -> Self:
        """A copy with one field changed (`spec.set("cluster.nodes", 4)`), validated like `--set`."""
        shown = MASK if is_secret_name(path.rsplit(".", 1)[-1]) else repr(value)  # never echo a secret
        return apply_overrides(self, [(path, value, f"set({path!r}, {shown})")])

    def with_sets(self, sets: list[str]) -> Self:
        """A copy with Helm-style `a.b.c=value` overrides applied."""
        return apply_overrides(self, parse_sets(sets))

    def to_yaml(self) -> str:
        return dump_yaml(self.model_dump(mode="json"))


@job_kind
class ClusterJob(JobSpec):
    """A cluster and no workload (`jobs/cluster-a4.yaml`): what `a4ray render cluster` / `a4ray up` create."""

    kind: Literal["cluster"] = "cluster"
