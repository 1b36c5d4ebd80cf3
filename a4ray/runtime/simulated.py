"""An embedded Ray cluster of simulated A4 nodes on this machine (for rehearsals and tests).

Each simulated node is a real Ray node (its own raylet, via `ray.cluster_utils.Cluster`) with logical
GPUs, the machine-type resource an A4 node advertises, and node labels carrying a simulated physical
topology under the same keys GKE uses, so the gang code cannot tell it from A4 nodes. Where this
machine has enough real GPUs, each node gets its own slice of them (CUDA_VISIBLE_DEVICES of its raylet),
so NCCL runs across "nodes" for real. Each node also gets its own loopback address (127.0.B.2, .3, ...)
as its Ray node IP, so rendezvous addresses, MPI hostfiles and OpenMPI itself see distinct hosts. B is the
cluster's own block of loopback addresses (`LoopbackBlock`): two clusters on one machine (two `a4ray local
up`, a test suite's workers) never share a node address, so a call meant for one cluster's node can never
reach a process of the other's that took the same port.

Like every local cluster of a4ray it runs with Ray token authentication (`a4ray.runtime.auth`), its head
bound to loopback unless `host` says otherwise, and its processes (and so the jobs submitted to it) find the
Python a4ray runs in first on PATH, whether or not its virtualenv was activated.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from a4ray.core import ports
from a4ray.core.console import say, warn
from a4ray.core.errors import SpecError
from a4ray.observe.prometheus import LocalPrometheus
from a4ray.runtime import auth
from a4ray.runtime.node_local import NODE_LOCAL_ENV
from a4ray.runtime.rayenv import HEAD_ENV, SIMULATED_HEAD_ENV, SIMULATED_SYSTEM_CONFIG
from a4ray.runtime.reaper import sweep_flight_recorder_pipes
from a4ray.spec.cluster import TopologySpec
from a4ray.spec.job import ClusterJob
from a4ray.spec.overrides import validate

SIMULATED_LABEL = "a4ray.io/simulated"
# Where relative local paths (storage.local_workspace) resolve on a simulated cluster: the directory it was
# started in. Every node's processes get it, because the driver of a `ray job submit` runs in a temporary
# copy of its working_dir, which Ray deletes when the job ends (taking any run directory inside along).
LOCAL_ROOT_ENV = "A4RAY_LOCAL_ROOT"
NODES_PER_SUBBLOCK = 4  # so a simulated topology has more than one subblock to order
DASHBOARD_PORT = 8265
# Every simulated node is a raylet and its workers on this one machine (and has its own 127.0.B.x address):
# more than this is no rehearsal a machine can hold.
MAX_SIMULATED_NODES = 32


def local_root() -> Path:
    """Where relative local paths (the local workspace, stand-ins, local sources) resolve: the directory the
    simulated cluster started in, on its nodes and in its jobs' drivers; elsewhere the current directory."""
    return Path(os.environ.get(LOCAL_ROOT_ENV) or os.getcwd())


def simulated_location(index: int, topology: TopologySpec) -> dict[str, str]:
    return {
        topology.block_label: "sim-block-0",
        topology.subblock_label: f"sim-subblock-{index // NODES_PER_SUBBLOCK}",
        topology.host_label: f"sim-host-{index:03d}",
    }


def simulated_ip(index: int, block: int = 0) -> str:
    """Simulated node `index`'s own address in loopback block `block`: all of 127.0.0.0/8 reaches this machine
    on Linux."""
    if not 0 <= index < 250:
        raise ValueError(f"simulated node index {index} out of range (0..249)")
    return f"127.0.{block}.{2 + index}"


class LoopbackBlock:
    """A block of loopback addresses (127.0.B.0/24) this process holds for one cluster's nodes until `release()`
    (or its exit): a lock file per block, under a directory every user's a4ray shares on this machine."""

    DIR = Path("/tmp/a4ray-loopback")

    def __init__(self):
        with contextlib.suppress(OSError):
            self.DIR.mkdir(exist_ok=True)
            os.chmod(self.DIR, 0o1777)  # every user's clusters take blocks from the same directory
        for block in range(256):
            try:
                f = open(self.DIR / f"{block}.lock", "a")  # noqa: SIM115 - held for the cluster's life
            except OSError:  # another user's block, not writable by this one
                continue
            with contextlib.suppress(OSError):
                os.chmod(f.name, 0o666)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                continue
            self.block, self._lock = block, f
            return
        raise RuntimeError(f"no loopback block (127.0.0-255.x) is free: every one is held by another local cluster "
                           f"or not writable ({self.DIR})")

    def release(self) -> None:
        self._lock.close()


def physical_gpu_ids() -> list[str]:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES if set, else what nvidia-smi lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip()]
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True)
    except (subprocess.SubprocessError, OSError):
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def _forkserver_dirs(head) -> list[str]:
    """The directories of the unix sockets that the head dashboard's processes listen on in multiprocessing's temp
    directories (/tmp/pymp-*: its modules' forkserver): Ray ends them with a kill, which leaves these behind."""
    import psutil
    from ray._private import ray_constants

    found = set()
    for info in head.all_processes.get(ray_constants.PROCESS_TYPE_DASHBOARD, []):
        with contextlib.suppress(psutil.Error):
            dashboard = psutil.Process(info.process.pid)
            for proc in [dashboard, *dashboard.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    sockets = [c.laddr for c in proc.net_connections("unix") if isinstance(c.laddr, str)]
                    found |= {os.path.dirname(s) for s in sockets
                              if os.path.basename(os.path.dirname(s)).startswith("pymp-")}
    return sorted(found)


def _python_first() -> dict[str, str]:
    """PATH with the directory of the Python a4ray runs in first: `ray job submit -- python -m a4ray.<job>` on
    this cluster must start that Python (with Ray and a4ray), not whatever `python` the caller's PATH finds
    (`.venv/bin/a4ray local up` with the virtualenv not activated)."""
    bin_dir = os.path.dirname(sys.executable)
    rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != bin_dir]
    return {"PATH": os.pathsep.join([bin_dir, *rest])}


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """This process's environment with `values` (where not set already) while the block runs."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def machine_cores() -> int:
    """The cores this process may run on: its CPU affinity, within a cgroup's CPU quota (a container's)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


@contextlib.contextmanager
def _own_session():
    """Ray processes started while the block runs (a node's GCS, raylet, agents, and through the raylet its
    workers: the node actors) start in a session of their own. A signal sent to this process's group (`timeout`,
    a CI runner or a shell stopping `a4ray run`) then reaches this process alone, which stops the gang through
    them and shuts them down, as it does on Ctrl-C (SIGINT, which Ray's processes block). In this process's
    group, a group SIGTERM killed them under the driver, which then waited 60 s for the GCS before dying
    without a record. They still end with this process if it is killed outright: Ray has the kernel kill each
    of them when its parent dies (Linux). Where the kernel cannot, Ray's reaper kills this process's group
    when it dies, and they stay in that group."""
    from ray._private import services, utils

    started: list[subprocess.Popen] = []  # yielded: the processes the block started (a failed node's to stop)
    if not (sys.platform.startswith("linux") and utils.detect_fate_sharing_support()):
        yield started
        return
    popen = services.ConsolePopen

    class SessionPopen(popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, start_new_session=True, **kwargs)
            started.append(self)

    services.ConsolePopen = SessionPopen
    try:
        yield started
    finally:
        services.ConsolePopen = popen


def _raylet_exited(started: list[subprocess.Popen]) -> str:
    """How the raylet among `started` ended ("exit code N"), or "" while it runs (or none was started)."""
    for proc in started:
        command = proc.args[0] if isinstance(proc.args, (list, tuple)) else str(proc.args).split()[0]
        if os.path.basename(str(command)) == "raylet" and proc.poll() is not None:
            return f"exit code {proc.returncode}"
    return ""


def _stop_started(started: list[subprocess.Popen]) -> None:
    """Kill what a failed node start left (each process with its session's group: its agents)."""
    for proc in started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    for proc in started:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _raylet_last_error(started: list[subprocess.Popen]) -> str:
    """The last error line of the raylet among `started` (its log file's), or "": why a node did not come up."""
    for proc in started:
        args = proc.args if isinstance(proc.args, (list, tuple)) else []
        out = next((a.split("=", 1)[1] for a in args if str(a).startswith("--stdout_filepath=")), None)
        if out:
            with contextlib.suppress(OSError):
                errors = [line for line in Path(out).read_text(errors="replace").splitlines()
                          if re.match(r"\[[^\]]* [EFC] \d+ \d+\]", line)]
                if errors:
                    return errors[-1].split("] ", 1)[-1][:300]
    return ""


def _start_node(what: str, start, fresh=lambda: None):
    """`start()` one simulated node, its processes in a session of their own and given time to register. A node
    whose raylet ended while starting (an agent failed: on a loaded machine, most often its port taken meanwhile),
    or that did not register in time, is stopped and started once more (`fresh()` first: new ports), with a
    warning that says why; a second failure raises."""
    for attempt in (0, 1):
        with _own_session() as started, _patient_registration(started=started):
            try:
                return start()
            except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this one
                if attempt or "timed out during startup" not in str(e):
                    raise
                how = _raylet_exited(started) or "still not registered"
                last = _raylet_last_error(started)
                _stop_started(started)
                warn(f"{what}: its raylet did not register with the GCS ({how}"
                     f"{f'; its last error: {last}' if last else ''}); starting it once more")
                fresh()


NODE_REGISTRATION_S = 120.0  # how long a starting node's raylet may take to register with the GCS


@contextlib.contextmanager
def _patient_registration(wait_s: float = NODE_REGISTRATION_S, started: list[subprocess.Popen] | None = None):
    """Nodes started while the block runs get `wait_s` to register with the GCS, not Ray's hard-coded 30 s. A
    machine busy with other work (a 2-core CI runner, a laptop training beside it) misses 30 s now and then, and
    Ray then raises "The current node timed out during startup" with the node's processes still coming up. Ray
    asks the GCS for the node in a loop (`services.get_node`, RuntimeError until it is there, an RPC deadline when
    the GCS is slow): each ask here keeps asking until the node is there or `wait_s` has passed, or until the
    node's raylet among `started` has exited (a failed agent ends it: no wait brings that node up)."""
    from ray._private import services

    get_node = services.get_node

    def patient(*args, **kwargs):
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return get_node(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() >= deadline or _raylet_exited(started or []):
                    raise
                time.sleep(0.2)

    services.get_node = patient
    try:
        yield
    finally:
        services.get_node = get_node


@contextlib.contextmanager
def _unadvertised(private: bool):
    """Ray's test Cluster records its head's address for the whole machine (`ray_current_cluster`, where
    `ray.init("auto")` and a4ray's `connect` look for a running cluster). A private cluster (one process's
    embedded cluster, gone when it exits) puts back what was there: a second rehearsal started meanwhile
    would otherwise join it and fail when the first one finishes."""
    from ray._common.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    before = path.read_text() if private and path.is_file() else None
    try:
        yield
    finally:
        if private:
            if before is None:
                path.unlink(missing_ok=True)
            else:
                path.write_text(before)


class SimulatedCluster:
    def __init__(self, nodes: int, gpus_per_node: int, *, machine_type: str = "a4-highgpu-8g",
                 topology: TopologySpec | None = None, cpus_per_node: int = 4,
                 dashboard: bool = False, dashboard_port: int | None = None, client_port: int | None = None,
                 object_store_mb: int = 256, shared: bool = False, loopback_ips: bool = True,
                 node_env: dict[int, dict[str, str]] | None = None, host: str = auth.LOOPBACK,
                 prometheus: LocalPrometheus | None = None, name: str = "embedded local Ray cluster"):
        # Its shape is a cluster spec's (the same limits), refused before any Ray process starts.
        validate(ClusterJob, {"cluster": {"nodes": nodes, "gpus_per_node": gpus_per_node, "machine_type": machine_type}},
                 "the embedded local cluster")
        if nodes > MAX_SIMULATED_NODES:
            raise SpecError("the embedded local cluster", [
                f"cluster.nodes: {nodes} simulated nodes would all run on this machine; at most "
                f"{MAX_SIMULATED_NODES} (join a real cluster with --address for more)"])
        self.name = name  # what it is called where it is printed: embedded in a job, or `a4ray local up`'s
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.machine_type = machine_type
        self.topology = topology or TopologySpec()
        self.cpus_per_node = cpus_per_node
        self.dashboard = dashboard
        self.dashboard_port = dashboard_port
        self.client_port = client_port  # Ray Client server (ray://) on the head, if set
        self.object_store_mb = object_store_mb
        # The machine's cluster (`a4ray local up`): recorded where other processes look for a running one
        # (`ray job submit`, `a4ray.connect()`); else it is this process's alone (see _unadvertised).
        self.shared = shared
        self.loopback_ips = loopback_ips
        self.node_env = node_env or {}  # extra env of one node's processes (e.g. a misconfigured node)
        self.host = host  # the head's address: loopback (this machine only) unless asked otherwise
        self.prometheus = prometheus  # started on the head's session once it is up; the dashboard charts from it
        self.root = str(local_root())  # relative local paths resolve here
        self.cluster = None
        self.workers: dict[int, object] = {}  # simulated node index -> ray._private.node.Node
        self._gpu_slices: list[str] | None = None
        self._tmp_root: str | None = None  # each node's own /tmp (see _separate_host_env)
        self._ray_temp: str | None = None  # the cluster's Ray temp directory (its sessions' sockets and logs)
        self._undo: list[auth.Undo] = []
        self._loopback: LoopbackBlock | None = None

    def ip(self, index: int) -> str:
        """Simulated node `index`'s own address (the cluster's loopback block, once started)."""
        assert self._loopback is not None or not self.loopback_ips
        return simulated_ip(index, self._loopback.block) if self._loopback else self.host

    @property
    def address(self) -> str:
        assert self.cluster is not None
        return self.cluster.address

    @property
    def dashboard_url(self) -> str | None:
        return getattr(self.cluster.head_node, "webui_url", None) if self.cluster else None

    def start(self) -> str:
        from ray._common.utils import get_default_ray_temp_dir
        from ray._private.utils import write_ray_address
        from ray.cluster_utils import Cluster

        physical = physical_gpu_ids()
        if len(physical) >= self.nodes * self.gpus_per_node:
            self._gpu_slices = physical
        elif physical:
            warn(f"{self.nodes} simulated nodes x {self.gpus_per_node} GPUs need {self.nodes * self.gpus_per_node} "
                 f"GPUs; this machine has {len(physical)}: simulated GPUs are logical only")
        # The head's dashboard agent would take the fixed port 52365; another Ray on this machine may
        # hold it, and then job submission finds no agent. Workers already get random ports.
        # Before the head starts: its processes, and this one, take both from the environment (undone at shutdown).
        self._undo = [auth.enable_token_auth()] + ([auth.loopback_only()] if auth.is_loopback(self.host) else [])
        where = {} if self.host == "0.0.0.0" else {"node_ip_address": self.host}
        head = dict(num_cpus=0, num_gpus=0, include_dashboard=self.dashboard, dashboard_host=self.host,
                    env_vars={LOCAL_ROOT_ENV: self.root, **_python_first()},
                    object_store_memory=128 * 2**20, labels={SIMULATED_LABEL: "true"}, node_name="head",
                    _system_config=SIMULATED_SYSTEM_CONFIG, **where)
        if self.client_port:
            head["ray_client_server_port"] = self.client_port

        def fresh_ports():
            head["dashboard_agent_listen_port"] = ports.free_port()
            if self.dashboard:  # Ray's usual port where it is free: another cluster on this machine may hold it
                head["dashboard_port"] = self.dashboard_port or (
                    DASHBOARD_PORT if ports.is_free(DASHBOARD_PORT) else ports.free_port())
        fresh_ports()
        self._tmp_root = tempfile.mkdtemp(prefix="a4ray-sim-")
        if self.loopback_ips:
            self._loopback = LoopbackBlock()
        # A Ray temp directory of its own (its nodes take the head's), recording its own address: Ray's job
        # supervisor points a job's driver at the cluster recorded in its temp directory (RAY_ADDRESS=auto), and
        # where none is recorded at any Ray it finds running on the machine. In the machine's shared one, a job
        # submitted here would run its driver on whichever cluster started last, or on any.
        ray_temp = Path(get_default_ray_temp_dir())
        ray_temp.mkdir(parents=True, exist_ok=True)
        head["temp_dir"] = self._ray_temp = tempfile.mkdtemp(prefix="a4-", dir=ray_temp)  # short: socket paths
        # A process that ends without shutting its cluster down (a notebook's kernel, a script's last line) still
        # leaves nothing: Ray's own exit handler ends the nodes, this removes the directories they ran in.
        atexit.register(self.shutdown)
        # The head's processes (its Ray Client proxy, its dashboard, its log monitor) take these from this process.
        monitoring = self.prometheus.head_env() if self.prometheus else {}
        with _environ({**HEAD_ENV, **SIMULATED_HEAD_ENV, **monitoring}), \
                _unadvertised(private=not self.shared):
            self.cluster = _start_node("the simulated cluster's head", fresh=fresh_ports, start=lambda: Cluster(
                initialize_head=True, head_node_args=head, shutdown_at_exit=True))
        write_ray_address(self.cluster.address, head["temp_dir"])
        if self.prometheus:
            self.prometheus.start(self.cluster.head_node.get_session_dir_path())
        for index in range(self.nodes):
            self.add_node(index)
        if self.dashboard:
            self._wait_for_the_job_agent(head["dashboard_agent_listen_port"])
        return self.address

    def _wait_for_the_job_agent(self, port: int, wait_s: float = 60.0) -> None:
        """Jobs are submitted through the head's dashboard to its agent, which comes up after the dashboard (Ray
        answers "No available agent to submit job" meanwhile): wait until the agent answers KubeRay's readiness
        probe (`/api/local_raylet_healthz` on its port), as a RayCluster's head pod is ready only then."""
        why = ports.wait_http(f"http://{self.host}:{port}/api/local_raylet_healthz", wait_s)
        if why is not None:
            warn(f"the head's dashboard agent did not answer within {wait_s:.0f} s ({why}); job submissions wait for it")

    def add_node(self, index: int | None = None, *, machine_type: str | None = None, gpus: int | None = None,
                 env: dict[str, str] | None = None):
        """Start simulated node `index` (default: the next free index), of `machine_type` with `gpus` logical GPUs
        (default: the cluster's), `env` added to its processes' environment; returns its Ray node."""
        assert self.cluster is not None
        if index is None:
            index = max(self.workers, default=-1) + 1
        machine_type = machine_type or self.machine_type
        env = {LOCAL_ROOT_ENV: self.root, **_python_first(), **self._separate_host_env(index), **self._cpu_share(),
               **self.node_env.get(index, {}), **(env or {})}
        if gpus is None and self._gpu_slices is not None and (index + 1) * self.gpus_per_node <= len(self._gpu_slices):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                self._gpu_slices[index * self.gpus_per_node:(index + 1) * self.gpus_per_node])
        labels = {**simulated_location(index, self.topology), SIMULATED_LABEL: "true",
                  "a4ray.io/machine-type": machine_type}
        ip = {"node_ip_address": self.ip(index)} if self.loopback_ips else {}
        node = _start_node(f"simulated node {index}", lambda: self.cluster.add_node(
            num_cpus=self.cpus_per_node, num_gpus=self.gpus_per_node if gpus is None else gpus,
            resources={machine_type: 1}, labels=labels, env_vars=env, object_store_memory=self.object_store_mb * 2**20,
            # Each machine unpacks a job's working_dir into its own runtime-resources directory, and each node's agent
            # replaces that copy when it first sets the job up. Simulated nodes share one session directory: in a
            # shared one, node 1 would delete the copy node 0's processes run in.
            runtime_env_dir_name=f"runtime_resources_node{index}", **ip,
            node_name=labels[self.topology.host_label],  # the dashboard's Cluster page: not one hostname thrice
        ))
        self.workers[index] = node
        return node

    def _cpu_share(self) -> dict[str, str]:
        """Simulated nodes share this machine's cores, so each rank gets its share of them (OMP_NUM_THREADS,
        the node's own setting: its programs keep it), as a rank on a machine of its own gets that machine's.
        Without it every rank of every node starts a thread per core: 4 ranks on 2 cores spent 8-10 s in the
        first Megatron iteration, which takes 0.35 s with one thread each. A value in this process's env is kept."""
        if "OMP_NUM_THREADS" in os.environ:
            return {}
        ranks = self.nodes * max(1, self.gpus_per_node)
        return {"OMP_NUM_THREADS": str(max(1, machine_cores() // ranks))}

    def _separate_host_env(self, index: int) -> dict[str, str]:
        """What makes simulated nodes as separate as machines where it matters, for OpenMPI. Simulated
        nodes share one hostname, /dev/shm and /tmp, and OpenMPI keys its per-host files by hostname:
        - each node gets its own TMPDIR, so its OpenMPI session directory (TMPDIR/ompi.HOST.UID/jf.N) is
          its own: an orted starting clears stale job directories there, which on a shared /tmp would
          delete the live ones of the other nodes' daemons of the same job, failing their start now and
          then (TMPDIR is no MCA parameter, so mpirun does not hand node 0's to the other daemons);
        - ranks of two nodes would map each other's shared-memory segments (named by node-local rank)
          and crash: their ranks talk TCP instead, as ranks on separate machines do, over loopback,
          which every simulated node shares (OpenMPI skips loopback by default, and a CI container
          may have no other interface);
        - every node's daemon would write the same hwloc topology file (hwloc.sm) at once, which now
          and then crashes one: the daemons do not share their topology through a file.
        - each node gets a RAM disk of its own for its local checkpoints (NODE_LOCAL_ENV, under its TMPDIR), which
          `remove_node` takes along, as a lost machine takes its /dev/shm.
        mpirun forwards OMPI_MCA_* to every daemon, so those settings are the same on every node."""
        assert self._tmp_root is not None
        tmp = self._node_dir(index)  # short: OpenMPI puts unix sockets under it
        os.makedirs(tmp, exist_ok=True)
        return {"TMPDIR": tmp, NODE_LOCAL_ENV: os.path.join(tmp, "shm"), "OMPI_MCA_btl": "^vader", "OMPI_MCA_btl_tcp_if_include": "lo",
                "OMPI_MCA_oob_tcp_if_include": "lo", "OMPI_MCA_rtc_hwloc_vmhole": "none"}

    def _node_dir(self, index: int) -> str:
        """Simulated node `index`'s own /tmp (TMPDIR) and, under it, its own RAM disk (runtime/node_local.py)."""
        assert self._tmp_root is not None
        return os.path.join(self._tmp_root, f"n{index}")

    def remove_node(self, index: int) -> None:
        """Kill simulated node `index` abruptly, as a lost A4 node would be: its processes, and its /tmp and RAM disk
        (its local checkpoints) with it."""
        import psutil

        assert self.cluster is not None
        node = self.workers.pop(index)
        # A lost machine takes every process on it along: the raylet's workers and what they launched
        # (which would otherwise live on as orphans here, still computing, still writing checkpoints).
        doomed = []
        for info in node.all_processes.get("raylet", []):
            try:
                doomed += psutil.Process(info.process.pid).children(recursive=True)
            except psutil.Error:
                pass
        for proc in doomed:
            try:
                proc.kill()
            except psutil.Error:
                pass
        self.cluster.remove_node(node, allow_graceful=False)
        shutil.rmtree(self._node_dir(index), ignore_errors=True)

    def _disconnect(self) -> None:
        """This process leaves the cluster first where it is connected to it (`ray.init(address=...)`): Ray refuses to
        remove the head a driver is connected to, and at exit its own handler may run only after this one."""
        import ray

        if ray.is_initialized() and ray.get_runtime_context().gcs_address == self.address:
            ray.shutdown()

    def describe(self) -> str:
        gpus = "real GPU slices" if self._gpu_slices else "logical GPUs"
        return (f"{self.name} at {self.address}: {self.nodes} simulated {self.machine_type} "
                f"node(s) x {self.gpus_per_node} GPUs ({gpus}); Ray token authentication on")

    def shutdown(self) -> None:
        if self.prometheus:
            self.prometheus.stop()
        if self.cluster is not None:
            say(f"shutting down the {self.name}")
            self._disconnect()
            left_behind = _forkserver_dirs(self.cluster.head_node)
            with _unadvertised(private=not self.shared):  # Ray's shutdown removes the machine's record, whosever
                self.cluster.shutdown()
            self.cluster = None
            self.workers = {}
            for path in left_behind:
                shutil.rmtree(path, ignore_errors=True)
            # Launches whose reaper ended with its node (a node lost, the cluster shut down) leave their pipe
            # directories; their owners are gone now. As `a4ray local down` does.
            sweep_flight_recorder_pipes()
        for made in (self._tmp_root, self._ray_temp):  # its runs keep their own logs (the run directory)
            if made is not None:
                shutil.rmtree(made, ignore_errors=True)
        self._tmp_root = self._ray_temp = None
        atexit.unregister(self.shutdown)
        if self._loopback is not None:
            self._loopback.release()
            self._loopback = None
        while self._undo:
            self._undo.pop()()
