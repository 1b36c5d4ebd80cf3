"""Validate RayCluster / RayJob manifests as the Kubernetes API server and the KubeRay operator would.

Three layers, each refusing what the real thing would refuse:
  1. the CRD's OpenAPI schema (KubeRay v1.7.0, bundled; or the CRD installed on the cluster), in strict
     mode: unknown fields are errors (the API server would silently prune them), with the API server's
     defaulting of required-but-defaulted fields, null pruning and int32/int64 bounds;
  2. the operator's checks (`ray-operator/controllers/ray/utils/validation.go`) that reject a spec after
     the API server accepted it (name lengths, replicas, rayStartParams conflicts, suspend rules, ...);
  3. Kueue's limits for the RayJobs and RayClusters it manages.
Every problem names the manifest path, e.g. `spec.workerGroupSpecs[0].replicas: 'two' is not of type 'integer'`.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
from importlib import resources
from typing import Any

import yaml
from jsonschema import Draft4Validator, FormatChecker

from a4ray.core.errors import ManifestInvalid

GROUP, VERSION = "ray.io", "v1"
PLURALS = {"RayCluster": "rayclusters", "RayJob": "rayjobs"}
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_MAX_WORKER_GROUPS = 7  # a Kueue Workload has at most 8 PodSets: the head and 7 worker groups

# validation.go / constant.go at v1.7.0
MAX_RAYCLUSTER_NAME = 53
MAX_RAYJOB_NAME = MAX_RAYCLUSTER_NAME - 6
SUBMISSION_MODES = ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
MIN_RAY_FOR_TOKEN_AUTH = (2, 52, 0)
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


# ------------------------------------------------------------------------------------- CRD schemas


def bundled_schema(kind: str) -> dict:
    """The v1 openAPIV3Schema of KubeRay v1.7.0's CRD for `kind` (see crds/README.md for provenance)."""
    data = resources.files("a4ray.k8s").joinpath("crds", f"{PLURALS[kind]}.v1.json.gz").read_bytes()
    return json.loads(gzip.decompress(data))


def schema_from_crd(crd: dict, version: str = VERSION) -> dict:
    """The openAPIV3Schema of `version` in a CustomResourceDefinition (a file's or the installed one)."""
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise ValueError(f"CRD {crd.get('metadata', {}).get('name')} has no version {version}")


def _to_jsonschema(node: Any, strict: bool) -> Any:
    """An API-server-faithful JSON schema from a structural OpenAPI v3 schema (see SOURCE.md)."""
    if isinstance(node, list):
        return [_to_jsonschema(n, strict) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":  # keys here are field names, not schema keywords
            out[key] = {name: _to_jsonschema(sub, strict) for name, sub in value.items()}
        elif not (key.startswith("x-kubernetes-") or key == "nullable"):
            out[key] = _to_jsonschema(value, strict)
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node and "type" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    # The API server fills defaults before validating, so a defaulted field is never missing.
    if "required" in out and "properties" in out:
        required = [r for r in out["required"] if "default" not in out["properties"].get(r, {})]
        if required:
            out["required"] = required
        else:
            del out["required"]
    if out.get("type") == "integer" and out.get("format") in ("int32", "int64"):
        bits = 31 if out["format"] == "int32" else 63
        out.setdefault("minimum", -(2**bits))
        out.setdefault("maximum", 2**bits - 1)
    if strict and "properties" in out and "additionalProperties" not in out \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=8)
def _validator(kind: str, schema_json: str | None) -> Draft4Validator:
    schema = bundled_schema(kind) if schema_json is None else json.loads(schema_json)
    return Draft4Validator(_to_jsonschema(schema, strict=True), format_checker=FormatChecker())


def _schema_key(schema: dict | None) -> str | None:
    return None if schema is None else json.dumps(schema, sort_keys=True)


def drop_nulls(obj: Any) -> Any:
    """What the API server does with `null` values of non-nullable fields: prunes them."""
    if isinstance(obj, dict):
        return {k: drop_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [drop_nulls(v) for v in obj]
    return obj


def _path(parts) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def schema_problems(obj: dict, schema: dict | None = None) -> list[str]:
    """Strict CRD-schema problems of a RayCluster/RayJob (`schema`: an installed CRD's; default: bundled)."""
    kind = obj.get("kind")
    if kind not in PLURALS:
        return [f"kind: expected one of {', '.join(PLURALS)}, got {kind!r}"]
    if obj.get("apiVersion") != f"{GROUP}/{VERSION}":
        return [f"apiVersion: expected {GROUP}/{VERSION}, got {obj.get('apiVersion')!r}"]
    validator = _validator(kind, _schema_key(schema))
    problems = []
    for error in sorted(validator.iter_errors(drop_nulls(obj)), key=lambda e: list(map(str, e.absolute_path))):
        message = error.message
        if error.validator == "additionalProperties":
            message = message.replace("Additional properties are not allowed", "unknown field(s)")
        problems.append(f"{_path(error.absolute_path)}: {message}")
    return problems


# ----------------------------------------------------------------------------- operator checks


def _version_tuple(text: str) -> tuple[int, ...] | None:
    match = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(g or 0) for g in match.groups()) if match else None


def _name_problems(kind: str, name: str, limit: int) -> list[str]:
    problems = []
    if len(name) > limit:
        problems.append(f"metadata.name: {kind} name {name!r} is {len(name)} characters; KubeRay allows at most "
                        f"{limit}")
    if not _DNS1035.match(name):
        problems.append(f"metadata.name: {name!r} is not a DNS-1035 label (lowercase letters, digits, '-'; "
                        "starts with a letter)")
    return problems


def _label_problems(where: str, labels: dict[str, str]) -> list[str]:
    problems = []
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if not name or len(name) > 63 or not _LABEL_NAME.match(name) or (prefix and (
                len(prefix) > 253 or not _LABEL_PREFIX.match(prefix))):
            problems.append(f"{where}: invalid label key {key!r}")
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            problems.append(f"{where}: invalid value {value!r} for label {key!r}")
    return problems


def _group_problems(where: str, group: dict) -> list[str]:
    problems = []
    params = group.get("rayStartParams") or {}
    containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or []
    if not containers:
        problems.append(f"{where}.template.spec.containers: at least one container is required (the Ray "
                        "container is the first)")
    if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and group.get("resources"):
        problems.append(f"{where}: resources are set in both rayStartParams and the group's `resources`; use one")
    if "labels" in params:
        problems.append(f"{where}.rayStartParams.labels: not supported; use the group's `labels` field")
    problems += _label_problems(f"{where}.labels", group.get("labels") or {})
    return problems


def cluster_spec_problems(spec: dict, where: str = "spec") -> list[str]:
    """validation.go ValidateRayClusterSpec, for what a4ray can produce."""
    problems = _group_problems(f"{where}.headGroupSpec", spec.get("headGroupSpec") or {})
    autoscaling = bool(spec.get("enableInTreeAutoscaling"))
    for i, group in enumerate(spec.get("workerGroupSpecs") or []):
        at = f"{where}.workerGroupSpecs[{i}]"
        problems += _group_problems(at, group)
        low, high = group.get("minReplicas"), group.get("maxReplicas")
        if not autoscaling and (low is None or high is None):
            problems.append(f"{at}: minReplicas and maxReplicas must both be set when autoscaling is off")
        for field, value in (("minReplicas", low), ("maxReplicas", high)):
            if value is not None and value < 0:
                problems.append(f"{at}.{field}: {value} is negative")
        if low is not None and high is not None and low > high:
            problems.append(f"{at}: minReplicas {low} is greater than maxReplicas {high}")
        replicas = group.get("replicas")
        if replicas is not None and low is not None and high is not None and not low <= replicas <= high:
            problems.append(f"{at}.replicas: {replicas} is outside [minReplicas, maxReplicas] = [{low}, {high}]")
    auth = spec.get("authOptions") or {}
    if auth.get("mode") == "token":
        version = _version_tuple(spec.get("rayVersion", ""))
        if version is None:
            problems.append(f"{where}.rayVersion: required (>= 2.52.0) when authOptions.mode is token")
        elif version < MIN_RAY_FOR_TOKEN_AUTH:
            problems.append(f"{where}.rayVersion: token authentication needs Ray >= 2.52.0, got {spec['rayVersion']}")
    return problems


def rayjob_spec_problems(spec: dict) -> list[str]:
    """validation.go ValidateRayJobSpec."""
    problems = []
    selector = spec.get("clusterSelector") or {}
    shutdown = bool(spec.get("shutdownAfterJobFinishes"))
    if spec.get("suspend") and not shutdown:
        problems.append("spec.suspend: a RayJob can be suspended only with shutdownAfterJobFinishes: true")
    if (spec.get("ttlSecondsAfterFinished") or 0) > 0 and not shutdown:
        problems.append("spec.ttlSecondsAfterFinished: needs shutdownAfterJobFinishes: true")
    if bool(selector) == bool(spec.get("rayClusterSpec")):
        problems.append("spec: exactly one of rayClusterSpec and clusterSelector must be set")
    mode = spec.get("submissionMode", "K8sJobMode")
    if mode not in SUBMISSION_MODES:
        problems.append(f"spec.submissionMode: {mode!r} is not one of {', '.join(SUBMISSION_MODES)}")
    if selector:
        if not selector.get("ray.io/cluster"):
            problems.append("spec.clusterSelector: needs a non-empty `ray.io/cluster`")
        if spec.get("suspend"):
            problems.append("spec.suspend: not supported with clusterSelector")
        if mode == "SidecarMode":
            problems.append("spec.submissionMode: SidecarMode is not supported with clusterSelector")
        if (spec.get("backoffLimit") or 0) > 0:
            problems.append("spec.backoffLimit: not supported with clusterSelector")
    if mode == "SidecarMode":
        if spec.get("submitterPodTemplate") or spec.get("submitterConfig"):
            problems.append("spec.submitterPodTemplate: SidecarMode takes no submitterPodTemplate/submitterConfig")
        head_policy = (((spec.get("rayClusterSpec") or {}).get("headGroupSpec") or {}).get("template") or {}) \
            .get("spec", {}).get("restartPolicy")
        if head_policy not in (None, "", "Never"):
            problems.append("spec.rayClusterSpec.headGroupSpec.template.spec.restartPolicy: must be Never or unset "
                            "in SidecarMode")
    for field in ("activeDeadlineSeconds", "preRunningDeadlineSeconds"):
        if spec.get(field) is not None and spec[field] <= 0:
            problems.append(f"spec.{field}: must be a positive integer")
    if "runtimeEnvYAML" in spec:
        try:
            yaml.safe_load(spec["runtimeEnvYAML"])
        except yaml.YAMLError as e:
            problems.append(f"spec.runtimeEnvYAML: not valid YAML ({e})")
    if spec.get("rayClusterSpec"):
        problems += cluster_spec_problems(spec["rayClusterSpec"], "spec.rayClusterSpec")
    return problems


def kueue_problems(obj: dict) -> list[str]:
    """Kueue's limits for RayJobs / RayClusters that carry its queue label."""
    if not (obj.get("metadata", {}).get("labels") or {}).get(KUEUE_QUEUE_LABEL):
        return []
    spec = obj.get("spec") or {}
    problems = []
    cluster = spec.get("rayClusterSpec") if obj["kind"] == "RayJob" else spec
    if obj["kind"] == "RayJob":
        if spec.get("clusterSelector"):
            problems.append("spec.clusterSelector: Kueue cannot manage a RayJob on an existing cluster")
        if not spec.get("shutdownAfterJobFinishes"):
            problems.append("spec.shutdownAfterJobFinishes: must be true for Kueue")
        if not spec.get("suspend"):
            problems.append("spec.suspend: must be true so Kueue admits the whole gang")
    if cluster:
        if cluster.get("enableInTreeAutoscaling"):
            problems.append("enableInTreeAutoscaling: must be false for Kueue")
        if len(cluster.get("workerGroupSpecs") or []) > KUEUE_MAX_WORKER_GROUPS:
            problems.append(f"workerGroupSpecs: Kueue allows at most {KUEUE_MAX_WORKER_GROUPS} worker groups")
    return problems


def manifest_problems(obj: dict, schema: dict | None = None) -> list[str]:
    """Every reason the API server, the KubeRay operator or Kueue would refuse `obj`."""
    problems = schema_problems(obj, schema)
    if problems:  # the API server refuses it before the operator or Kueue ever see it
        return problems
    name = (obj.get("metadata") or {}).get("name", "")
    spec = obj.get("spec") or {}
    if obj["kind"] == "RayCluster":
        problems += _name_problems("RayCluster", name, MAX_RAYCLUSTER_NAME) + cluster_spec_problems(spec)
    else:
        problems += _name_problems("RayJob", name, MAX_RAYJOB_NAME) + rayjob_spec_problems(spec)
    problems += _label_problems("metadata.labels", (obj.get("metadata") or {}).get("labels") or {})
    return problems + kueue_problems(obj)


def check_manifest(obj: dict, schema: dict | None = None, *, source: str = "") -> None:
    """Raise ManifestInvalid naming every problem of `obj`; Kubernetes core objects are passed through."""
    if obj.get("apiVersion") != f"{GROUP}/{VERSION}":
        return
    problems = manifest_problems(obj, schema)
    if problems:
        name = (obj.get("metadata") or {}).get("name", "?")
        raise ManifestInvalid(f"{obj.get('kind')} {name}{' (' + source + ')' if source else ''} would be "
                              f"refused:\n" + "\n".join(f"  - {p}" for p in problems))

