"""How every a4ray program run by torchrun joins its process group: NCCL on this rank's GPU, else gloo; and
how it answers a4ray's hang forensics: its flight record, served by torch's c10d worker server."""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist

from a4ray.programs.record import FR_SOCKET_DIR_ENV, fr_socket_path

_worker_server = None  # kept alive for the process's life: its C++ threads answer while Python is blocked


def init_distributed(backend: str = "auto") -> tuple[torch.device, str]:
    """Join the torchrun job's process group. `auto`: NCCL where this rank has a GPU (LOCAL_RANK picks it;
    one actor per node hands torchrun all the node's GPUs), gloo on CPU. Returns (device, backend)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > local_rank else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    serve_flight_record()
    return device, backend


def serve_flight_record() -> None:
    """Serve torch's worker server on this rank's socket in the launch's directory (`A4RAY_FR_SOCKETS`, set by
    the node actor): its `fr_trace_json` handler hands the node actor this rank's flight record on a hang,
    even while this rank's Python is blocked inside a collective (the handler is C++), on gloo as on NCCL."""
    global _worker_server
    directory = os.environ.get(FR_SOCKET_DIR_ENV)
    if not directory or _worker_server is not None:
        return
    from torch._C._distributed_c10d import _WorkerServer

    path = fr_socket_path(directory, os.environ.get("RANK", "0"))
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    try:
        _worker_server = _WorkerServer(path)
    except RuntimeError as e:  # forensics are an aid: a rank trains without them
        print(f"a4ray: flight record not served on {path}: {e}", file=sys.stderr, flush=True)
        return
    # Stopped and destroyed before the interpreter's teardown: left to it, its thread now and then outlives
    # what it serves and the rank aborts (SIGABRT, "terminate called without an active exception").
    atexit.register(_stop_serving)


def _stop_serving() -> None:
    global _worker_server
    if _worker_server is not None:
        _worker_server.shutdown()
        _worker_server = None


def exit_distributed(code: int) -> NoReturn:
    """Leave the process group and end the process with `code`. Every rank waits for the others first (the
    rank that hosts the store must not go while a peer still talks to it). The process then ends without
    the interpreter's teardown: there torch's gloo now and then aborts the process ("terminate called
    without an active exception", SIGABRT, no Python frame left; 1 in 40 two-rank runs of the DDP test on
    a 2-core machine), which would turn a rank that passed, and said so, into a failed one. What of the
    teardown matters is done here: multiprocessing's exit handlers stop the helper processes a library
    started (megatron-core's checkpoint writer starts a Manager process, which would otherwise outlive the
    rank holding its stdout open, so the launch never sees the rank's output end)."""
    dist.barrier()
    dist.destroy_process_group()
    multiprocessing.util._exit_function()  # what atexit would run: managers shut down, children joined
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
