"""The node actor: one per node of a gang, owning all of that node's GPUs, running its process trees.

It reports the node's facts, builds the launch environment on the node (where set_nccl_env.sh is),
starts the command in its own session at the node's priority (not the lower one Ray gives its workers),
keeps its output (per-node and per-rank log files, a bounded in-memory tail the driver polls), and stops
the whole process tree on request or when it dies.

Launches run one after another on the same actor (a test of node pairs reuses the gang). A launch with
no command is a *standby*: the node builds its env and waits. While a launch (or standby) is current,
`exec_*` runs further commands on demand in that same env, each in its own session with its own reaper
and streamed output: this is how an MPI launcher on node 0 starts OpenMPI's daemons on the other nodes
without SSH (see `a4ray.runtime.rsh`). `stop()` ends the launch and every exec'd command with it.

Warm ranks: as it starts an attempt that may be restarted, the actor starts the launcher of the next attempt with
its ranks warm (`a4ray.runtime.ranks --warm`: torch imported at the idle CPU class, waiting). A restart on this gang
hands it the attempt's command and env, instead of starting cold, where nothing a process reads at its start differs
(`_Standby.mismatch`); else it is stopped and the attempt starts cold, saying why. `stop()` leaves it standing: it is what the next attempt runs on. It ends with a launch that succeeded, and
with the actor (its reaper).
"""

from __future__ import annotations

import collections
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import BaseModel

from a4ray.core import ports
from a4ray.core.errors import EnvScriptFailed
from a4ray.core.redact import Redactor, secret_values
from a4ray.observe import flight, metrics, ras
from a4ray.observe.progress import Progress, parse_progress
from a4ray.observe.stacks import StackDump, dump_all
from a4ray.observe.straggler import ComputeWindow
from a4ray.programs.record import (  # what a4ray's rank programs print and serve
    COMPUTE_MARKER,
    FR_SOCKET_DIR_ENV,
    RESULT_MARKER,
)
from a4ray.runtime import ranks
from a4ray.runtime.node_gpus import gpu_memory_freed, gpu_order, node_gpus
from a4ray.runtime.netenv import LAUNCH_CONTRACT, EnvLayer, build_env, gib_layer, source_script
from a4ray.runtime.notice import give_notice
from a4ray.runtime.process import LAUNCH_ID_VAR, ManagedProcess, launch_processes
from a4ray.runtime.reaper import flight_recorder_pipes, make_flight_recorder_pipes, sweep_flight_recorder_pipes
from a4ray.runtime.topology import NodeFacts
from a4ray.spec.cluster import NetworkSpec, inductors_own

# torchrun --tee prefixes each worker line with "[<role><local_rank>]:".
_TORCHRUN_PREFIX = re.compile(r"^\[default(\d+)\]:")
_RANK_LAUNCHERS = ("torch.distributed.run", "a4ray.runtime.ranks")  # a node's launcher is not a rank
RANK_SITE = str(Path(__file__).resolve().parent / "rank_site")  # its sitecustomize: a rank's record at its exit
_BUFFER_LINES = 20_000
_EXEC_BUFFER_LINES = 5_000
# Once a poll has news of ranks' lines: how much longer it gathers their next ones before it answers. A rank that
# prints a line an iteration (25 ms steps in the soak) cost a Ray call each way per line, the driver's ~1 ms of CPU
# each, beside the ranks. A line of the launcher's own (a failed rank's report, a rank that ended) and the
# command's end answer at once.
_GATHER_S = 0.1


class Line(BaseModel):
    seq: int
    text: str
    at: float = 0.0  # when the node read it (`time.time()` there): what goodput's clock is, however polls batch lines
    local_rank: int | None = None
    progress: Progress | None = None  # set on iteration lines
    compute: ComputeWindow | None = None  # set on a window of every rank's compute time (the straggler check)


class NodeIdentity(BaseModel):
    """Who a node actor is, as its `__repr__` shows it in the dashboard (Actors page, log prefixes)."""

    run: str
    step: str
    node_rank: int
    host: str  # the host label (e.g. GCE's physical host), else the hostname
    ip: str
    block: str = ""  # the topology block label, where the node has one
    ranks: str = ""  # the global ranks it runs, e.g. "8-15" ("spare": none, standing by; its Repr keeps it)


class LaunchRequest(BaseModel):
    argv: list[str]  # empty: standby (build the env, serve exec requests, wait to be stopped)
    cwd: str | None = None
    env: dict[str, str] = {}  # the workload's layer
    env_scripts: list[str] = []  # sourced on the node after gIB, before the workload layer
    files: dict[str, str] = {}  # written on the node before the command starts (hostfiles, ...)
    network: NetworkSpec = NetworkSpec()
    node_rank: int
    nproc: int = 0  # local ranks whose lines carry a torchrun prefix (0: not a torchrun launch)
    log_dir: str
    launch_id: str
    grace_s: float = 10.0
    attempt: int = 0
    metric_tags: dict[str, str] = {}  # job, run: every metric of this launch carries them
    seq_length: int | None = None
    flight_recorder: bool = False
    compile_cache_env: dict[str, str] = {}  # torch.compile's and Triton's caches on shared storage (defaults only)
    warm_next: bool = False  # another attempt may follow: start its launcher, ranks warm, with this one
    warm_only: bool = False  # a spare node: run nothing, only stand by for the next attempt with `argv`'s launcher


class Poll(BaseModel):
    lines: list[Line]
    cursor: int
    dropped: int = 0
    exit_code: int | None = None
    running: bool


class LaunchInfo(BaseModel):
    env_report: list[str]
    log_file: str
    pid: int  # -1 for a standby
    ranks: str | None = None  # where a warm launcher stood by: "warm", or "cold: <why>"


class NodeRun(BaseModel):
    """What one node's launch produced."""

    exit_code: int | None
    started_at: float | None
    ended_at: float | None
    last_lines: list[str]
    records: list[dict]
    log_file: str
    standby: bool = False
    stopped: bool = False  # ended because a4ray stopped it


class _Output:
    """A bounded buffer of numbered lines that pollers wait on, ended by an exit code."""

    def __init__(self, maxlen: int):
        self._cond = threading.Condition()
        self._lines: collections.deque[Line] = collections.deque(maxlen=maxlen)
        self._seq = 0
        self._urgent = 0  # the seq of the latest line not of a rank (the launcher's, a plain command's)

    def append(self, text: str, local_rank: int | None = None, progress: Progress | None = None,
               compute: ComputeWindow | None = None) -> None:
        with self._cond:
            self._seq += 1
            self._lines.append(Line(seq=self._seq, text=text, at=time.time(), local_rank=local_rank,
                                    progress=progress, compute=compute))
            if local_rank is None and compute is None:
                self._urgent = self._seq
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def poll(self, cursor: int, wait_s: float, running: Callable[[], bool],
             exit_code: Callable[[], int | None]) -> Poll:
        """Lines after `cursor`; waits up to `wait_s` for some, then gathers ranks' lines for up to `_GATHER_S` more
        (within `wait_s`). `exit_code` is set once the command has ended and every line has been handed out."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while self._seq <= cursor and running() and time.monotonic() < deadline:
                self._cond.wait(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            gather_until = min(deadline, time.monotonic() + _GATHER_S)
            while self._urgent <= cursor < self._seq and running() and time.monotonic() < gather_until:
                self._cond.wait(timeout=max(0.0, gather_until - time.monotonic()))
            lines = [line for line in self._lines if line.seq > cursor]
            oldest = self._lines[0].seq if self._lines else self._seq + 1
            new_cursor = lines[-1].seq if lines else cursor
            # The reader appends every line before it marks the process done, so once it is done,
            # the buffer is complete.
            finished = not running() and new_cursor >= self._seq
        return Poll(lines=lines, cursor=new_cursor, dropped=max(0, oldest - cursor - 1) if lines else 0,
                    exit_code=exit_code() if finished else None, running=not finished)

    def tail(self, n: int) -> list[str]:
        with self._cond:
            return [line.text for line in list(self._lines)[-n:]]


class _Exec:
    def __init__(self, process: ManagedProcess, output: _Output):
        self.process = process
        self.output = output


_HELD_LINES = 200  # what a warm launcher may print before its launch (an import's warnings), kept for that launch


class _Standby:
    """The launcher of the next attempt with its ranks warm, started from the attempt that is training: its command,
    env and working directory, its process, and what it printed before a launch took it over."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | None):
        self.argv, self.env, self.cwd = argv, env, cwd
        self.process: ManagedProcess | None = None
        self.held: collections.deque[str] = collections.deque(maxlen=_HELD_LINES)
        self.on_line: Callable[[str], None] | None = None  # set when a launch takes it over
        self.on_exit: Callable[[], None] | None = None
        self.on_settle: Callable[[], None] | None = None
        self.lock = threading.Lock()

    def line(self, raw: str) -> None:
        with self.lock:
            if self.on_line is None:
                self.held.append(raw)
                return
        self.on_line(raw)

    def ended(self) -> None:
        if self.on_exit is not None:
            self.on_exit()

    def settle(self) -> None:
        if self.on_settle is not None:
            self.on_settle()

    def mismatch(self, argv: list[str], env: dict[str, str], cwd: str | None) -> str | None:
        """Why this standby cannot be the launch (argv, env, cwd); None where it can. Only what is set anew for each
        launch and read by a rank at its use may differ: the launcher's PER_LAUNCH_ARGS, and PER_LAUNCH_VARS of the
        env. Variables are named, never their values."""
        if self.process is None or not self.process.running:
            code = self.process.returncode if self.process is not None else None
            return f"the warm launcher had ended (exit code {code})"
        why = ranks.warm_mismatch(self.argv, argv)
        if why:
            return why
        if (cwd or None) != (self.cwd or None):
            return f"the working directory is {cwd}, not {self.cwd}"
        differ = sorted(k for k in set(env) | set(self.env) if k not in PER_LAUNCH_VARS and env.get(k) != self.env.get(k))
        return f"the env differs in {', '.join(differ)}" if differ else None

    def take(self, on_line: Callable[[str], None], on_exit: Callable[[], None], on_settle: Callable[[], None]) -> None:
        """From now on its lines and its end are the launch's; what it printed before goes first."""
        with self.lock:
            while self.held:
                on_line(self.held.popleft())
            self.on_line, self.on_exit, self.on_settle = on_line, on_exit, on_settle


class NodeActor:
    def __init__(self, identity: NodeIdentity | None = None) -> None:
        self._identity = identity
        self._iteration: int | None = None  # the latest iteration a rank of this node reported
        self._output = _Output(_BUFFER_LINES)
        self._records: list[dict] = []
        self._process: ManagedProcess | None = None
        self._standby = threading.Event()  # set while a standby launch waits to be stopped
        self._redactor = Redactor()
        self._node_log = None
        self._rank_logs: dict[int, object] = {}
        self._request: LaunchRequest | None = None
        self._env: dict[str, str] | None = None  # the current launch's env, for exec requests
        self._execs: dict[int, _Exec] = {}
        self._exec_lock = threading.Lock()
        self._next: _Standby | None = None  # the next attempt's launcher, ranks warm
        self._next_lock = threading.Lock()
        self._priority = _take_node_priority()  # None, or why this node's commands run at lower priority
        _actor_log_not_forwarded()
        sweep_flight_recorder_pipes()  # what node actors killed here before left in /tmp
        self._ray_only = _ray_worker_env()  # what Ray set for this worker alone, kept from the commands

    def __repr__(self) -> str:
        """Ray shows this as the actor's Repr on the dashboard and as the prefix of its log lines. Ray takes it once,
        when the actor starts (before any iteration); `repr()` on the actor object adds the latest iteration."""
        who = self._identity
        if who is None:
            return "NodeActor()"
        block = f" block {who.block}" if who.block else ""
        ranks = f" ranks {who.ranks}" if who.ranks else ""
        iteration = "" if self._iteration is None else f"; iteration {self._iteration}"
        return (f"NodeActor(node {who.node_rank} {who.host} {who.ip}{block}; run {who.run} step {who.step}{ranks}"
                f"{iteration})")

    # ------------------------------------------------------------------ facts
    def facts(self) -> NodeFacts:
        import ray

        ctx = ray.get_runtime_context()
        return NodeFacts(
            node_id=ctx.get_node_id(),
            ip=ray.util.get_node_ip_address(),
            hostname=socket.gethostname(),
            labels={k: v for k, v in ctx.get_node_labels().items() if not k.startswith("ray.io/")},
            gpu_ids=gpu_order(ray.get_gpu_ids()),
            python=sys.executable,
        )

    def alive(self) -> bool:
        return True

    def free_port(self) -> int:
        """A port free on this node, chosen below the ephemeral range so the kernel won't hand it out."""
        return ports.free_port()

    def executables(self, names: list[str]) -> dict[str, str | None]:
        """Each name resolved on this node: an absolute path if executable, else found on PATH, else None."""
        found: dict[str, str | None] = {}
        for name in names:
            if os.path.isabs(name):
                found[name] = name if os.path.isfile(name) and os.access(name, os.X_OK) else None
            else:
                found[name] = shutil.which(name)
        return found

    # ------------------------------------------------------------------ launch
    def launch(self, request: LaunchRequest, workload_env_name: str = "workload") -> LaunchInfo:
        if self._running() or self._standby.is_set():
            raise RuntimeError("this node actor is still running a launch; stop it first")
        self._reset(request)
        base = {k: v for k, v in os.environ.items() if k not in self._ray_only}
        node = f"node {request.node_rank} ({socket.gethostname()})"
        gib, gib_note = gib_layer(request.network, base, node)
        layers: list[EnvLayer | None] = [gib]
        notes = [gib_note] + [f"not passed on: {k}={v}, which Ray sets for the node actor's own CPU reservation"
                              for k, v in self._ray_only.items()]
        for script in request.env_scripts:
            so_far = build_env(base, layers).env  # a script extends what gIB set (LD_LIBRARY_PATH, ...)
            try:
                if not os.path.isfile(script):
                    raise FileNotFoundError("no such file")
                layers.append(EnvLayer(f"script {Path(script).name}", source_script(script, so_far)))
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                raise EnvScriptFailed(f"{node}: cannot source {script}: {e}",
                                      hint="fix the path in the spec, or install what the script belongs to "
                                      "in the image") from None
            notes.append(f"sourced {script}")
        so_far = build_env(base, layers).env
        a4ray_vars = {
            "PYTHONUNBUFFERED": "1",  # lines must stream, not arrive in 4 KiB blocks
            "A4RAY_NODE_RANK": str(request.node_rank),
            "A4RAY_ATTEMPT": str(request.attempt),  # > 0: a restart; resume from the latest checkpoint
            "PYTHONPATH": _with_a4ray_on_path(so_far.get("PYTHONPATH")),
        }
        if base.get("CUDA_VISIBLE_DEVICES"):  # Ray's list for this actor, in a set's order: local rank i must
            # take the node's i-th GPU, as torchrun on the node would (cuda:LOCAL_RANK indexes this list)
            a4ray_vars["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_order(base["CUDA_VISIBLE_DEVICES"].split(",")))
        a4ray_vars.update({k: v for k, v in request.compile_cache_env.items()
                           if k not in so_far or inductors_own(k, so_far[k])})
        if request.flight_recorder:  # defaults only: what the image or user sets wins
            a4ray_vars.update({k: v for k, v in _flight_recorder_env(request).items()
                               if k not in so_far and _FR_OLD_NAMES.get(k) not in so_far})
            # A rank that ends normally leaves its record (rank_site/sitecustomize.py): evidence when it ended early
            a4ray_vars["PYTHONPATH"] = os.pathsep.join([RANK_SITE, a4ray_vars["PYTHONPATH"]]).rstrip(os.pathsep)
        layers.append(EnvLayer("a4ray", a4ray_vars))
        layers += [EnvLayer(workload_env_name, request.env), EnvLayer("user", request.network.env)]
        launch_env = build_env(base, layers)
        launch_env.notes[:0] = notes
        self._redactor.add(secret_values(launch_env.env))
        self._env = launch_env.env

        for path, content in {} if request.warm_only else request.files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(content)
        log_dir = Path(request.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        node_log = log_dir / f"node-{request.node_rank:02d}.log"
        self._node_log = open(node_log, "a", buffering=1)
        report = launch_env.report(self._redactor)
        self._node_log.write("".join(f"# env {line}\n" for line in report))
        if request.warm_only:  # a spare: nothing runs until the next attempt takes this node
            self._node_log.write("# spare: standing by for the next attempt\n")
            if ranks.launcher_args(request.argv) is None:
                return LaunchInfo(env_report=report, log_file=str(node_log), pid=-1,
                                  ranks="cold: the launch is not a4ray's rank launcher")
            self._stand_by(request, launch_env.env)
            return LaunchInfo(env_report=report, log_file=str(node_log), pid=-1, ranks="warm")
        if not request.argv:
            self._node_log.write("# standby: serving exec requests until stopped\n")
            self._standby.set()
            return LaunchInfo(env_report=report, log_file=str(node_log), pid=-1)
        self._node_log.write(f"# argv {self._redactor.text(shlex.join(request.argv))}\n")
        self._process, ranks_start = self._warm_start(request, launch_env.env)
        if self._process is None:
            self._process = ManagedProcess(
                request.argv, env=launch_env.env, cwd=request.cwd or None, launch_id=request.launch_id,
                on_line=self._on_line, grace_s=request.grace_s, on_exit=self._launch_ended, settle=self._settle,
            )
            self._process.start()
        if request.warm_next and ranks.launcher_args(request.argv) is not None:
            self._stand_by(request, launch_env.env)
        report += [f"note: {self._priority}"] if self._priority else []
        return LaunchInfo(env_report=report, log_file=str(node_log), pid=self._process.pid or -1, ranks=ranks_start)

    def _settle(self) -> None:
        self._note(gpu_memory_freed(node_gpus()))

    def _warm_start(self, request: LaunchRequest, env: dict[str, str]) -> tuple[ManagedProcess | None, str | None]:
        """The launch on the standing-by launcher, its ranks warm, where it can be that launch, and "warm"; else
        None (start it cold) and why (None where no launcher stood by). The node log says which."""
        with self._next_lock:
            standby, self._next = self._next, None
        if standby is None:
            return None, None
        why = standby.mismatch(request.argv, env, request.cwd)
        process = standby.process
        assert process is not None
        if why is None:
            standby.take(self._on_line, self._launch_ended, self._settle)
            launch = json.dumps({"argv": request.argv[3:], "env": {**env, LAUNCH_ID_VAR: process.launch_id}})
            if process.send(launch):
                process.started_at = time.time()
                self._note("ranks warm: the launch runs on the launcher started with the last attempt (its ranks "
                           "importing torch since)")
                return process, "warm"
            why = "the warm launcher had ended"
        self._note(f"ranks cold: {why}")
        threading.Thread(target=process.terminate, daemon=True).start()
        return None, f"cold: {why}"

    def _stand_by(self, request: LaunchRequest, env: dict[str, str]) -> None:
        """Start the next attempt's launcher with its ranks warm, from launch `request`'s command and env. Its ranks
        import at the idle CPU class (`a4ray.runtime.warm`): this attempt's start and steps keep the CPU."""
        with self._next_lock:
            if self._next is not None:
                return
            # Named for the attempt it stands by for, as `ps e` shows its processes (the hand-over sets both anyway)
            env = {**env, "A4RAY_ATTEMPT": str(request.attempt + 1)}
            standby = _Standby(ranks.warm_argv(request.argv, request.attempt + 1), env, request.cwd)
            standby.process = ManagedProcess(
                standby.argv, env=env, cwd=request.cwd or None, launch_id=f"{request.launch_id}-next",
                on_line=standby.line, grace_s=request.grace_s, on_exit=standby.ended, settle=standby.settle,
                stdin=True)
            standby.process.start()
            self._next = standby
        self._note(f"the next attempt's launcher stands by, its ranks warm: pid {standby.process.pid}")

    def _end_standby(self) -> None:
        with self._next_lock:
            standby, self._next = self._next, None
        if standby is not None and standby.process is not None:
            standby.process.terminate()

    def _launch_ended(self) -> None:
        """The command has ended and its last line is in: its flight-recorder pipes go (before the supervisor
        hears of the end, which may end the gang and this actor; the launch's reaper is the backstop)."""
        if self._request is not None:
            shutil.rmtree(flight_recorder_pipes(self._request.launch_id), ignore_errors=True)
        if self._process is not None and self._process.returncode == 0 and not self._process.stopped:
            threading.Thread(target=self._end_standby, daemon=True).start()  # no attempt will follow a success
        self._output.wake()

    def _reset(self, request: LaunchRequest) -> None:
        """Forget the previous launch (its logs stay on disk); an exec'd command still running ends now."""
        for leftover in self._execs.values():
            if leftover.process.running:
                leftover.process.terminate(request.grace_s)
        self._close_logs()
        self._request = request
        self._output = _Output(_BUFFER_LINES)
        self._records = []
        self._process = None
        self._execs = {}

    def _close_logs(self) -> None:
        for f in [self._node_log, *self._rank_logs.values()]:
            if f is not None:
                f.close()
        self._node_log = None
        self._rank_logs = {}

    def _on_line(self, raw: str) -> None:
        text = self._redactor.text(raw)
        local_rank = None
        body = text
        if self._request and self._request.nproc:
            m = _TORCHRUN_PREFIX.match(text)
            if m:
                local_rank = int(m.group(1))
                body = text[m.end():]
        progress = parse_progress(body) if "iteration" in body else None
        if progress is not None:
            self._record(progress, local_rank)
        if body.startswith(RESULT_MARKER):
            try:
                self._records.append(json.loads(body[len(RESULT_MARKER):]))
            except json.JSONDecodeError:
                pass
        compute = ComputeWindow.parse(body) if body.startswith(COMPUTE_MARKER) else None
        self._write_logs(text, body, local_rank)
        self._output.append(body, local_rank, progress, compute)
        self._to_actor_log(body, local_rank)

    def _record(self, progress: Progress, local_rank: int | None) -> None:
        request = self._request
        assert request is not None
        self._iteration = progress.iteration
        rank = str(request.node_rank * request.nproc + local_rank) if local_rank is not None else ""
        tags = {**request.metric_tags, "node": str(request.node_rank), "rank": rank}
        try:
            metrics.record_progress(progress, tags, request.seq_length)
        except Exception:  # noqa: BLE001 - metrics are an aid; a metrics hiccup must not kill the launch
            pass

    def _to_actor_log(self, body: str, local_rank: int | None) -> None:
        """The line in this actor's own log (its stdout: the dashboard's Log tab of the actor), tagged as the
        driver streams it. Ray would also forward the actor's stdout to the driver, which streams every line
        already: `_actor_log_not_forwarded` keeps it out of that stream."""
        assert self._request is not None
        node = self._request.node_rank
        tag = f"n{node} r{node * self._request.nproc + local_rank}" if local_rank is not None else f"n{node}"
        sys.stdout.write(f"[{tag}] {body}\n")
        sys.stdout.flush()

    def _write_logs(self, text: str, body: str, local_rank: int | None) -> None:
        assert self._request is not None
        if self._node_log:
            self._node_log.write(text + "\n")
        if local_rank is not None:
            rank = self._request.node_rank * self._request.nproc + local_rank
            f = self._rank_logs.get(rank)
            if f is None:
                f = self._rank_logs[rank] = open(Path(self._request.log_dir) / f"rank-{rank:04d}.log", "a", buffering=1)
            f.write(body + "\n")

    # ------------------------------------------------------------------ exec on demand
    def exec_start(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> int:
        """Start `argv` on this node in the current launch's env (plus `env`); returns its exec id."""
        if self._env is None or self._request is None:
            raise RuntimeError("no launch on this node: exec runs in a launch's env (a standby launch will do)")
        with self._exec_lock:
            exec_id = len(self._execs) + 1
            output = _Output(_EXEC_BUFFER_LINES)
            tag = f"[exec {exec_id}]"

            def on_line(raw: str) -> None:
                text = self._redactor.text(raw)
                if self._node_log:
                    self._node_log.write(f"{tag} {text}\n")
                output.append(text)

            process = ManagedProcess(
                argv, env={**self._env, **(env or {})}, cwd=cwd or self._request.cwd or None,
                launch_id=f"{self._request.launch_id}-x{exec_id}", on_line=on_line,
                grace_s=self._request.grace_s, on_exit=output.wake,
            )
            if self._node_log:
                self._node_log.write(f"{tag} argv {self._redactor.text(' '.join(argv))}\n")
            process.start()
            self._execs[exec_id] = _Exec(process, output)
        return exec_id

    def exec_poll(self, exec_id: int, cursor: int, wait_s: float = 1.0) -> Poll:
        run = self._execs[exec_id]
        return run.output.poll(cursor, wait_s, lambda: run.process.running, lambda: run.process.returncode)

    def exec_stop(self, exec_id: int, grace_s: float | None = None) -> int | None:
        return self._execs[exec_id].process.terminate(grace_s)

    # ------------------------------------------------------------------ supervision
    def poll(self, cursor: int, wait_s: float = 1.0) -> Poll:
        """The launch's lines after `cursor` (see `_Output.poll`). A standby never ends by itself."""
        exit_code = lambda: self._process.returncode if self._process else None  # noqa: E731
        return self._output.poll(cursor, wait_s, self._live, exit_code)

    def _running(self) -> bool:
        return self._process is not None and self._process.running

    def _live(self) -> bool:
        return self._running() or self._standby.is_set()

    def notice(self, grace_s: float) -> tuple[int, bool]:
        """A stop with notice (runtime/notice.py): the launch's ranks save and end. Waits up to `grace_s` for the
        launch to end by itself; returns (ranks told, whether it ended in time)."""
        p = self._process
        if p is None or p.pid is None or not p.running:
            return 0, True
        told = give_notice(p.pid, p.launch_id)
        p.wait(grace_s)
        return told, not p.running

    def stop(self, grace_s: float | None = None) -> int | None:
        """Terminate the launch's whole process tree and every exec'd command (SIGTERM, wait, SIGKILL)."""
        processes = [e.process for e in self._execs.values()]
        if self._process is not None:
            processes.append(self._process)
        if processes:
            with ThreadPoolExecutor(len(processes)) as pool:  # in parallel: one grace period, not N
                list(pool.map(lambda p: p.terminate(grace_s), processes))
        if self._standby.is_set() and self._request is not None:  # no command, so no reaper to remove them
            shutil.rmtree(flight_recorder_pipes(self._request.launch_id), ignore_errors=True)
        self._standby.clear()
        self._output.wake()
        return self._process.returncode if self._process else None

    def _note(self, text: str | None) -> None:
        if text and self._node_log is not None and not self._node_log.closed:
            self._node_log.write(f"# {text}\n")

    def result(self) -> NodeRun:
        p = self._process
        if p is not None:
            p.wait(timeout=30)
        standby = self._request is not None and not self._request.argv
        return NodeRun(
            exit_code=p.returncode if p else None,
            started_at=p.started_at if p else None,
            ended_at=p.ended_at if p else None,
            last_lines=self._output.tail(40),
            records=list(self._records),
            log_file=self._node_log.name if self._node_log else "",
            standby=standby,
            stopped=p.stopped if p else False,
        )

    def pids(self) -> list[int]:
        """Live processes of the launch and of its exec'd commands (for forensics and tests)."""
        found = []
        for p in [self._process, *(e.process for e in self._execs.values())]:
            if p is not None and p.pid is not None:
                found += [proc.pid for proc in launch_processes(p.pid, p.launch_id)]
        return sorted(set(found))

    # ------------------------------------------------------------------ forensics and probes
    def rank_processes(self) -> list[tuple[str, int]]:
        """(rank, pid) of every process of the launch with RANK in its env: the ranks and their helpers (a data-loader
        worker, an async save's writer), which `flight.rank_labels` labels apart (a hang may sit in a helper); else
        every Python process of the launch (labelled n<node>:pid<pid>). The notice goes to the ranks alone
        (`process.rank_processes`)."""
        import psutil

        if self._process is None or self._process.pid is None or self._request is None:
            return []
        ranked, python = [], []
        for proc in launch_processes(self._process.pid, self._process.launch_id):
            try:
                env = proc.environ()
                name = proc.name()
                cmdline = " ".join(proc.cmdline())
            except psutil.Error:
                continue
            if "RANK" in env and "LOCAL_RANK" in env:
                ranked.append((env["RANK"], proc.pid))
            elif name.startswith("python") and not any(launcher in cmdline for launcher in _RANK_LAUNCHERS):
                python.append((f"n{self._request.node_rank}:pid{proc.pid}", proc.pid))
        return sorted(ranked, key=lambda rp: int(rp[0])) if ranked else python

    def stacks(self, timeout_s: float = 30) -> list[StackDump]:
        """py-spy dumps of every rank process of the launch, and of its helpers (labelled apart)."""
        if self._request is None:
            return []
        node = self._request.node_rank
        return dump_all([(label, node, pid) for label, pid in flight.rank_labels(self.rank_processes())], timeout_s)

    def flight_records(self, timeout_s: float) -> dict[int, dict | flight.NoRecord]:
        """Every rank's flight record on this node (global rank -> the record, or why there is none: no pipe,
        timed out, process gone, in teardown), each kept in `<log dir>/flight-recorder/`: every rank is asked at
        once (NCCL's debug pipe, a4ray's worker servers) and waited for until `timeout_s` (`flight.collect`)."""
        request = self._request
        if request is None or not request.flight_recorder or self._process is None:
            return {}
        out_dir = Path(request.log_dir) / "flight-recorder"
        out_dir.mkdir(parents=True, exist_ok=True)
        first = request.node_rank * request.nproc  # a launch numbers its ranks node by node
        return flight.collect(flight.rank_pids(self.rank_processes()), list(range(first, first + request.nproc)),
                              self._env or {}, flight_recorder_pipes(request.launch_id), out_dir,
                              since=self._process.started_at or 0.0, timeout_s=timeout_s)

    def ras_status(self, timeout_s: float = 3) -> ras.NodeRas:
        """What NCCL's RAS on this node says of the job's communicators (bounded by `timeout_s`), or why it says
        nothing, with this node's addresses and rank pids, which map the processes it names to global ranks."""
        node = self._request.node_rank if self._request is not None else -1
        return ras.ask(node, flight.rank_pids(self.rank_processes()), (self._env or {}).get("NCCL_RAS_ADDR"),
                       timeout_s)

    def call(self, fn, *args, **kwargs):
        """Run `fn(*args, **kwargs)` on this node (preflight checks, probes) and return its result."""
        return fn(*args, **kwargs)

    def path_writable(self, path: str) -> bool:
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            return os.access(path, os.W_OK)
        except OSError:
            return False


def _actor_log_not_forwarded() -> None:
    """Keep this actor's stdout (where `_to_actor_log` writes every rank line) in its own log only.

    Ray's log monitor forwards a worker's stdout to the driver of the job named by the last `:job_id:<hex>` line
    in it (Ray writes one when the worker takes up a job; ray/_private/log_monitor.py), and a driver prints
    only its own job's lines. The driver streams each node's lines already (the supervisor polls them, with
    their node and rank), so the actor's copy is marked as no job's (the nil job id): the dashboard still
    shows it in the actor's Log tab, and the driver's stream does not say everything twice."""
    from ray import JobID
    from ray._private import ray_constants

    sys.stdout.write(f"{ray_constants.LOG_PREFIX_JOB_ID}{JobID.nil().hex()}\n")
    sys.stdout.flush()


def _take_node_priority() -> str | None:
    """Give this actor (and so every command it starts) the niceness of the node's Ray processes.

    Ray starts its workers at `worker_niceness` (15) so that its own processes win the CPU, and whatever a
    worker starts inherits that. The node actor is the node's launcher, as torchrun's agent is when started
    directly: it and the user's programs run at the node's priority (the raylet's, its parent's), as they
    would without Ray. Lowering niceness needs CAP_SYS_NICE (A4's privileged pods have it); where it is
    missing they keep Ray's, and what each launch reports says so. Returns None, or that note."""
    import psutil

    own = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        node = psutil.Process().parent().nice()
    except (psutil.Error, AttributeError):  # no parent to ask (reparented): leave it as it is
        return None
    if node >= own:
        return None
    try:
        # Linux keeps a niceness per thread, and a child inherits its forking thread's: set every thread's
        # (threads started later inherit theirs from these).
        for thread in psutil.Process().threads():
            try:
                os.setpriority(os.PRIO_PROCESS, thread.id, node)
            except ProcessLookupError:  # a thread that has ended meanwhile
                pass
    except OSError as e:
        return (f"runs at nice {own} (Ray's for its workers), not the node's {node}: {e.strerror or e} "
                f"(lowering niceness needs CAP_SYS_NICE)")
    return None


def _ray_worker_env() -> dict[str, str]:
    """Variables Ray set in this worker's env for the worker itself, which the commands it starts must not
    inherit: OMP_NUM_THREADS, which Ray sets to a task's or actor's CPUs (the node actor reserves 1) where
    neither the node nor the job set it. The node's programs own the whole node: torchrun sets it per
    process where it starts several, a single program uses the node's cores, as without Ray. A value the
    node (the raylet's env) or the job (its runtime env) set is the user's, and stays."""
    import psutil
    import ray

    value = os.environ.get("OMP_NUM_THREADS")
    if value is None:
        return {}
    try:
        node_env = psutil.Process().parent().environ()
        job_env = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    except (psutil.Error, AttributeError):  # cannot tell whose it is: keep it
        return {}
    if "OMP_NUM_THREADS" in node_env or "OMP_NUM_THREADS" in job_env:
        return {}
    return {"OMP_NUM_THREADS": value}


def _with_a4ray_on_path(pythonpath: str | None) -> str:
    """a4ray's own modules (the DDP worker, the reaper) must import in the launched processes."""
    root = str(Path(__file__).resolve().parents[2])
    if Path(root).name in ("site-packages", "dist-packages"):
        return pythonpath or ""  # installed: importable already; never put site-packages on PYTHONPATH
    parts = [p for p in (pythonpath or "").split(os.pathsep) if p and p != root]
    return os.pathsep.join([root, *parts])


def _flight_recorder_env(request: LaunchRequest) -> dict[str, str]:
    """PyTorch's NCCL flight recorder: kept on, dumped on an NCCL timeout or when its pipe is written."""
    pipes = make_flight_recorder_pipes(request.launch_id)  # the launch's reaper removes it when the launch ends
    # TORCH_FR_* are PyTorch >= 2.7's names (the TORCH_NCCL_* ones they replace still work there).
    return {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": f"{request.log_dir}/flight-recorder/nccl_trace_rank_",
        flight.EXIT_DUMP_ENV: f"{request.log_dir}/flight-recorder/{flight.EXIT_DUMP_PREFIX}",
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{pipes}/pipe_",
        FR_SOCKET_DIR_ENV: str(pipes),  # a4ray's programs serve their record there (rank_<RANK>.sock)
    }


# What a launch sets anew for each attempt and a rank reads only when it uses it (the process group, a dump, its exit):
# a warm rank takes them at the hand-over, the node's place in the gang (torchrun's contract) among them. Any other
# difference in the env makes the next attempt a cold one.
PER_LAUNCH_VARS = {"A4RAY_ATTEMPT", "A4RAY_NODE_RANK", *LAUNCH_CONTRACT, "TORCH_FR_DUMP_TEMP_FILE",
                   "TORCH_NCCL_DEBUG_INFO_PIPE_FILE", flight.EXIT_DUMP_ENV, FR_SOCKET_DIR_ENV}

# A variable set under either name is the user's choice.
_FR_OLD_NAMES = {"TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
                 "TORCH_FR_DUMP_TEMP_FILE": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
