"""a4ray's per-node rank launcher: torchrun's contract for the ranks, without torchrun's elastic agent.

The gang has already done what torchrun's agent does on a node: the nodes are placed, ranked by
topology and supervised, the master's address and port are chosen, restarts are the gang's decision.
What is left is to start this node's `nproc` rank processes with the environment torchrun gives its
workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ... : `init_process_group()` and every torchrun
script read it unchanged), tag their lines as `torchrun --tee` does, and end the node at the first
failure. The agent costs every node a `torch` import and a rendezvous round per launch (~2 CPU-seconds,
benchmarks/launch.py); this launcher is stdlib only. `cluster.launcher: torchrun` runs torchrun instead.

Rank 0 hosts the TCPStore on MASTER_PORT (env:// without an agent store). When a rank fails, the others
get SIGTERM, then SIGKILL after the grace period, and the first failure is reported in torchrun's
"Root Cause" form, so the gang names the rank either way.

Usage (built by a4ray.workloads.torchrun, never by hand):
    python -m a4ray.runtime.ranks --nnodes N --node-rank R --nproc P --master-addr A --master-port M
        [--run-id ID] [--restart-count K] [--grace-s S] -- (SCRIPT | -m MODULE) [ARGS...]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

ROLE = "default"  # torchrun's role name: its --tee prefix is "[default<local rank>]:"


def global_rank(args: argparse.Namespace, local_rank: int) -> int:
    return args.node_rank * args.nproc + local_rank


def rank_env(args: argparse.Namespace, local_rank: int, base: dict[str, str]) -> dict[str, str]:
    """The environment torchrun's agent gives local rank `local_rank` of this node."""
    world = args.nnodes * args.nproc
    rank = global_rank(args, local_rank)
    env = {
        **base,
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(args.nproc), "GROUP_RANK": str(args.node_rank),
        "GROUP_WORLD_SIZE": str(args.nnodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": ROLE, "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(args.master_port),
        "TORCHELASTIC_RUN_ID": args.run_id, "TORCHELASTIC_RESTART_COUNT": str(args.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if args.nproc > 1:  # as torchrun: several ranks must not each spawn a thread per core
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


class Node:
    """This node's rank processes, their tagged output and the first failure among them."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        self.out_lock = threading.Lock()
        self.ended = threading.Condition()
        self.first_failure: tuple[int, int, float] | None = None  # (local rank, exit code, when)
        self.stopping = False

    def start(self) -> None:
        argv = [sys.executable, "-u", *self.args.target]
        base = dict(os.environ)
        for local_rank in range(self.args.nproc):
            proc = subprocess.Popen(argv, env=rank_env(self.args, local_rank, base), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.procs.append(proc)
            reader = threading.Thread(target=self._relay, args=(local_rank, proc), daemon=True)
            reader.start()
            self.readers.append(reader)

    def _relay(self, local_rank: int, proc: subprocess.Popen) -> None:
        prefix = f"[{ROLE}{local_rank}]:".encode()
        out = sys.stdout.buffer
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            with self.out_lock:
                out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                out.flush()
        code = proc.wait()
        with self.ended:
            if code != 0 and self.first_failure is None and not self.stopping:
                self.first_failure = (local_rank, code, time.time())
            self.ended.notify_all()

    def wait(self) -> int:
        """Block until every rank has ended (stopping the rest at the first failure); the node's exit code."""
        with self.ended:
            while any(p.poll() is None for p in self.procs) and self.first_failure is None and not self.stopping:
                self.ended.wait(0.2)
        if any(p.poll() is None for p in self.procs):
            self.stop()
        for reader in self.readers:
            reader.join()
        if self.first_failure is None:
            return 0 if not self.stopping else 128 + signal.SIGTERM
        local_rank, code, when = self.first_failure
        self._report(local_rank, code, when)
        return code if code > 0 else 128 - code

    def stop(self) -> None:
        """SIGTERM every rank still running, SIGKILL what is left after the grace period."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def on_signal(self, signum, _frame) -> None:
        self.stopping = True  # the wait loop sees it within its poll interval; no lock in a handler

    def _report(self, local_rank: int, code: int, when: float) -> None:
        rank = global_rank(self.args, local_rank)
        detail = f"exitcode  : {code}" + (f" (pid terminated by {signal.Signals(-code).name})" if code < 0 else "")
        with self.out_lock:
            print("a4ray.runtime.ranks: a rank failed; the node's other ranks were stopped\n"
                  "Root Cause (first observed failure):\n"
                  f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S', time.localtime(when))}\n"
                  f"  host      : {os.uname().nodename}\n"
                  f"  rank      : {rank} (local_rank: {local_rank})\n"
                  f"  {detail}", flush=True)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m a4ray.runtime.ranks")
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--run-id", default="none")
    p.add_argument("--restart-count", type=int, default=0)
    p.add_argument("--grace-s", type=float, default=10.0)
    p.add_argument("target", nargs=argparse.REMAINDER, help="SCRIPT [ARGS] or -m MODULE [ARGS], after --")
    args = p.parse_args(argv)
    args.target = args.target[1:] if args.target[:1] == ["--"] else args.target
    if not args.target:
        p.error("nothing to run: give the script (or -m MODULE) and its arguments after --")
    if not (0 <= args.node_rank < args.nnodes) or args.nproc < 1:
        p.error(f"--node-rank {args.node_rank} must be in 0..{args.nnodes - 1} and --nproc >= 1")
    return args


def main(argv: list[str]) -> int:
    node = Node(parse(argv))
    signal.signal(signal.SIGTERM, node.on_signal)
    signal.signal(signal.SIGINT, node.on_signal)
    node.start()
    return node.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
