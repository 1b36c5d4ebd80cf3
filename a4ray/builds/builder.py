"""Build a tool on the gang's nodes from its staged source, once per cache key, as Ray tasks.

    probe every node (a Ray task each) -> refuse, naming each missing piece per node -> the image's where every
    node has it -> the cache key per node -> stage the source once (a code artifact) where a build is due
    -> build on every node (a Ray task each, under a lock: one builds, the others wait and find it built)

A build happens in `<workspace>/builds/<tool>/.tmp-<key12>-<random>/` and is renamed to `<key12>/` only
when its outputs are all there, with `a4ray-build.json` (the key's facts, where and when, the outputs) and
`build.log`. The node's build log, or a line saying which cached build was used, goes into the run's logs
(`logs/builds/<tool>-node-NN.log`). Nodes of one gang must agree on the key (the same toolchain): the MPI
launch runs one path on every node.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import ray
from pydantic import BaseModel
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from a4ray.builds.tools import RECIPES, Recipe
from a4ray.builds.toolchain import Toolchain, probe
from a4ray.core.console import say
from a4ray.core.errors import ToolMissing
from a4ray.runtime.connect import Connection
from a4ray.runtime.gang import Gang
from a4ray.spec.artifacts import ArtifactSpec, parse_source
from a4ray.spec.toolbuilds import PINNED, BuildSpec
from a4ray.staging.stager import stage

RECORD = "a4ray-build.json"
LOG = "build.log"
Status = Literal["image", "cached", "built", "joined"]


class BuildFailed(ToolMissing):
    """A tool could not be built on some node: names what is missing there, or the build's own last words."""

    def __reduce__(self):  # raised in a Ray task: the hint (where the whole log is) travels with it
        return type(self), (self.message,), {"hint": self.hint}


class BuildRecord(BaseModel):
    tool: str
    key: str
    facts: dict
    source: str
    built_on: str
    built_at: str
    seconds: float
    outputs: dict[str, int]  # relative path -> size


class BuildOutcome(BaseModel):
    tool: str
    node: int  # gang rank
    host: str
    status: Status
    path: str  # the build directory (or the image's tool)
    key: str = ""
    seconds: float = 0.0
    log: str = ""  # the run's copy
    toolchain: Toolchain | None = None

    def line(self) -> str:
        what = {"image": "the image's", "cached": "cached build", "built": "built", "joined": "built by another "
                "node's task meanwhile"}[self.status]
        took = f" in {self.seconds:.0f}s" if self.status == "built" else ""
        return f"{self.tool} on node {self.node} ({self.host}): {what} {self.path}{took}"


def cache_key(facts: dict) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


def commit_of(source: str) -> str:
    ref = parse_source(source)
    if ref.scheme != "git" or not ref.revision:
        raise ValueError(f"build.source {source!r} is not a pinned git source")
    return ref.revision


def source_artifact(tool: str, source: str) -> ArtifactSpec:
    """The source as a code artifact: staged once under the workspace, by commit."""
    commit = commit_of(source)
    return ArtifactSpec(name=f"{tool}-src", source=source, target=f"sources/{tool}/{commit[:12]}", submodules=False)


def _finished(final: Path, recipe: Recipe, key: str) -> BuildRecord | None:
    try:
        record = BuildRecord.model_validate_json((final / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if record.key != key or record.tool != recipe.tool:
        return None
    for rel, size in record.outputs.items():
        path = final / rel
        if not path.exists() or (path.is_file() and path.stat().st_size != size):
            return None
    return record


def _outputs(work: Path, recipe: Recipe) -> dict[str, int] | None:
    found: dict[str, int] = {}
    for pattern in recipe.outputs:
        matches = sorted(glob.glob(str(work / pattern)))
        if not matches:
            return None
        found |= {str(Path(m).relative_to(work)): Path(m).stat().st_size for m in matches}
    return found


def _tail(log: Path, lines: int = 6) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    errors = [line for line in text if "error" in line.lower()]
    return " | ".join((errors[:3] or text[-lines:])) if text else ""


class BuildRequest(BaseModel):
    tool: str
    spec: BuildSpec
    node: int
    workspace: str
    source_dir: str = ""  # the staged source ("" when only probing)
    run_log: str = ""  # the run's log file for this node's build
    paths: list[str] = []  # the image's tool, asked about when probing


def build_here(req: BuildRequest) -> BuildOutcome:
    """The Ray task's body on one node: find the build by its key, else build it under the lock."""
    recipe = RECIPES[req.tool]
    tc = probe(req.spec)
    if missing := tc.missing(recipe.needs):
        raise BuildFailed(f"cannot build {req.tool} on node {req.node} ({tc.host}): " + "; ".join(missing))
    commit = commit_of(req.spec.source)
    key = cache_key(recipe.key_facts(tc, commit))
    root = Path(req.workspace) / "builds" / req.tool
    root.mkdir(parents=True, exist_ok=True)
    final = root / key[:12]
    run_log = Path(req.run_log) if req.run_log else None
    if run_log:
        run_log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def outcome(status: Status) -> BuildOutcome:
        if run_log and status != "built":
            record = _finished(final, recipe, key)
            run_log.write_text(f"{req.tool}: {status}: {final} (key {key[:12]}, built on {record.built_on} at "
                               f"{record.built_at} in {record.seconds:.0f}s; its log: {final / LOG})\n")
        return BuildOutcome(tool=req.tool, node=req.node, host=tc.host, status=status, path=str(final), key=key,
                            seconds=time.monotonic() - started, log=str(run_log or final / LOG), toolchain=tc)

    with open(root / f".{key[:12]}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = False
        except BlockingIOError:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another task builds it: wait, then take its result
            waited = True
        if _finished(final, recipe, key):
            return outcome("joined" if waited else "cached")
        if final.exists():  # a damaged or foreign directory under this key: never trusted, set aside
            final.rename(root / f".damaged-{key[:12]}-{uuid.uuid4().hex[:6]}")
        work = root / f".tmp-{key[:12]}-{uuid.uuid4().hex[:6]}"
        shutil.copytree(req.source_dir, work / "src", symlinks=True,
                        ignore=shutil.ignore_patterns(".a4ray-*"))
        log = work / LOG
        commands, env = recipe.commands(tc, req.spec, work)
        with open(log, "w") as out:
            out.write(f"# {req.tool} at {commit} on {tc.host}, key {key}\n# facts: "
                      f"{json.dumps(recipe.key_facts(tc, commit), sort_keys=True)}\n# env: {json.dumps(env)}\n")
            for argv in commands:
                out.write(f"$ {' '.join(argv)}\n")
                out.flush()
                try:
                    code = subprocess.run(argv, cwd=work / "src", env={**os.environ, **env}, stdout=out,
                                          stderr=subprocess.STDOUT, timeout=req.spec.timeout_s,
                                          check=False).returncode
                except subprocess.TimeoutExpired:
                    code = f"timeout after {req.spec.timeout_s}s"
                except OSError as e:
                    code = f"cannot start: {e.strerror}"
                if code != 0:
                    if run_log:
                        shutil.copyfile(log, run_log)
                    raise BuildFailed(f"building {req.tool} on node {req.node} ({tc.host}) failed: `{argv[0]}` "
                                      f"exited {code}: {_tail(log)}", hint=f"the whole log: {run_log or log}")
        outputs = _outputs(work, recipe)
        if outputs is None:
            raise BuildFailed(f"building {req.tool} on node {req.node} ({tc.host}) finished without "
                              f"{', '.join(recipe.outputs)}", hint=f"the log: {log}")
        record = BuildRecord(tool=req.tool, key=key, facts=recipe.key_facts(tc, commit), source=req.spec.source,
                             built_on=socket.gethostname(),
                             built_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                             seconds=round(time.monotonic() - started, 1), outputs=outputs)
        (work / RECORD).write_text(record.model_dump_json(indent=2))
        if run_log:
            shutil.copyfile(log, run_log)
        os.rename(work, final)
        return outcome("built")


def probe_here(req: BuildRequest) -> Toolchain:
    return probe(req.spec, req.paths)


_build_task = ray.remote(num_cpus=0, max_retries=0)(build_here)
_probe_task = ray.remote(num_cpus=0, max_retries=0)(probe_here)


def _on(gang: Gang, rank: int):
    return NodeAffinitySchedulingStrategy(node_id=gang.nodes[rank].node_id, soft=False)


def ensure(gang: Gang, tool: str, spec: BuildSpec, *, workspace: str, log_dir: str,
           conn: Connection | None = None, image: str = "") -> list[BuildOutcome]:
    """The tool on every node of the gang: the image's (`image`, a path) where every node has it and
    build.mode allows, else built (or found built) from the staged source. Raises BuildFailed naming each
    node's missing pieces, or the failed build's last words."""
    recipe = RECIPES[tool]
    spec = spec if spec.source else spec.model_copy(update={"source": PINNED[tool]})
    ranks = range(len(gang.nodes))
    req = BuildRequest(tool=tool, spec=spec, node=0, workspace=workspace, paths=[image] if image else [])
    toolchains = ray.get([_probe_task.options(scheduling_strategy=_on(gang, r)).remote(req.model_copy(
        update={"node": r})) for r in ranks], timeout=300)
    if image and spec.mode != "always" and all(tc.exists.get(image) for tc in toolchains):
        return [BuildOutcome(tool=tool, node=r, host=tc.host, status="image", path=image, toolchain=tc)
                for r, tc in zip(ranks, toolchains)]
    if spec.mode == "never":
        lacking = [f"node {r} ({tc.host})" for r, tc in zip(ranks, toolchains) if not tc.exists.get(image)]
        raise BuildFailed(f"{tool}: {image} is missing on {', '.join(lacking)} and build.mode=never",
                          hint="build it into the image, or set build.mode=auto to build it on the nodes")
    missing = {r: tc.missing(recipe.needs) for r, tc in zip(ranks, toolchains)}
    if any(missing.values()):
        raise BuildFailed(f"cannot build {tool}: " + " | ".join(
            f"node {r} ({toolchains[r].host}): {'; '.join(m)}" for r, m in missing.items() if m),
            hint="install what is named on the nodes (or in the image), or point build.* at it")
    commit = commit_of(spec.source)
    keys = {r: cache_key(recipe.key_facts(tc, commit)) for r, tc in zip(ranks, toolchains)}
    if len(set(keys.values())) > 1:
        differ = "; ".join(f"node {r}: {json.dumps(recipe.key_facts(toolchains[r], commit), sort_keys=True)}"
                           for r in ranks)
        raise BuildFailed(f"{tool}: the nodes' toolchains differ, so no one build serves the gang's MPI launch: "
                          f"{differ}", hint="give every node the same image")
    key = next(iter(keys.values()))
    final = Path(workspace) / "builds" / tool / key[:12]
    source_dir = ""
    if not _finished(final, recipe, key):
        artifact = source_artifact(tool, spec.source)
        staged = stage([artifact], workspace=workspace, conn=conn, log_dir=Path(log_dir))
        source_dir = staged.artifacts[0].target
        say(f"building {tool} ({commit[:12]}, key {key[:12]}) on {len(gang.nodes)} node(s): "
            f"{final} (log: {log_dir}/builds/)")
    tasks = [_build_task.options(scheduling_strategy=_on(gang, r)).remote(BuildRequest(
        tool=tool, spec=spec, node=r, workspace=workspace, source_dir=source_dir,
        run_log=f"{log_dir}/builds/{tool}-node-{r:02d}.log")) for r in ranks]
    try:
        outcomes = ray.get(tasks, timeout=spec.timeout_s + 600)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, BuildFailed):
            raise cause from None
        raise BuildFailed(f"building {tool} failed: {cause or e}") from None
    for o in outcomes:
        say(o.line())
    return outcomes
