"""Preflight doctor: is every node of the gang fit to train? (`a4ray doctor`, and the pipeline's preflight)

On every node in parallel: GPUs visible and as many as expected, driver and CUDA versions, the gIB plugin
and set_nccl_env.sh, RDMA devices, /dev/shm, free disk on the workspace, py-spy able to attach (hang
forensics). Across nodes: the workspace is shared storage (each node reads a file another node wrote)
and clocks agree. Then a short all-reduce over the whole gang. One row per node and check, a verdict,
and for each failure the node and the fix. On simulated nodes, GPU/RDMA/gIB checks say "n/a: not present".
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

import ray
from pydantic import BaseModel

from a4ray.core.console import say, table
from a4ray.core.node_history import NodeHistory, summarize
from a4ray.core.rundir import RunDir
from a4ray.observe.stacks import dump, py_spy
from a4ray.runtime.connect import Connection
from a4ray.runtime.gang import Gang
from a4ray.runtime.launch import Launch, NodeContext
from a4ray.runtime.node_local import local_checkpoints_root
from a4ray.spec.cluster import NetworkSpec
from a4ray.spec.job import JobSpec
from a4ray.spec.nccl import NcclTestJob
from a4ray.spec.resilience import DoctorSpec
from a4ray.workloads.network_test import NcclTest
from a4ray.workloads.workload import Workload, WorkloadResult

Status = Literal["ok", "warn", "fail", "n/a"]
PROBE_DIR = ".a4ray-doctor"


class Check(BaseModel):
    node: int | None  # None: the whole gang
    host: str = ""
    name: str
    status: Status
    detail: str
    fix: str = ""


class CheckpointNeed(BaseModel):
    """What the train step after a preflight will write: where, about how big each checkpoint is and how many
    the run saves. The disk check holds the free space there to it, above the `min_free_disk_gb` floor."""

    path: str  # the checkpoint directory, as the nodes see it
    each_bytes: int
    count: int | None = None  # on disk at once at most: saved over the run, or kept (None: not known)
    reckoned: str  # how each_bytes was reckoned, shown in the check
    local_path: str | None = None  # storage.local_checkpoints ('': each node's RAM disk); None: no local checkpoints
    local_bytes: int = 0  # what a node holds of them at most: its share, its replicas', the one being written

    @property
    def each(self) -> str:
        """One checkpoint's size, in the unit the disk check counts in (GiB), MiB for a small model."""
        gib = self.each_bytes / 2**30
        return f"{gib:,.1f} GiB" if gib >= 0.1 else f"{self.each_bytes / 2**20:,.1f} MiB"


class DoctorResult(WorkloadResult):
    kind: str = "doctor"
    checks: list[Check] = []

    def table(self) -> str:
        """One row per node and check, then each failure with its fix."""
        rows = [[c.node if c.node is not None else "all", c.host, c.name, c.status, c.detail] for c in self.checks]
        fixes = [f"node {c.node} ({c.host}) {c.name}: {c.detail}" + (f"\n  fix: {c.fix}" if c.fix else "")
                 for c in self.failures]
        return "\n".join([table("a4ray doctor", ["node", "host", "check", "status", "detail"], rows), *fixes])

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]


# ------------------------------------------------------------------------------- on each node


def _run(argv: list[str], timeout: float = 20) -> str | None:
    if not shutil.which(argv[0]):
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False).stdout
    except (subprocess.SubprocessError, OSError):
        return None


def _gpus(expected: int, simulated: bool) -> tuple[Status, str, str]:
    listing = _run(["nvidia-smi", "--query-gpu=index,name,driver_version", "--format=csv,noheader"])
    if listing is None:
        if simulated:
            return "n/a", f"not present (simulated node: {expected} logical GPUs)", ""
        return "fail", "nvidia-smi not found: no NVIDIA driver here", \
            "run on an A4 GPU node (nodeSelector cloud.google.com/gke-accelerator: nvidia-b200)"
    rows = [[f.strip() for f in line.split(",")] for line in listing.strip().splitlines() if line.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # Ray sets it to this node actor's GPUs
    if visible is not None:
        ids = {v.strip() for v in visible.split(",") if v.strip()}
        rows = [r for r in rows if r[0] in ids]
    header = _run(["nvidia-smi"]) or ""
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    names = sorted({r[1] for r in rows}) if rows else ["none"]
    detail = (f"{len(rows)} x {', '.join(names)} (driver {rows[0][2] if rows else '?'}, "
              f"CUDA {cuda.group(1) if cuda else '?'})")
    if len(rows) < expected:
        return "fail", f"{detail}; expected {expected}", "check the node's GPUs (nvidia-smi) and the pod's nvidia.com/gpu limit"
    return "ok", detail, ""


def _gib(network: NetworkSpec, simulated: bool) -> tuple[Status, str, str]:
    if network.gib == "off":
        return "n/a", "network.gib=off", ""
    script, lib = Path(network.gib_script), Path(network.gib_lib_dir)
    plugins = sorted(p.name for p in lib.glob("libnccl-net*.so*")) if lib.is_dir() else []
    if script.is_file() and plugins:
        return "ok", f"{script} and {', '.join(plugins[:3])} in {lib}", ""
    missing = f"{script} {'present' if script.is_file() else 'missing'}, no NCCL net plugin in {lib}" \
        if script.is_file() else f"{script} not found"
    if simulated and network.gib == "auto":
        return "n/a", f"not present ({missing})", ""
    status: Status = "fail" if network.gib == "on" else "warn"
    return status, missing, ("mount the gIB plugin at /usr/local/gib (KubeRay: kuberay.gib.source "
                             "initcontainer or hostpath)")


def _rdma(simulated: bool, gib_wanted: bool) -> tuple[Status, str, str]:
    dev = Path("/dev/infiniband")
    verbs = sorted(p.name for p in dev.glob("uverbs*")) if dev.is_dir() else []
    listing = _run(["ibv_devices"])
    hcas = re.findall(r"^\s+(\S+)\s+[0-9a-f]{16}", listing or "", re.M)
    if verbs:
        return "ok", f"{len(verbs)} RDMA devices" + (f" ({', '.join(hcas)})" if hcas else ""), ""
    if simulated:
        return "n/a", "not present (/dev/infiniband missing)", ""
    return ("fail" if gib_wanted else "warn"), "no RDMA devices (/dev/infiniband missing): NCCL would fall back to sockets", \
        "give the pod the RDMA NICs: hostNetwork + privileged (kuberay.rdma.mode=hostnetwork) or multinetwork annotations"


def _shm(min_gb: float) -> tuple[Status, str, str]:
    total = shutil.disk_usage("/dev/shm").total / 2**30 if Path("/dev/shm").is_dir() else 0.0
    if total < min_gb:
        return "warn", f"/dev/shm is {total:.1f} GiB (< {min_gb:g})", \
            "mount a memory-backed emptyDir at /dev/shm (kuberay.shm_size, default 250Gi)"
    return "ok", f"/dev/shm {total:.0f} GiB", ""


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _disk(workspace: str, min_gb: float, need: CheckpointNeed | None = None) -> tuple[Status, str, str]:
    where = need.path if need else workspace
    free = shutil.disk_usage(_existing(Path(where))).free / 2**30
    if need is None:
        if free < min_gb:
            return "fail", f"{free:.1f} GiB free on {workspace} (< {min_gb:g})", "free space or mount a larger volume"
        return "ok", f"{free:.0f} GiB free on {workspace}", ""
    each = need.each_bytes / 2**30
    if free < min_gb + each:
        return ("fail", f"{free:,.1f} GiB free on {where}: one checkpoint takes ~{need.each} ({need.reckoned}), "
                f"and {min_gb:g} GiB are kept free", "free space or mount a larger volume for the checkpoints")
    if need.count and free < min_gb + each * need.count:
        fits = int((free - min_gb) // each)
        return ("warn", f"{free:,.0f} GiB free on {where}: room for {fits} of the {need.count} checkpoints this run "
                f"keeps, ~{need.each} each ({need.reckoned})",
                "free space, raise train.save_interval, or keep fewer (the trainer's keep_checkpoints)")
    saved = f"the {need.count} checkpoints" if need.count else "a checkpoint"
    return "ok", f"{free:,.0f} GiB free on {where}: {saved} of ~{need.each} each fit", ""


def _local_room(need: CheckpointNeed) -> tuple[Status, str, str]:
    """Room for the local checkpoints in the node's own storage (its RAM disk): a full one never fills the node."""
    root = local_checkpoints_root(need.local_path)
    free = shutil.disk_usage(_existing(root)).free
    held = f"{need.local_bytes / 2**30:,.2f} GiB" if need.local_bytes >= 2**28 else f"{need.local_bytes / 2**20:,.1f} MiB"
    if free < need.local_bytes:
        return ("fail", f"{free / 2**30:,.1f} GiB free in {root}: the node holds up to {held} of local checkpoints "
                "(its ranks' parts and their replicas, twice while one is written)",
                "a larger RAM disk (kuberay.shm_size), storage.local_checkpoints on a local SSD, or fewer "
                "train.local_replicas")
    return "ok", f"{free / 2**30:,.0f} GiB free in {root}: the local checkpoints' {held} fit", ""


def _py_spy() -> tuple[Status, str, str]:
    if py_spy() is None:
        return "warn", "py-spy not installed: a hang would be reported without stacks", "pip install py-spy"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        text, error = dump(child.pid, timeout_s=15)
    finally:
        child.kill()
        child.wait()
    if error and not text:
        return "warn", f"py-spy cannot attach: {error}", "run as root or add the SYS_PTRACE capability"
    return "ok", "py-spy attaches (hang stacks available)", ""


def node_checks(expected_gpus: int, network: NetworkSpec, workspace: str, limits: DoctorSpec,
                simulated: bool, checkpoints: CheckpointNeed | None = None) -> list[tuple[str, Status, str, str]]:
    """Runs on one node: (check, status, detail, fix) for every local check."""
    gib_wanted = network.gib == "on"
    checks = [("GPUs", _gpus(expected_gpus, simulated)), ("gIB plugin", _gib(network, simulated)),
              ("RDMA", _rdma(simulated, gib_wanted)), ("/dev/shm", _shm(limits.min_shm_gb)),
              ("disk", _disk(workspace, limits.min_free_disk_gb, checkpoints)), ("py-spy", _py_spy())]
    if checkpoints is not None and checkpoints.local_path is not None:
        checks.append(("local checkpoints", _local_room(checkpoints)))
    return [(name, *outcome) for name, outcome in checks]


def write_probe(path: str, token: str) -> str | None:
    """Write `token` to `path` (atomically); the error text, or None."""
    try:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(token)
        tmp.replace(p)
        return None
    except OSError as e:
        return str(e)


def read_probe(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def now() -> float:
    return time.time()


# ------------------------------------------------------------------------------- the gang


class Doctor(Workload[JobSpec]):
    """The doctor as a job: the gang of any job spec, placed once (never restarted), and every node checked."""

    kind = "doctor"

    def plan(self, workspace: str | None = None) -> str:
        c = self.spec.cluster
        return (f"a4ray doctor on {c.nodes} node(s) x {c.gpus_per_node} GPU(s) of the gang of {self.spec.name!r}: "
                "GPUs, gIB, RDMA, /dev/shm, disk, py-spy, shared workspace, clocks"
                + (", then a short all-reduce" if self.spec.doctor.network else ""))

    def launch(self, node: NodeContext) -> Launch:
        raise RuntimeError("the doctor calls its checks on the node actors; it launches no command")

    def run(self, conn: Connection, run_dir: RunDir, *, log_dir: Path | None = None,
            checkpoints: CheckpointNeed | None = None) -> DoctorResult:
        """`checkpoints`: what the training after this preflight will save, for the disk check."""
        workspace = conn.workspace(self.spec.storage)
        history = NodeHistory(run_dir.workspace)
        with Gang(self.spec, log_dir=str(log_dir or run_dir.logs), run_dir=str(run_dir.root)) as gang:
            gang.start()
            result = check_gang(gang, str(workspace), simulated=conn.simulated, history=history,
                                checkpoints=checkpoints)
        for check in result.failures:
            if check.node is not None:
                history.add(check.host, "doctor-failed", run=run_dir.id, detail=f"{check.name}: {check.detail}")
        return result


def check_gang(gang, workspace: str, *, simulated: bool, history: NodeHistory | None = None,
               checkpoints: CheckpointNeed | None = None) -> DoctorResult:
    spec, actors = gang.spec, gang.actors
    hosts = [n.short_name(spec.cluster.topology) for n in gang.nodes]
    checks: list[Check] = []
    if history is not None:  # what the workspace remembers of each node: a warning, not a failure
        for rank, host in enumerate(hosts):
            events = history.events(host)
            checks.append(Check(node=rank, host=host, name="history", status="warn" if events else "ok",
                                detail=summarize(events),
                                fix=f"`a4ray nodes forget {host}` once the node is repaired" if events else ""))

    local = ray.get([a.call.remote(node_checks, spec.cluster.gpus_per_node, spec.network, workspace,
                                   spec.doctor, simulated, checkpoints) for a in actors], timeout=300)
    for rank, rows in enumerate(local):
        checks += [Check(node=rank, host=hosts[rank], name=n, status=s, detail=d, fix=f) for n, s, d, f in rows]

    checks += _shared_storage(gang, workspace, hosts)
    checks += _clock_skew(gang, hosts, spec.doctor.max_clock_skew_s)
    if spec.doctor.network:
        checks.append(_network(gang))
    checks.sort(key=lambda c: -1 if c.node is None else c.node)  # stable: each node's rows together

    failures = [c for c in checks if c.status == "fail"]
    counted = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "n/a")}
    summary = f"{counted['ok']} ok, {counted['warn']} warnings, {counted['n/a']} n/a on {len(actors)} node(s)"
    if failures:
        first = failures[0]
        verdict = (f"FAIL: {len(failures)} check(s) failed ({summary}); first: node {first.node} ({first.host}) "
                   f"{first.name}: {first.detail}" + (f" -> {first.fix}" if first.fix else ""))
    else:
        verdict = f"PASS: {summary}"
    return DoctorResult(ok=not failures, verdict=verdict, checks=checks)


def _shared_storage(gang, workspace: str, hosts: list[str]) -> list[Check]:
    """Each node writes a probe; node k reads node k+1's: a node that can't is not on shared storage."""
    actors, n = gang.actors, len(gang.actors)
    tokens = [secrets.token_hex(8) for _ in range(n)]
    # <workspace>/.a4ray-doctor/<host>/<launch>.probe: a node writes under its own name
    names = [node.short_name(gang.spec.cluster.topology) for node in gang.nodes]
    paths = [str(Path(workspace) / PROBE_DIR / names[k] / f"{gang.launch_id}.probe") for k in range(n)]
    written = ray.get([a.call.remote(write_probe, paths[k], tokens[k]) for k, a in enumerate(actors)], timeout=60)
    seen = ray.get([a.call.remote(read_probe, paths[(k + 1) % n]) for k, a in enumerate(actors)], timeout=60)
    checks = []
    for k in range(n):
        other = (k + 1) % n
        if written[k] is not None:
            checks.append(Check(node=k, host=hosts[k], name="workspace", status="fail",
                                detail=f"cannot write to {workspace}: {written[k]}",
                                fix="mount the shared workspace read-write on this node (storage.workspace)"))
        elif written[other] is None and seen[k] != tokens[other]:
            checks.append(Check(node=k, host=hosts[k], name="workspace", status="fail",
                                detail=f"does not see the file node {other} wrote under {workspace}: not shared",
                                fix="mount the same shared storage (Filestore/Lustre/GCS FUSE) on every node"))
        else:
            checks.append(Check(node=k, host=hosts[k], name="workspace", status="ok",
                                detail=f"writable, shared with node {other}" if n > 1 else "writable"))
    for path in paths:
        try:
            Path(path).unlink(missing_ok=True)
        except OSError:
            pass
    return checks


def _clock_skew(gang, hosts: list[str], max_skew_s: float) -> list[Check]:
    checks = []
    for rank, actor in enumerate(gang.actors):
        before = time.time()
        remote = ray.get(actor.call.remote(now), timeout=60)
        after = time.time()
        skew = remote - (before + after) / 2
        uncertainty = (after - before) / 2
        status: Status = "fail" if abs(skew) - uncertainty > max_skew_s else "ok"
        checks.append(Check(node=rank, host=hosts[rank], name="clock", status=status,
                            detail=f"skew {skew * 1000:+.0f} ms (+/- {uncertainty * 1000:.0f} ms) against the driver",
                            fix="sync the node's clock (chrony/NTP)" if status == "fail" else ""))
    return checks


def _network(gang) -> Check:
    """A short all-reduce over the whole gang with the nccl_test workload: NCCL's transport between nodes
    (gIB/IB expected, a socket fallback fails) and busbw against nccl_test's all_reduce thresholds."""
    spec = gang.spec
    size = spec.doctor.network_bytes
    probe = NcclTestJob.model_validate({
        **spec.model_dump(mode="json", include={"name", "cluster", "network", "storage"}), "kind": "nccl_test",
        "timeout_s": 300, "nccl": {"collectives": ["all_reduce"], "min_bytes": size, "max_bytes": size,
                                   "iters": 5, "warmup": 2, "implementation": "torch",
                                   "cpu_min_bytes": "1M", "cpu_max_bytes": "1M"}})
    result = NcclTest(probe, env_label="preflight all-reduce").execute(gang)
    status: Status = "ok" if result.ok else "fail"
    return Check(node=None, host="all", name="network", status=status, detail=result.verdict.removeprefix("PASS: "),
                 fix="" if result.ok else "run `python -m a4ray.nccl_test --set nccl.isolate=true` to name the "
                 "slow or broken nodes")


def report(result: DoctorResult) -> None:
    """The table, each failure with its fix, and the verdict: what the preflight step prints."""
    print(result.table(), flush=True)
    say(result.verdict)
