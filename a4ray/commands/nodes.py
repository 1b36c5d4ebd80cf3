"""`a4ray nodes` and `a4ray nodes forget HOST`: the workspace's node history (`core/node_history.py`): which
hosts were lost, named by a hang verdict, flagged stragglers or failed the doctor, in which run, and when."""

from __future__ import annotations

import argparse

from a4ray.commands import summary
from a4ray.core.errors import A4RayError
from a4ray.core.node_history import NodeHistory, summarize
from a4ray.driver import session
from a4ray.driver.main import error_exit


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("nodes", help=summary("nodes"))
    p.add_argument("--workspace", help="the workspace (default: this cluster's, else the local one)")
    p.add_argument("-v", "--verbose", action="store_true", help="every event, not one line per host")
    p.set_defaults(func=_show)
    nodes = p.add_subparsers(dest="nodes_command")
    forget = nodes.add_parser("forget", help="clear a host's history (after the node was repaired)")
    forget.add_argument("host", help="the host as the history names it (`a4ray nodes` lists them)")
    forget.add_argument("--workspace", help="the workspace (default: this cluster's, else the local one)")
    forget.set_defaults(func=_forget)


def _show(args: argparse.Namespace) -> int:
    history = NodeHistory(session.workspace(args.workspace))
    hosts = history.hosts()
    if not hosts:
        print(f"a4ray: no node history in {history.dir}", flush=True)
        return 0
    for host, events in hosts.items():
        print(f"{host}: {summarize(events)}", flush=True)
        if args.verbose:
            for event in events:
                print(f"    {event.line()}", flush=True)
    rate = history.failure_rate()
    print(f"failure rate: {rate.per_1000_node_days:.3g} per 1000 node-days ({rate.source}); auto checkpoint "
          "intervals use it", flush=True)
    return 0


def _forget(args: argparse.Namespace) -> int:
    history = NodeHistory(session.workspace(args.workspace))
    forgotten = history.forget(args.host)
    if not forgotten:
        known = ", ".join(history.hosts()) or "none"
        return error_exit(A4RayError(f"host {args.host!r} has no history in {history.dir} (hosts with one: {known})",
                                     hint="`a4ray nodes` lists them"))
    print(f"a4ray: forgot {forgotten} event(s) of {args.host}", flush=True)
    return 0
