"""`a4ray local up | down | status`: a local Ray cluster of simulated A4 nodes, in the foreground until Ctrl-C
or `a4ray local down`.

It runs with Ray token authentication, bound to 127.0.0.1 (--host to open it to other machines). Jobs can
then be submitted to it like to a real cluster, by the same user (the token is in ~/.ray/auth_token):
    a4ray local up --nodes 2 --gpus-per-node 1
    RAY_AUTH_MODE=token RAY_ADDRESS=http://127.0.0.1:8265 ray job submit --working-dir . -- python -m a4ray.qwen3_next
    python -c "import a4ray; a4ray.connect('ray://127.0.0.1:10001')"   # or a notebook, through Ray Client
    a4ray local status; a4ray local down

A running `local up` records itself (pid, addresses, shape) in a file of its own next to the address file Ray
keeps for the cluster running on this machine, in Ray's temp directory (RAY_TMPDIR): `status` and `down` read
them there. Several may run at once, each on its own ports (tests do).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
from ray._common.utils import get_ray_address_file  # Ray's own rule for where its temp directory is

from a4ray.commands import summary
from a4ray.core.console import say
from a4ray.core.errors import A4RayError
from a4ray.core.liveness import start_mark, still_running
from a4ray.driver.main import error_exit
from a4ray.observe import prometheus
from a4ray.runtime import auth
from a4ray.runtime.reaper import sweep_flight_recorder_pipes
from a4ray.runtime.simulated import SimulatedCluster
from a4ray.spec.job import ClusterJob
from a4ray.spec.overrides import validate

NAME = "local Ray cluster (a4ray local up)"
HEADLINE = "python -m a4ray.qwen3_next"  # the README's main job: on simulated nodes it rehearses
_STOP_WAIT_S = 120  # `down`: how long the cluster has to shut down (its nodes' raylets, the head)
SHAPE = {"nodes": "--nodes", "gpus_per_node": "--gpus-per-node", "machine_type": "--machine-type"}  # cluster.*


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help=summary("local"), description=summary("local"))
    local = p.add_subparsers(dest="local_command", required=True, metavar="{up,down,status}")
    up = local.add_parser("up", help="start it in the foreground; Ctrl-C or `a4ray local down` stops it",
                          description="Start a local Ray cluster of simulated A4 nodes (each a real Ray node with "
                          "logical GPUs and A4's topology labels) and keep it up until Ctrl-C or `a4ray local down`.")
    up.add_argument("--nodes", type=int, default=2, metavar="N", help="simulated A4 nodes (default: %(default)s)")
    up.add_argument("--gpus-per-node", type=int, default=8, metavar="G",
                    help="GPUs each node advertises (default: %(default)s, as a4-highgpu-8g; logical where this "
                    "machine has fewer, real slices where it has nodes x G)")
    up.add_argument("--machine-type", default="a4-highgpu-8g", metavar="TYPE",
                    help="the machine-type resource each node advertises, which job specs ask for "
                    "(cluster.machine_type; default: %(default)s)")
    up.add_argument("--dashboard-port", type=port, default=8265, metavar="PORT",
                    help="the Ray dashboard and its job API, where `ray job submit` goes (default: %(default)s)")
    up.add_argument("--client-port", type=port, default=10001, metavar="PORT",
                    help="Ray Client port (ray://127.0.0.1:PORT, for a4ray.connect and notebooks; default: "
                    "%(default)s); 0: none")
    up.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=None,
                    help="run a Prometheus on loopback scraping the cluster, for the dashboard's Metrics page "
                    "(default: on where `prometheus` is installed)")
    up.add_argument("--host", default=auth.LOOPBACK, help="address the head binds and advertises (default: "
                    "%(default)s, this machine only; this machine's IP opens it to others, token-authenticated)")
    up.set_defaults(func=_up)
    down = local.add_parser("down", help="stop the clusters `a4ray local up` runs here (as Ctrl-C in its "
                            "terminal does)")
    down.add_argument("--pid", type=int, help="only the one of this process (`a4ray local status` lists them)")
    down.set_defaults(func=_down)
    status = local.add_parser("status", help="whether `a4ray local up` runs here: each one's nodes, addresses and "
                              "pid; exit code 1 if none")
    status.set_defaults(func=_status)


def records_dir() -> Path:
    """Where each running `local up` records itself, one file per process: beside the address file of Ray's temp
    directory (RAY_TMPDIR). Several may run at once (each on its own ports): `down` and `status` see them all."""
    return Path(get_ray_address_file(None)).with_name("a4ray_local_up")


def running() -> list[dict]:
    """What each running `local up` recorded, oldest first (a record whose process is gone is stale: removed)."""
    states = []
    for path in sorted(records_dir().glob("*.json")):
        try:
            state = json.loads(path.read_text())
            alive = still_running(state["pid"], state["pid_started"])
        except (OSError, ValueError, KeyError, TypeError):  # (still_running answers False for a process gone)
            alive = False
        if alive:
            states.append(state)
        else:
            path.unlink(missing_ok=True)
    return states


def port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(text)  # argparse: "invalid port value", naming the option
    return port


def _up(args: argparse.Namespace) -> int:
    metrics = prometheus.installed() is not None if args.metrics is None else args.metrics
    try:
        # The shape's limits are a cluster spec's; an error names the option as typed (--nodes 0).
        shape = {field: getattr(args, field) for field in SHAPE}
        validate(ClusterJob, {"cluster": shape}, NAME,
                 {("cluster", field): f"{flag} {shape[field]}" for field, flag in SHAPE.items()})
        cluster = SimulatedCluster(args.nodes, args.gpus_per_node, machine_type=args.machine_type,
                                   dashboard=True, dashboard_port=args.dashboard_port,
                                   client_port=args.client_port or None, host=args.host, name=NAME, shared=True,
                                   prometheus=prometheus.LocalPrometheus() if metrics else None)
    except A4RayError as error:  # a shape no cluster has: said before any Ray process starts
        return error_exit(error)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    record = records_dir() / f"{os.getpid()}.json"
    try:
        cluster.start()
        say(cluster.describe())
        host = "127.0.0.1" if args.host == "0.0.0.0" else args.host
        jobs = f"http://{host}:{cluster.dashboard_url.rpartition(':')[2] if cluster.dashboard_url else args.dashboard_port}"
        client = f"ray://{host}:{args.client_port}" if args.client_port else None
        say(f"Ray token authentication is on; the token is in {auth.token_file()} (this user's; a4ray never prints it)")
        if cluster.dashboard_url:
            say(f"dashboard: {jobs} (it asks for the token: run `ray get-auth-token` and paste what it prints into "
                "its Authentication Token field)")
        if cluster.prometheus:
            say(f"metrics: Prometheus at {cluster.prometheus.url} scrapes every node (a4ray's: ray_a4ray_*); "
                f"{prometheus.NO_GRAFANA}")
        else:
            say("metrics: no Prometheus (`apt-get install prometheus`, then --metrics): the dashboard's Metrics "
                "page stays empty")
        say(f"submit jobs with: {auth.submit_hint(jobs)}{HEADLINE}")
        if client:
            say(f"or from Python / a notebook: a4ray.connect('{client}')")
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({
            "pid": os.getpid(), "pid_started": start_mark(), "address": cluster.address,
            "dashboard": jobs, "client": client, "nodes": args.nodes, "gpus_per_node": args.gpus_per_node,
            "machine_type": args.machine_type, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cwd": os.getcwd()}))
        say("a4ray local up: ready (Ctrl-C or `a4ray local down` to stop)")
        stop.wait()
    finally:
        cluster.shutdown()
        record.unlink(missing_ok=True)
    return 0


def _down(args: argparse.Namespace) -> int:
    states = [st for st in running() if args.pid in (None, st["pid"])]
    if not states:
        say("no a4ray local up is running here (nothing to stop)" if args.pid is None else
            f"no a4ray local up runs as pid {args.pid} (`a4ray local status` lists those that do)")
    stopped = True
    for state in states:
        stopped = _stop(state) and stopped
    swept = sweep_flight_recorder_pipes()  # what node actors killed with their gangs left in /tmp
    if swept:
        say(f"removed {len(swept)} flight-recorder pipe director{'y' if len(swept) == 1 else 'ies'} of launches "
            "whose node actor is gone")
    return 0 if stopped else 1


def _stop(state: dict) -> bool:
    process = psutil.Process(state["pid"])
    say(f"stopping the {NAME} at {state['address']} (pid {state['pid']})")
    # Ctrl-C's signal: `local up` shuts its nodes and head down, then exits. (Not SIGTERM: Ray's own handler for
    # it in the head's process drains the node first and can keep the process up well past that.)
    process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + _STOP_WAIT_S
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:  # ended; its parent (a terminal, a test) reaps it
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    else:
        print(f"a4ray: error: pid {state['pid']} did not stop within {_STOP_WAIT_S}s; its terminal may say why",
              file=sys.stderr, flush=True)
        return False
    say("stopped")
    return True


def _status(args: argparse.Namespace) -> int:
    states = running()
    if not states:
        say("no a4ray local up is running here (`a4ray local up` starts one)")
        return 1
    for state in states:
        say(f"{NAME}: running since {state['started']} (pid {state['pid']}, started in {state['cwd']})")
        say(f"  {state['nodes']} simulated {state['machine_type']} node(s) x {state['gpus_per_node']} GPUs; "
            f"Ray at {state['address']}")
        say(f"  dashboard and job API: {state['dashboard']}" +
            (f"; Ray Client: {state['client']}" if state['client'] else ""))
        say(f"  submit jobs with: {auth.submit_hint(state['dashboard'])}{HEADLINE}")
    return 0
