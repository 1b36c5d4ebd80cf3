"""The `convert` job: cache check, conversion by the chosen backend, verification, atomic commit.

native: Ray tasks over layer ranges (`native.py`). pai / swift: a gang launch of their tools on every
node (`backends.py`), through the same `Gang` every workload uses. Whatever the backend, the output is
written into a temporary directory, verified there, and only then renamed into place (`cache.py`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from a4ray.core.console import say
from a4ray.core.errors import (
    ConvertFailed,
    ConvertInputError,
    InsufficientResources,
    SpecError,
    UnsupportedModel,
    VerifyFailed,
)
from a4ray.core.rundir import RunDir
from a4ray.hf2mcore import backends
from a4ray.hf2mcore.cache import (
    CONVERTER_VERSION,
    ConvertRecord,
    OutputDir,
    PartRecord,
    VerifyReport,
    cache_key,
    write_record,
)
from a4ray.hf2mcore.convert_result import ConvertResult
from a4ray.hf2mcore.hf import HFCheckpoint, fingerprint
from a4ray.hf2mcore.mapping import dropped, hf_tensors, torch_dtype
from a4ray.mcore.architecture import Architecture
from a4ray.mcore.names import TRACKER
from a4ray.observe import stream
from a4ray.runtime.connect import Connection
from a4ray.runtime.launch import GangResult, Launch, NodeContext
from a4ray.spec.conversion import ConvertJob
from a4ray.workloads.workload import Plan, Workload

# torch, and the native backend's and the verifier's modules (torch's DCP writer and more, 1.8 CPU-s), are imported
# where a conversion opens, writes or checks a checkpoint: a plan (a dry run's, the pipeline's A4 plan) needs none.
if TYPE_CHECKING:
    import torch


class ConvertPlan(Plan):
    """A dry run: the backend's per-node commands (pai, swift) or the native plan of parts."""

    backend: str
    details: list[str] = []

    def render(self) -> str:
        head = [f"convert ({self.backend}):", *(f"  {line}" for line in self.details)]
        return "\n".join(head + ([super().render()] if self.nodes else []))


@dataclass
class Paths:
    input: str
    output: str
    repo: str = ""  # pai checkout
    save: str = ""  # where the backend writes (the temporary directory)


@dataclass
class _Job:
    """One conversion, resolved: its input, where it goes, and its cache key."""

    source: Path
    out: OutputDir
    hf: HFCheckpoint
    arch: Architecture | None  # the native backend's model
    verify_arch: Architecture | None  # the model the verifier builds (None: not verifiable)
    dtype: torch.dtype
    fingerprint: dict
    options: dict
    versions: dict
    key: str


class ConvertWorkload(Workload[ConvertJob]):
    kind = "convert"

    def __init__(self, spec: ConvertJob):
        super().__init__(spec)
        c = spec.convert
        # Until execute() resolves them against the workspace, paths are shown as the user gave them.
        ws = "<workspace>/"
        output = _under(c.output_or_default, ws)
        self.paths = Paths(input=_under(c.input, ws), output=output, repo=_under(c.pai.repo, ws),
                           save=f"{output}/.tmp-<key>")
        self.config: dict = {}
        self.dtype_name = ""  # resolved from convert.precision once the input is open
        self.logs = Path()  # the run's (or its step's) logs, once it runs

    # ------------------------------------------------------------------------------- checks
    def check(self) -> None:
        c, problems = self.spec.convert, []
        if not c.input:
            problems.append("convert.input: required: the HF checkpoint directory (relative to the workspace)")
        if c.backend != "native":
            if c.naming != "te":
                problems.append(f"convert.naming=local: the {c.backend} backend writes Transformer-Engine names only")
            if c.format != "torch_dist":
                problems.append(f"convert.format=legacy: the {c.backend} backend writes torch_dist only")
            if c.max_mb_s_per_task:
                problems.append("convert.max_mb_s_per_task applies to the native backend only")
        if c.backend == "swift":
            if self.spec.cluster.nodes != 1:
                problems.append(f"cluster.nodes={self.spec.cluster.nodes}: the swift backend converts on one node")
            problems += backends.swift_check(c.swift)
        if problems:
            raise SpecError(self.spec.source, problems)

    # --------------------------------------------------------------------------------- plan
    def plan(self, workspace: str | None = None) -> ConvertPlan:
        c = self.spec.convert
        details = [f"input: {self.paths.input}",
                   f"output: {self.paths.output}/<key>/ (latest: {self.paths.output}/latest)",
                   f"verify: {'on' if c.verify_enabled else 'off'}"]
        if c.backend == "swift" and (reason := backends.swift_skip_reason(c.swift)):
            return ConvertPlan(job=self.spec.name, kind=self.kind, nodes=[], rank_order="", env=[], backend=c.backend,
                               details=[*details, f"skipped: {reason}"])
        if c.backend == "native":
            details += self._native_details()
            return ConvertPlan(job=self.spec.name, kind=self.kind, nodes=[], rank_order="", env=[],
                               backend=c.backend, details=details)
        self.config = self.config or self._config_from_here()
        base = super().plan()
        return ConvertPlan(**base.model_dump(), backend=c.backend, details=details)

    def _input_from_here(self) -> Path | None:
        """The input directory, if this machine sees it (a dry run plans from it where it can)."""
        storage = self.spec.storage
        for root in (storage.workspace, storage.local_workspace):  # an absolute input ignores the root
            path = Path(root) / self.spec.convert.input
            if (path / "config.json").is_file():
                return path
        return None

    def _config_from_here(self) -> dict:
        path = self._input_from_here()
        return json.loads((path / "config.json").read_text()) if path else {}

    def _native_details(self) -> list[str]:
        from a4ray.hf2mcore import native

        c = self.spec.convert
        head = [f"{self.spec.cluster.nodes} node(s) x {c.tasks_per_node} task(s), {c.naming} naming, {c.format}"]
        path = self._input_from_here()
        if path is None:
            return head + ["(input not readable here: parts are planned when it runs)"]
        hf = HFCheckpoint.open(path)
        arch = hf.architecture()
        return native.plan(hf, arch, self.spec, _dtype(c.precision, hf)).describe()

    # ------------------------------------------------------------------------------- launch
    def launch(self, node: NodeContext) -> Launch:
        c = self.spec.convert
        dtype = self.dtype_name or str(self.config.get("dtype") or self.config.get("torch_dtype") or "bfloat16")
        if c.backend == "pai":
            script = c.pai.script or "scripts/qwen3/run_8xH20.sh"
            model = backends.pai_model(self.config, c.pai, f"input {self.paths.input}") if self.config else \
                (c.pai.model_size or backends.pai_planned_size(script), script)
            return backends.pai_launch(node, c, self.paths.repo, model, self.paths.input, self.paths.save, dtype)
        if c.backend == "swift":
            return backends.swift_launch(node, c, self.paths.input, self.paths.save, dtype)
        raise RuntimeError("the native backend runs Ray tasks, not a gang launch")

    def result(self, gang: GangResult) -> ConvertResult:
        c = self.spec.convert
        verdict = "gang finished" if gang.ok else f"FAIL: {gang.failure}"
        return ConvertResult(ok=gang.ok, verdict=verdict, gang=gang, status="ran" if gang.ok else "failed",
                             backend=c.backend)

    # ------------------------------------------------------------------------------ execute
    def run(self, conn: Connection, run_dir: RunDir, *, log_dir: Path | None = None) -> ConvertResult:
        t0 = time.monotonic()
        c = self.spec.convert
        self.check()
        if c.backend == "swift" and (reason := backends.swift_skip_reason(c.swift)):
            say(f"convert: skipped: {reason}")
            return ConvertResult(ok=True, status="skipped", backend=c.backend, verdict=f"SKIPPED: {reason}")
        job = self._prepare(conn.workspace(self.spec.storage))
        self.logs = log_dir or run_dir.logs  # where its Ray tasks' output goes (the gang's: its own logs)
        say(f"convert: {job.source} -> {job.out.final} ({c.backend}, key {job.key[:12]})")
        record = job.out.existing()
        if record is not None:
            return self._cached(job, record, t0)
        return self._convert(job, conn, run_dir, log_dir, t0)

    def _prepare(self, workspace: Path) -> _Job:
        """Resolve the paths, check the input as far as the backend needs, and compute the cache key."""
        c = self.spec.convert
        source = Path(_resolve(c.input, workspace))
        output = Path(_resolve(c.output, workspace)) if c.output else source.parent / f"{source.name}-to-mcore"
        self.paths = Paths(input=str(source), output=str(output), repo=_resolve(c.pai.repo, workspace))
        hf = HFCheckpoint.open(source)
        self.config = hf.config
        arch = None
        if c.backend == "native":
            arch = hf.architecture()
            if problems := arch.target_problems(c.naming, c.format):
                raise UnsupportedModel(f"input {source} ({arch.family}): " + "; ".join(problems),
                                       hint="convert it with convert.naming=te and convert.format=torch_dist")
            hf.check(hf_tensors(arch))
        elif c.backend == "pai":
            backends.pai_model(hf.config, c.pai, f"input {source}")  # refuse sizes Pai's scripts lack, now
        verify_arch = arch or _verifiable(hf)
        if c.verify_enabled and verify_arch is None:
            raise ConvertInputError(f"convert.verify: the verifier models Qwen3, Qwen3-MoE and (as the native "
                                    f"backend writes it) Qwen3-Next; input {source} converted by {c.backend} is "
                                    f"{(hf.config.get('architectures') or ['?'])[0]}",
                                    hint="set convert.verify.enabled=false for this model")
        dtype = _dtype(c.precision, hf)
        self.dtype_name = str(dtype).removeprefix("torch.")
        options, versions, found = self._options(dtype), _versions(c.backend, self.paths.repo), fingerprint(source)
        key = cache_key(found, c.backend, options, versions)
        return _Job(source, OutputDir(output, key), hf, arch, verify_arch, dtype, found, options, versions, key)

    def _convert(self, job: _Job, conn: Connection, run_dir: RunDir, log_dir: Path | None, t0: float) -> ConvertResult:
        """Convert into a temporary directory, verify it there, then commit it (or leave nothing)."""
        from a4ray.hf2mcore import native

        c = self.spec.convert
        native_plan = native.plan(job.hf, job.arch, self.spec, job.dtype) if c.backend == "native" else None
        native.check_disk(job.out.root, native_plan.nbytes if native_plan else job.hf.nbytes)
        if c.verify_enabled:
            self._check_verify_memory(job.verify_arch)
        tmp = job.out.temporary()
        try:
            if native_plan is not None:
                for line in native_plan.describe():
                    say(f"convert: {line}")
                parts = self._run_native(job.hf, native_plan, tmp)
                _copy_tokenizer(job.source, tmp)
            else:
                parts = []
                self._run_gang(tmp, conn, run_dir, log_dir)
            write_s = time.monotonic() - t0
            report = self._verify(tmp, job.source, job.verify_arch) if c.verify_enabled else None
            if report is not None and not report.ok:
                kept = job.out.keep_failed(tmp)
                raise VerifyFailed(f"verification of {job.source} -> {c.backend} checkpoint failed: {report.summary()}",
                                   hint=f"the failed checkpoint is kept for inspection in {kept} (no tracker file)")
            seconds = time.monotonic() - t0
            cluster = self.spec.cluster
            layout = ({"nodes": cluster.nodes, "tasks_per_node": c.tasks_per_node, "parts": len(parts)}
                      if native_plan else {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node})
            record = ConvertRecord(
                key=job.key, backend=c.backend, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), input=str(job.source),
                input_fingerprint=job.fingerprint, options=job.options, versions=job.versions,
                architecture=job.arch.__dict__ if job.arch else {}, format=c.format, naming=c.naming,
                dtype=self.dtype_name, layout=layout, parts=parts, seconds=round(seconds, 3), verify=report)
            final = job.out.commit(tmp, record)
        finally:
            if tmp.exists():  # not committed, not kept: a failure leaves nothing behind
                job.out.discard(tmp)
        written = sum(p.bytes for p in parts) or record.bytes
        checked = f"; verified: {report.summary()}" if report else "; not verified"
        verdict = (f"PASS: converted {job.source} -> {final} ({c.backend}, {c.naming} naming, {c.format}, "
                   f"{self.dtype_name}): wrote {native.size(written)} in {write_s:.1f}s "
                   f"({written / 1e6 / write_s:.0f} MB/s; {seconds:.1f}s in all){checked}{self._dropped(job)}")
        return ConvertResult(ok=True, status="ran", backend=c.backend, verdict=verdict, checkpoint=str(final),
                             key=job.key, seconds=seconds, bytes=written, parts=parts, verify=report)

    def _dropped(self, job: _Job) -> str:
        """`; ` + what of the HF checkpoint the native conversion leaves out, said once (or "")."""
        note = dropped(job.arch, list(job.hf.tensors)) if job.arch and self.spec.convert.backend == "native" else None
        if note:
            say(f"convert: {note}")
        return f"; {note}" if note else ""

    def _options(self, dtype) -> dict:
        """What changes the bytes written, and so the cache key (not: node counts, tasks, rate caps)."""
        c = self.spec.convert
        options = {"dtype": str(dtype)}
        if c.backend == "native":
            options.update(naming=c.naming, format=c.format)
        elif c.backend == "pai":
            options.update(c.pai.model_dump(exclude={"repo", "omp_num_threads"}), gpus=self.spec.cluster.world_size)
        else:
            options.update(c.swift.model_dump(exclude={"force"}))
        return options

    def _cached(self, job: _Job, record: ConvertRecord, t0: float) -> ConvertResult:
        c, out = self.spec.convert, job.out
        # A conversion verified without its logits where they are asked for (Qwen3-Next's, before a4ray ran its
        # layers on CPUs) is verified again.
        if c.verify_enabled and not (record.verify and record.verify.ok and (record.verify.logits_checked
                                                                             or not c.verify.logits)):
            say(f"convert: cached conversion {out.final} was not verified; verifying it now")
            report = self._verify(out.final, job.source, job.verify_arch)
            if not report.ok:
                kept = out.keep_failed(out.final)
                raise VerifyFailed(f"the cached conversion {out.final} fails verification: {report.summary()}",
                                   hint=f"it was moved to {kept} (no tracker file); run again to convert anew")
            record.verify = report
            write_record(out.final, record)
        out.point_latest()
        checked = f"; verified: {record.verify.summary()}" if record.verify else ""
        verdict = (f"PASS: cache hit: {out.final} (converted {record.created}, key {record.key[:12]}){checked}"
                   f"{self._dropped(job)}")
        say("convert: cache hit: same input, backend, options and versions; nothing to convert")
        return ConvertResult(ok=True, status="cached", backend=c.backend, verdict=verdict, checkpoint=str(out.final),
                             key=record.key, seconds=time.monotonic() - t0, bytes=record.bytes, verify=record.verify)

    # --------------------------------------------------------------------------- the backends
    def _run_native(self, hf, native_plan, tmp: Path) -> list[PartRecord]:
        from a4ray.hf2mcore import native

        native.check_memory(self.spec, self.spec.convert.tasks_per_node * native_plan.task_memory, "the conversion")
        placement = native.Placement(self.spec, native_plan.task_memory)
        try:
            return native.convert(hf, native_plan, self.spec, tmp, placement, self.logs)
        finally:
            placement.close()

    def _run_gang(self, tmp: Path, conn: Connection, run_dir: RunDir, log_dir: Path | None) -> None:
        self.paths.save = str(tmp)
        gang_result = super().run(conn, run_dir, log_dir=log_dir).gang  # the default: a gang launch per attempt
        if not gang_result.ok:
            raise ConvertFailed(f"{self.spec.convert.backend} conversion failed: {gang_result.failure}",
                                hint=f"per-node logs: {gang_result.log_dir}")
        if not (tmp / TRACKER).is_file():
            raise ConvertFailed(f"{self.spec.convert.backend} conversion exited 0 but wrote no {TRACKER} in {tmp}",
                                hint=f"per-node logs: {gang_result.log_dir}")

    def _check_verify_memory(self, arch) -> None:
        from a4ray.hf2mcore import verify

        need = verify.memory_needed(arch, self.spec.convert.verify)
        resource = self.spec.cluster.node_resource
        best = max((n["Resources"].get("memory", 0) for n in ray.nodes()
                    if n.get("Alive") and n["Resources"].get(resource, 0) >= 1), default=0)
        if need > best:
            raise InsufficientResources(
                f"convert.verify.logits holds the HF and the mcore model in fp32: about {need / 1e9:.1f} GB; the "
                f"largest '{resource}' node has {best / 1e9:.1f} GB of Ray memory",
                hint="set convert.verify.logits=false (the round-trip check streams and needs little memory)")

    def _verify(self, root: Path, source: Path, arch) -> VerifyReport:
        from a4ray.hf2mcore import native, verify

        c = self.spec.convert
        say(f"convert: verifying {root} against {source} (round trip: {c.verify.round_trip}, "
            f"logits: {c.verify.logits})")
        log = stream.TaskLog.open(self.logs, "verify")  # what it prints: in the run's logs, shown by the stream's rules
        # max_calls=1: the worker exits afterwards, taking megatron-core's process-wide CPU shims with it.
        task = ray.remote(max_calls=1)(stream.captured).options(
            num_cpus=1, max_retries=0, memory=verify.memory_needed(arch, c.verify) or None,
            # It compares on the CPU (fp32), as designed; a node's GPUs stay the trainer's.
            runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": ""}},
            resources={self.spec.cluster.node_resource: 0.001}, name=f"a4ray-convert-{self.spec.name}-verify")
        try:
            report = ray.get(task.remote(str(log.path), f"{verify.__name__}:run", str(root), str(source), c.naming,
                                         c.format, c.verify, strict_keys=c.backend == "native"))
        except Exception as error:  # noqa: BLE001 - a crashed verifier is a failed verification
            report = VerifyReport(ok=False, problems=[f"the verification task failed: {native.why_failed(error)}"])
        stream.relay([log])
        say(f"convert: verify {'passed' if report.ok else 'FAILED'} on {report.node or '?'} in "
            f"{report.duration_s:.1f}s: {report.summary()}")
        return report


def _under(path: str, workspace: str) -> str:
    return path if path.startswith("/") or not path else workspace + path


def _resolve(path: str, workspace: Path) -> str:
    return str(Path(path) if path.startswith("/") else (workspace / path).resolve())


def _dtype(precision: str, hf):
    return hf.dtype if precision == "auto" else torch_dtype(precision)


def _verifiable(hf):
    """The model the verifier checks another backend's output against, or None. Not Qwen3-Next: Pai's converter
    writes its own hybrid (Mamba-style) layout, not megatron-core's GPTModel the mapping describes."""
    try:
        arch = hf.architecture()
    except UnsupportedModel:
        return None
    return None if arch.hybrid else arch


def _versions(backend: str, repo: str) -> dict:
    """Versions of what writes the bytes (ms-swift's is an option: the image's, as the user declares it)."""
    import torch

    versions = {"a4ray_converter": CONVERTER_VERSION, "torch": ".".join(torch.__version__.split(".")[:2])}
    if backend == "pai":
        versions["pai_commit"] = _git_head(repo)
    return versions


def _git_head(repo: str) -> str:
    try:
        out = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


# What Pai's converter copies next to the checkpoint (`*.json`, `merges.txt`), plus the other tokenizer
# files a Qwen tokenizer may use: Pai's trainer loads its tokenizer from the checkpoint directory.
_TOKENIZER_FILES = ("*.json", "merges.txt", "vocab.txt", "tokenizer.model", "*.tiktoken")


def _copy_tokenizer(source: Path, checkpoint: Path) -> None:
    for pattern in _TOKENIZER_FILES:
        for path in source.glob(pattern):
            if path.is_file() and path.name != "model.safetensors.index.json":
                shutil.copy2(path, checkpoint / path.name)
