"""Shared fixtures: one real multi-node local Ray cluster of simulated A4 nodes for the whole session.

Tests that damage nodes (remove them) or need nodes with an environment of their own take `extra_nodes`:
nodes added to the session cluster for the test, of a machine type of their own (so only the test's gang
lands on them), removed after it: seconds, where a cluster of their own costs a cluster's start and the
session's reconnect. Subprocess tests that must not find the session cluster run with
`isolated_env()` (their own RAY_TMPDIR, no RAY_ADDRESS).

`make test` runs the suite on two pytest-xdist workers side by side (`-n 2 --dist loadfile`, see the Makefile):
each worker has its own session cluster (its own loopback block of node addresses) and takes whole modules.
So a test must not assume it is alone on the machine: it finds its own processes by a marker of its own (a launch
id, a tmp path, its RAY_TMPDIR) or below its own process tree, and takes free ports.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import ray

from a4ray.core import ports
from a4ray.runtime.connect import NAMESPACE
from a4ray.runtime.simulated import SimulatedCluster
from a4ray.spec import load_job

pytest_plugins = ["suite_guard"]  # the suite leaves nothing behind, and counts its Ray clusters

REPO = Path(__file__).resolve().parents[1]
SESSION_NODES = 3
SESSION_GPUS = 2
# A secret in the session nodes' environment, as kuberay.secrets puts one on A4 (specs never hold one).
NODE_SECRET = "a4ray-nodeSECRET-0123456789abcdef"


# The longest modules first, longest to shortest (their durations in a `make test` run), so that on xdist workers
# (`-n 2 --dist loadfile --no-loadscope-reorder`) no long module starts last and runs alone: the suite ends on the
# modules of a few seconds, and both workers finish within seconds of each other. The rest keep their order.
LONGEST_FIRST = ["test_pipeline", "test_culprits", "test_dashboard", "test_gang", "test_convert", "test_api",
                 "test_local_up", "test_early_end", "test_observe", "test_cli", "test_nccl_test", "test_notebooks",
                 "test_swift_contract", "test_deepep", "test_staging", "test_k8s_client", "test_ranks", "test_mpi",
                 "test_group_signal", "test_dead_rank", "test_upstream_contracts", "test_goodput", "test_doctor",
                 "test_chaos", "test_k8s_render", "test_bad_input", "test_stream_rules"]


WATCHDOG_DEFAULTS_ENV = "A4RAY_TEST_WATCHDOG_DEFAULTS"  # where tests/watchdog_defaults.py's background runs are


def pytest_configure(config):
    """A suite started as a background job of a script (`nohup make test &`) inherits SIGINT ignored, as POSIX
    has shells start those, and every process a test starts would inherit it too: a driver that a test stops
    with Ctrl-C's signal then rightly runs on to its end (a local run of the suite failed so). The suite's
    processes take SIGINT as a terminal's Ctrl-C."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_finish(session):
    """Start the watchdog-defaults runs (minutes each, idle while they wait) as the suite starts, once, where their
    tests are among those selected (not for --collect-only, nor where -k or a path leaves them out). Under xdist the
    controller collects no test (this hook does not run there): the first worker to make the run's directory (named
    by xdist's test-run id, which every worker shares) starts them."""
    if WATCHDOG_DEFAULTS_ENV in os.environ or session.config.option.collectonly:
        return
    if not any(item.path.name == "test_watchdog_defaults.py" for item in session.items):
        return
    from watchdog_defaults import start  # noqa: PLC0415 - tests/ is on sys.path only once pytest has configured

    run_id = getattr(session.config, "workerinput", {}).get("testrunuid") or str(os.getpid())
    root = Path(tempfile.gettempdir()) / f"a4ray-watchdog-defaults-{run_id}"
    os.environ[WATCHDOG_DEFAULTS_ENV] = str(root)
    try:
        root.mkdir()
    except FileExistsError:  # another worker has started them
        return
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", WATCHDOG_DEFAULTS_ENV)}
    start(root, {**env, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "token"})


def pytest_sessionfinish(session):
    """The Ray temp directories of this process's tests' own clusters (isolated_env), which ended with their tests:
    outside pytest's tmp_path, they were left in /tmp by every run (774 of them, 1.4 GB, on a machine of many runs)."""
    for ray_tmp in _RAY_TMPDIRS:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(autouse=True)
def _its_clusters_end_with_it():
    """What a test started in its own Ray temp directories (`isolated_env`: its drivers' embedded clusters, a `local
    up`) ends with it, passed, failed or stopped by its timeout mid-run (pytest-timeout interrupts the test, and a
    killed driver leaves its Ray node processes running): they are ended here, and the test errors naming them where
    nothing else failed. Directories of module and session fixtures (made before this runs) are theirs to end."""
    first = len(_RAY_TMPDIRS)
    yield
    left = []
    for ray_tmp in _RAY_TMPDIRS[first:]:
        wait_gone(str(ray_tmp), within_s=15)  # those ending on their own
        for proc in live_mentioning(str(ray_tmp)):
            left.append(" ".join(proc.cmdline())[:200])
            with contextlib.suppress(psutil.Error):
                proc.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, "the test left these running (ended now):\n" + "\n".join(left)


# A test that takes one of these runs on a Ray cluster: it is `slow`, out of the quick tier (`make test-quick`, which
# fails where a test it runs starts a cluster anyway: tests/suite_guard.py counts them).
CLUSTER_FIXTURES = {"_session_cluster", "local_cluster", "extra_nodes", "shared_local_up"}


def pytest_collection_modifyitems(items):
    for item in items:
        if CLUSTER_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each module's own order kept


@pytest.fixture(scope="session")
def _session_cluster():
    cluster = SimulatedCluster(SESSION_NODES, SESSION_GPUS,
                               node_env={i: {"A4RAY_TEST_API_KEY": NODE_SECRET} for i in range(SESSION_NODES)})
    cluster.start()
    yield cluster
    cluster.shutdown()  # this process still connected (local_cluster): the shutdown disconnects it first
    assert not ray.is_initialized() or ray.get_runtime_context().gcs_address != cluster.address


@pytest.fixture
def local_cluster(_session_cluster):
    """3 simulated A4 nodes x 2 logical GPUs, shared by the session; this process is connected to it."""
    if ray.is_initialized() and ray.get_runtime_context().gcs_address != _session_cluster.address:
        ray.shutdown()
    if not ray.is_initialized():
        ray.init(address=_session_cluster.address, namespace=NAMESPACE)
    return _session_cluster


class ExtraNodes:
    """Simulated nodes a test added to the session cluster: its spec runs on them with `self.sets` (their
    machine type); `workers` and `remove_node` number them 0.. as a cluster of their own would."""

    def __init__(self, session: SimulatedCluster, machine_type: str):
        self.session, self.machine_type = session, machine_type
        self.workers: dict[int, object] = {}  # 0.. -> ray._private.node.Node
        self._index: dict[int, int] = {}  # 0.. -> the node's index in the session cluster
        self._added = 0  # nodes added so far: the next one's index

    @property
    def address(self) -> str:
        return self.session.address

    @property
    def sets(self) -> list[str]:
        return [f"cluster.machine_type={self.machine_type}"]

    def add(self, index: int, session_index: int, gpus: int, env: dict[str, str]) -> None:
        self.workers[index] = self.session.add_node(session_index, machine_type=self.machine_type, gpus=gpus, env=env)
        self._index[index] = session_index
        self._added = max(self._added, index + 1)

    def grow(self, gpus: int = 1) -> int:
        """One more node of the group's machine type (a recreated pod, a repaired machine); returns its index."""
        index = self._added
        self.add(index, next(_extra_node_index), gpus, {})
        return index

    def ip(self, index: int) -> str:
        """Node `index`'s own address (its Ray node IP)."""
        return self.session.ip(self._index[index])

    def remove_node(self, index: int) -> None:
        """Kill node `index` abruptly, as a lost A4 node would be."""
        self.workers.pop(index)
        self.session.remove_node(self._index.pop(index))

    def remove_all(self) -> None:
        for index in list(self.workers):
            self.remove_node(index)


_extra_node_index = iter(range(SESSION_NODES + 1, 250))  # never reused: each node its own address and host label


@pytest.fixture
def extra_nodes(local_cluster, request):
    """Factory: `extra_nodes(nodes=2, gpus=1, node_env={1: {...}})` adds nodes to the session cluster for this
    test, all of a machine type no other node has; build the test's spec with `+ nodes.sets`. They are removed
    after the test (those the test removed itself are gone already)."""
    made: list[ExtraNodes] = []

    def make(nodes: int = 2, gpus: int = 1, node_env: dict[int, dict[str, str]] | None = None) -> ExtraNodes:
        group = ExtraNodes(local_cluster, f"a4-test-{len(made)}-{next(_extra_node_index)}")
        made.append(group)
        for index in range(nodes):
            group.add(index, next(_extra_node_index), gpus, (node_env or {}).get(index, {}))
        return group

    yield make
    for group in made:
        group.remove_all()


def job(kind: str, *sets: str, workspace: Path | None = None):
    """A job spec of `kind` with overrides, its local workspace under `workspace` (a tmp dir)."""
    extra = [f"storage.local_workspace={workspace}"] if workspace else []
    return load_job(None, [*extra, *sets], kind=kind)


_RAY_TMPDIRS: list[Path] = []  # this process's isolated_env() Ray temp directories, removed as the session ends


def isolated_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Env for a subprocess that must start its own embedded cluster (no RAY_ADDRESS, own RAY_TMPDIR)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    ray_tmp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))  # short: Ray's socket paths have a limit
    _RAY_TMPDIRS.append(ray_tmp)
    # RAY_AUTH_MODE=token: what `a4ray local up` tells the same user to submit with (the token is in its file).
    env.update(RAY_TMPDIR=str(ray_tmp), PYTHONPATH=str(REPO), RAY_AUTH_MODE="token", **extra)
    return env


PYTHON = sys.executable


def run_to_end(cmd: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)`; where it runs past `timeout`, the test fails with the tail
    of what the command printed by then (TimeoutExpired's own message shows none of it)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        def tail(got: str | bytes | None, chars: int) -> str:
            text = got.decode(errors="replace") if isinstance(got, bytes) else got or ""
            return text[-chars:]

        pytest.fail(f"{' '.join(map(str, cmd[:3]))} ... did not end within {timeout:.0f} s (killed); it printed, last:\n"
                    f"{tail(e.stdout, 8000)}\n--- stderr ---\n{tail(e.stderr, 3000)}", pytrace=False)


def live_mentioning(marker: str) -> list[psutil.Process]:
    """Live processes whose command line mentions `marker` (a RAY_TMPDIR, a launch id, ...)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
    return found


def leftovers(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker`."""
    return [" ".join(proc.info["cmdline"]) for proc in live_mentioning(marker)]


def wait_gone(marker: str, within_s: float = 30) -> list[str]:
    deadline = time.monotonic() + within_s
    while (left := leftovers(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def fresh_checkout(tmp_path_factory) -> Path:
    """A newcomer's checkout as far as `a4ray local up` and `ray job submit --working-dir .` see it: the local
    rehearsal's job file and the repo's .gitignore line (`--working-dir .` leaves a4ray's state behind)."""
    checkout = tmp_path_factory.mktemp("checkout")
    (checkout / "jobs").mkdir()
    shutil.copy(REPO / "jobs" / "qwen3_next_local.yaml", checkout / "jobs")
    (checkout / ".gitignore").write_text(".a4ray/\n")
    return checkout



@pytest.fixture(scope="session")
def standins(tmp_path_factory) -> dict[str, Path]:
    """The tiny stand-ins (`a4ray.staging.standins.make_all`), made once for the whole run: ~25 s each time on a
    2-core machine, and identical every time (seeded). Made under a lock in the directory both xdist workers share,
    so the second worker waits for the first's. Tests of the making itself make their own."""
    import fcntl

    from a4ray.staging.standins import make_all

    shared = tmp_path_factory.getbasetemp()  # under xdist, its parent is the workers' common pytest-of-<user>/pytest-N
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
    with open(shared / "standins.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return make_all(shared / "standins")


def seed_standins(workspace: Path, made: dict[str, Path]) -> None:
    """Put the run's stand-ins where a rehearsal in `workspace` makes its own (`.a4ray/standins`, stamp and all): its
    stage step finds them current and stages them, as on a second rehearsal in one checkout."""
    source = next(iter(made.values())).parent
    shutil.copytree(source, workspace / ".a4ray" / "standins", dirs_exist_ok=True)


def run_notebook(name: str, root: Path, env: dict[str, str]) -> list:
    """notebooks/<name>.ipynb, top to bottom in a real Jupyter kernel (nbclient), from a copy in `root`/notebooks
    beside the repo's jobs/ (so its workspace, .a4ray next to where its cluster starts, is the caller's own); returns
    its code cells as executed. Every notebook is committed with its outputs cleared, runs without an error, and
    shows its results as tables and its plots as images."""
    import nbformat  # noqa: PLC0415 - the notebook extra; only the notebook tests need it
    from nbclient import NotebookClient  # noqa: PLC0415

    source = REPO / "notebooks" / f"{name}.ipynb"
    notebook = nbformat.read(source, as_version=4)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), f"{source}: clear its outputs in git"
    (root / "notebooks").mkdir(exist_ok=True)
    if not (root / "jobs").exists():
        (root / "jobs").symlink_to(REPO / "jobs")
    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(root / "notebooks")}}).execute(env=env)
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    shown = "".join(str(o.get("data", {}).get("text/html", "")) for c in code for o in c.outputs)
    assert "<table" in shown  # results render as tables in Jupyter
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)  # and plots as images
    return code


_STREAM_TAG = re.compile(r"^\[(?:n(\d+)(?: r(\d+))?|(nodes|ranks) ([\d, -]+))\] (.*)$")


def printers(stream: str, text: str) -> set[str]:
    """Who printed the line `text` in a run's stream, as "n<node>" or "r<rank>": a line several nodes or ranks printed
    is shown once with them all ("[nodes 0-1] started", "[ranks 0-3] ..."; observe/stream.py), else with its one
    printer ("[n1] started", "[n0 r1] ...")."""
    found: set[str] = set()
    for line in stream.splitlines():
        m = _STREAM_TAG.match(line)
        if not m or m[5] != text:
            continue
        if m[3] is None:
            found.add(f"r{m[2]}" if m[2] is not None else f"n{m[1]}")
            continue
        for part in m[4].split(","):
            first, _, last = part.strip().partition("-")
            found.update(f"{m[3][0]}{i}" for i in range(int(first), int(last or first) + 1))
    return found


def printed(cells: list) -> str:
    """What a notebook's cells printed (their stdout streams)."""
    return "".join(o.get("text", "") for c in cells for o in c.outputs if o.output_type == "stream")


def free_port() -> int:
    """a4ray's own chooser: below the ephemeral range, where a Ray process's outgoing connection can't take it
    between the test choosing it and its listener binding it (a suite run lost ms-swift's rendezvous so)."""
    return ports.free_port("127.0.0.1")


@dataclass(frozen=True)
class LocalUp:
    """A running `a4ray local up`: the directory it started in (its jobs' run directories are under
    `root/.a4ray`), the environment to reach it with, its job API address, its Ray Client port (0: none), the
    process and what it said up to "ready"."""

    root: Path
    env: dict[str, str]
    address: str
    client_port: int
    head: subprocess.Popen
    said: str

    @property
    def client(self) -> str:
        return f"ray://127.0.0.1:{self.client_port}"


@contextlib.contextmanager
def local_up(root: Path, env: dict[str, str], *options: str, ray_client: bool = True):
    """`a4ray local up --nodes 2 --gpus-per-node 1 <options>` in `root`, as a person starts it, on free ports,
    while the block runs. Stopped with Ctrl-C after (unless a test stopped it), its processes gone with it."""
    dashboard, client = free_port(), free_port() if ray_client else 0
    head = subprocess.Popen([PYTHON, "-m", "a4ray.cli", "local", "up", "--nodes", "2", "--gpus-per-node", "1",
                             "--dashboard-port", str(dashboard), "--client-port", str(client), *options],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said = []
    try:
        for line in head.stdout:
            said.append(line)
            if "ready" in line:
                break
        else:
            pytest.fail("a4ray local up did not come up:\n" + "".join(said))
        yield LocalUp(root, env, f"http://127.0.0.1:{dashboard}", client, head, "".join(said))
    finally:
        head.send_signal(signal.SIGINT)
        head.wait(timeout=90)
        assert not wait_gone(env["RAY_TMPDIR"])


@pytest.fixture(scope="module")
def shared_local_up(tmp_path_factory):
    """One `a4ray local up` (2 simulated nodes x 1 GPU) for a module's tests that only submit to one: each such
    test names its jobs (`--set name=...`) so that it finds its own run directories under `root`. Started on
    first use, ended with the module (it is test_cli's; a session-wide one lived on idle, once per worker); it
    must leave no process behind."""
    root = tmp_path_factory.mktemp("local-up")
    env = isolated_env(root, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    with local_up(root, env) as up:
        yield up


def scrape(pattern: str) -> list[str]:
    """Lines matching `pattern` on every alive node's Prometheus metrics endpoint."""
    lines = []
    for node in ray.nodes():
        if not node["Alive"] or not node.get("MetricsExportPort"):
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            continue
        lines += [line for line in text.splitlines() if re.search(pattern, line)]
    return lines


def scrape_until(pattern: str, done, timeout_s: float = 60) -> list[str]:
    """`scrape(pattern)` until `done(lines)` or `timeout_s`: a driver reports its metrics every few seconds."""
    deadline = time.monotonic() + timeout_s
    while not done(lines := scrape(pattern)) and time.monotonic() < deadline:
        time.sleep(1)
    return lines
