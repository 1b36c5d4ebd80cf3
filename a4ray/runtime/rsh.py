"""A remote-shell agent over Ray, for mpirun in place of ssh: `python -m a4ray.runtime.rsh [opts] HOST CMD...`.

mpirun (OpenMPI's `plm_rsh_agent`, or MPICH Hydra's `-launcher rsh -launcher-exec`) calls it as it
would call ssh, to start its daemon on HOST. Instead of SSH, HOST's node actor runs CMD (the words
joined and run by /bin/sh, as ssh's remote shell would) in that node's launch env, in its own session
under the node actor's process-tree supervision; the agent relays the output and exits with CMD's exit
code (255 if HOST is not a node of the gang, as ssh does when it cannot connect). SIGTERM, SIGINT and
SIGHUP stop the remote command. Which gang it serves comes from A4RAY_RSH_GANG (JSON: the Ray address,
namespace and a host -> node-actor map), set by `a4ray.runtime.mpirun` on node 0; no key or secret is used.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

GANG_VAR = "A4RAY_RSH_GANG"
SSH_FAILURE = 255
# ssh options an MPI launcher may pass that take a value; any other option (-x, -q, -T, ...) is a flag.
_WITH_VALUE = {"-o", "-p", "-l", "-i", "-F"}


class _Stop(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def split_argv(argv: list[str]) -> tuple[str, list[str]]:
    """(host, command words) from an ssh-style argv; leading ssh options are accepted and ignored."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] in _WITH_VALUE else 1
    if i >= len(argv):
        raise ValueError("no host given")
    host, command = argv[i], argv[i + 1:]
    if not command:
        raise ValueError(f"no command for {host} (an interactive shell is not supported)")
    return host, command


def _error(message: str) -> int:
    print(f"a4ray.runtime.rsh: {message}", file=sys.stderr, flush=True)
    return SSH_FAILURE


def main(argv: list[str]) -> int:
    try:
        host, command = split_argv(argv)
    except ValueError as e:
        return _error(f"{e}; usage: python -m a4ray.runtime.rsh HOST COMMAND...")
    try:
        gang = json.loads(os.environ[GANG_VAR])
    except (KeyError, json.JSONDecodeError):
        return _error(f"{GANG_VAR} is not set: run mpirun through an a4ray MPI launch (a4ray.runtime.mpirun)")
    name = gang["hosts"].get(host)
    if name is None:
        return _error(f"{host} is not a node of this gang (nodes: {', '.join(sorted(gang['hosts']))})")

    def stop(signum, frame):
        raise _Stop(signum)

    import ray

    actor = exec_id = None
    try:
        ray.init(address=gang["address"], namespace=gang["namespace"], log_to_driver=False,
                 logging_level=logging.ERROR, configure_logging=True)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # after init: Ray installs its own
            signal.signal(sig, stop)
        actor = ray.get_actor(name)
        exec_id = ray.get(actor.exec_start.remote(["/bin/sh", "-c", " ".join(command)]))
        cursor = 0
        while True:
            poll = ray.get(actor.exec_poll.remote(exec_id, cursor, 1.0))
            for line in poll.lines:
                print(line.text, flush=True)
            cursor = poll.cursor
            if not poll.running:
                code = poll.exit_code if poll.exit_code is not None else SSH_FAILURE
                return code if code >= 0 else 128 - code
    except _Stop as stopped:
        if actor is not None and exec_id is not None:
            signal.signal(stopped.signum, signal.SIG_IGN)
            try:
                ray.get(actor.exec_stop.remote(exec_id, 5.0), timeout=30)
            except Exception:  # noqa: BLE001 - the gang's stop and the reapers finish the job
                pass
        return 128 + stopped.signum
    except (ray.exceptions.RayError, ValueError, ConnectionError) as e:
        return _error(f"cannot run on {host} through node actor {name}: {type(e).__name__}: {e}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
