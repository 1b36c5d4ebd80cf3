"""`a4ray local up`: a local Ray cluster of simulated A4 nodes that stays up until Ctrl-C.

It runs with Ray token authentication, bound to 127.0.0.1 (--host to open it to other machines). Jobs can
then be submitted to it like to a real cluster, by the same user (the token is in ~/.ray/auth_token):
    a4ray local up --nodes 2 --gpus-per-node 2
    RAY_AUTH_MODE=token RAY_ADDRESS=http://127.0.0.1:8265 ray job submit --working-dir . -- python -m a4ray.ddp_test
    python -c "import a4ray; a4ray.connect('ray://127.0.0.1:10001')"   # or a notebook, through Ray Client
"""

from __future__ import annotations

import argparse
import signal
import threading

from a4ray.core.console import say
from a4ray.core.errors import A4RayError
from a4ray.driver.main import error_exit
from a4ray.observe import prometheus
from a4ray.runtime import auth
from a4ray.runtime.simulated import SimulatedCluster


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help="a local Ray cluster of simulated A4 nodes")
    local = p.add_subparsers(dest="local_command", required=True)
    up = local.add_parser("up", help="start it in the foreground; Ctrl-C stops it")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--gpus-per-node", type=int, default=8)
    up.add_argument("--machine-type", default="a4-highgpu-8g")
    up.add_argument("--dashboard-port", type=port, default=8265)
    up.add_argument("--client-port", type=port, default=10001, help="Ray Client port (ray://127.0.0.1:PORT); 0: none")
    up.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=None,
                    help="run a Prometheus on loopback scraping the cluster, for the dashboard's Metrics page "
                    "(default: on where `prometheus` is installed)")
    up.add_argument("--host", default=auth.LOOPBACK, help="address the head binds and advertises (default: "
                    "%(default)s, this machine only; this machine's IP opens it to others, token-authenticated)")
    up.set_defaults(func=_up)


def port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(text)  # argparse: "invalid port value", naming the option
    return port


def _up(args: argparse.Namespace) -> int:
    metrics = prometheus.installed() is not None if args.metrics is None else args.metrics
    try:
        cluster = SimulatedCluster(args.nodes, args.gpus_per_node, machine_type=args.machine_type,
                                   dashboard=True, dashboard_port=args.dashboard_port,
                                   client_port=args.client_port or None, host=args.host,
                                   prometheus=prometheus.LocalPrometheus() if metrics else None)
    except A4RayError as error:  # a shape no cluster has: said before any Ray process starts
        return error_exit(error)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster.start()
        say(cluster.describe())
        host = "127.0.0.1" if args.host == "0.0.0.0" else args.host
        say(f"Ray token authentication is on; the token is in {auth.token_file()} (this user's; a4ray never prints it)")
        if cluster.dashboard_url:
            say(f"dashboard: http://{host}:{cluster.dashboard_url.rsplit(':', 1)[1]} (it asks for the token: run "
                "`ray get-auth-token` and paste what it prints into its Authentication Token field)")
        if cluster.prometheus:
            say(f"metrics: Prometheus at {cluster.prometheus.url} scrapes every node (a4ray's: ray_a4ray_*); "
                f"{prometheus.NO_GRAFANA}")
        else:
            say("metrics: no Prometheus (`apt-get install prometheus`, then --metrics): the dashboard's Metrics "
                "page stays empty")
        say(f"submit jobs with: {auth.submit_hint(f'http://{host}:{args.dashboard_port}')}python -m a4ray.ddp_test")
        if args.client_port:
            say(f"or from Python / a notebook: a4ray.connect('ray://{host}:{args.client_port}')")
        say("a4ray local up: ready (Ctrl-C to stop)")
        stop.wait()
    finally:
        cluster.shutdown()
    return 0
