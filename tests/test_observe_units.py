"""Progress lines, stack-dump summaries and the restart rules, on the formats the trainers really print."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from conftest import free_port

from a4ray.observe.progress import parse_progress, progress_summary
from a4ray.observe.stacks import StackDump, dump, summarize, where
from a4ray.observe.verdicts import NodeRef, Straggler
from a4ray.runtime.launch import GangResult, NodeResult
from a4ray.runtime.restart import blamed_nodes, keep_off, should_retry
from a4ray.spec.resilience import RestartSpec

MEGATRON = (" [2026-11-21 12:00:00] iteration       10/     100 | consumed samples:          640 | "
            "elapsed time per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 118.3 | "
            "learning rate: 1.000000E-05 | global batch size:    64 | lm loss: 2.345678E+00 | "
            "load_balancing_loss: 1.012345E+00 | loss scale: 1.0 | grad norm: 0.512 | "
            "number of skipped iterations:   0 | number of nan iterations:   0 |")
SWIFT_DPO = (" iteration        3/      50 | consumed samples:           12 | elapsed time per iteration (ms): "
             "13021.2 | learning rate: 9.997E-06 | global batch size:     4 | loss: 6.931472E-01 | "
             "rewards/chosen: 0.000000E+00 | rewards/accuracies: 0.000000E+00 | grad norm: 12.44 |")


def test_megatron_iteration_line():
    p = parse_progress(MEGATRON)
    assert (p.iteration, p.train_iters, p.consumed_samples) == (10, 100, 640)
    assert p.step_time_ms == 1234.5 and p.tflops_per_gpu == 118.3 and p.loss == 2.345678
    assert p.grad_norm == 0.512 and p.global_batch_size == 64 and p.learning_rate == 1e-5
    assert p.extra["load_balancing_loss"] == 1.012345 and p.extra["loss scale"] == 1.0
    assert round(p.tokens_per_second(4096)) == round(64 * 4096 / 1.2345)
    assert progress_summary(p, 4096) == ("iteration 10/100 | 1.23 s/it | 212,348 tokens/s | loss 2.346 | "
                                         "118.3 TFLOP/s/GPU | grad norm 0.512")


def test_swift_dpo_line_and_non_iteration_lines():
    p = parse_progress(SWIFT_DPO)
    assert (p.iteration, p.loss, p.grad_norm) == (3, 0.6931472, 12.44)
    assert p.extra["rewards/chosen"] == 0.0
    assert parse_progress("[rank0]: building the model, iteration 5 of the plan") is None
    assert parse_progress("no numbers here | at all") is None


PY_SPY_BLOCKED = """Process 4242: python worker.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2810)
    wrapper (torch/distributed/c10d_logger.py:81)
    train_step (/work/job/worker.py:21)
    <module> (/work/job/worker.py:40)
Thread 4300 (idle): "Thread-1 (_pin_memory_loop)"
    wait (threading.py:324)
"""
PY_SPY_SLEEPING = """Process 4243: python worker.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4243 (idle): "MainThread"
    load_batch (/work/job/worker.py:12)
    train_step (/work/job/worker.py:19)
    <module> (/work/job/worker.py:40)
"""


def test_where_and_summary():
    assert where(PY_SPY_BLOCKED) == "all_reduce (distributed_c10d.py:2810)"
    assert where(PY_SPY_SLEEPING) == "load_batch (worker.py:12)"
    dumps = [StackDump(rank=str(r), node=r // 4, pid=r, where=where(PY_SPY_BLOCKED)) for r in range(8) if r != 5]
    dumps.append(StackDump(rank="5", node=1, pid=5, where=where(PY_SPY_SLEEPING)))
    dumps.append(StackDump(rank="9", node=2, pid=9, error="py-spy dump timed out after 30s"))
    assert summarize(dumps) == ("ranks 0-4, 6-7 in all_reduce (distributed_c10d.py:2810); "
                                "rank 5 in load_batch (worker.py:12); rank 9 in unknown (py-spy dump timed out after 30s)")


# A rank in a coalesced collective whose peer never joins (rank 1 sleeps): megatron-core's gradient reduction waits
# for its buckets' all-reduces so, in C++ (work.wait()) as torch's `_coalescing_manager` exits, the innermost Python
# frame. Seen on a rank frozen mid-collective in CI.
COALESCED = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(3600)
print("coalescing", flush=True)
with dist._coalescing_manager(async_ops=False):
    dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(8))
"""


def test_a_rank_waiting_in_a_coalesced_collective_is_in_a_collective():
    """Real gloo ranks and a real py-spy dump of the waiting one."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", COALESCED], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": port}) for r in range(2)]
    try:
        assert procs[0].stdout is not None and procs[0].stdout.readline().strip() == "coalescing"
        deadline = time.monotonic() + 30
        while True:  # the event: py-spy sees it inside the coalescing manager (it waits there until killed)
            text, error = dump(procs[0].pid)
            if "_coalescing_manager" in text or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        dumped = StackDump(rank="0", node=0, pid=procs[0].pid, where=where(text))
        assert dumped.where.startswith("_coalescing_manager (distributed_c10d.py:") and dumped.in_collective, \
            (text, error)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)


def failed(kind="failed", code=1, lines=(), iterations=0) -> GangResult:
    node = NodeResult(rank=1, gang_rank=1, hostname="h", ip="1.1.1.1", node_id="x", location="", status="failed",
                      exit_code=code, last_lines=list(lines))
    return GangResult(job="j", launch_id="l", ok=False, failure=f"node 1 failed ({kind})", failure_kind=kind,
                      failed_node=1, nodes=[node], iterations_seen=iterations, last_iteration=iterations or None)


def test_restart_rules():
    policy = RestartSpec(max_restarts=2)
    assert should_retry(failed("lost"), policy, 0)[0]
    assert should_retry(failed("hang"), policy, 1)[0]
    assert not should_retry(failed("lost"), policy, 2)[0], "max_restarts reached"
    assert not should_retry(failed("timeout"), policy, 0)[0]
    assert not should_retry(failed("cancelled"), policy, 0)[0]
    assert not should_retry(GangResult(job="j", launch_id="l", ok=True), policy, 0)[0]
    nccl = ["[rank3]:[E] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)"]
    assert should_retry(failed(lines=nccl), policy, 0) == (True, "the output shows 'Watchdog caught collective operation timeout'")
    retry, why = should_retry(failed(code=2, lines=["error: unrecognized arguments: --bogus"]), policy, 0)
    assert not retry and "never_exit_codes" in why
    assert not should_retry(failed(lines=["ModuleNotFoundError: No module named 'megatron'"], iterations=3), policy, 0)[0]
    assert should_retry(failed(code=-9), policy, 0)[0]
    assert should_retry(failed(code=1, iterations=40), policy, 0) == (True, "it failed after making progress (iteration 40)")
    assert not should_retry(failed(code=1), policy, 0)[0], "a crash before the first iteration looks like config"
    assert should_retry(failed(code=7), RestartSpec(max_restarts=1, retry_exit_codes=[7]), 0)[0]
    assert not should_retry(failed("lost"), RestartSpec(max_restarts=0), 0)[0]


def test_the_next_attempt_keeps_off_the_lost_node_and_the_stragglers_with_why():
    lost = failed("lost")
    lost.nodes[0].host = "host-b"
    slow = NodeRef(node=2, host="host-c", ip="10.0.0.3")
    lost.stragglers = [Straggler(node=slow, iteration=40, step_time_s=0.9, gang_median_s=0.3, slower_pct=200,
                                 windows=3)]
    assert keep_off(lost, blamed_nodes(lost)) == {
        "host-b": "node 1 (1.1.1.1) was lost in launch l",
        "host-c": "node 2 (10.0.0.3) was a straggler in launch l, 200% slower than the gang's median"}
    # A node both lost and flagged is kept off for the failure.
    lost.stragglers[0].node = NodeRef(node=1, host="host-b", ip="1.1.1.1")
    assert keep_off(lost, blamed_nodes(lost)) == {"host-b": "node 1 (1.1.1.1) was lost in launch l"}
    crashed = failed("failed")
    assert keep_off(crashed, blamed_nodes(crashed)) == {}, "a crash is no node's fault on the evidence a4ray has"


def test_the_stream_shows_each_warning_once_and_every_traceback_whole():
    """What the driver streams of rank output (observe/stream.py), on lines as Python itself formats them:
    `warnings.formatwarning` (what `warnings.warn` prints) and `traceback.format_exception`."""
    import traceback
    import warnings

    from a4ray.observe.stream import StreamFilter
    from a4ray.programs.record import RESULT_MARKER

    warning = warnings.formatwarning("Transformer Engine and Apex are not installed.", UserWarning,
                                     "/venv/megatron/core/optimizer/__init__.py", 24, "warnings.warn(").splitlines()
    assert len(warning) == 2 and warning[1].startswith("  ")  # the message, then its source line
    try:
        {}["missing"]
    except KeyError as error:
        trace = "".join(traceback.format_exception(error)).splitlines()
    stream = StreamFilter()
    shown = []
    for rank in ("n0 r0", "n0 r1", "n1 r2", "n1 r3"):
        lines = [*warning, "WARNING:megatron.core.utils:fused kernels unavailable", MEGATRON,
                 RESULT_MARKER + '{"loss": 1.0}', "a4ray.mcore: loaded model weights", *trace]
        for text in lines:
            if stream.show(rank, text, progress=parse_progress(text) is not None):
                shown.append((rank, text))
    texts = [text for _, text in shown]
    assert texts.count(warning[0]) == 1 and warning[1] not in texts  # once, without its source line
    assert texts.count("WARNING:megatron.core.utils:fused kernels unavailable") == 1
    assert MEGATRON not in texts and not any(t.startswith(RESULT_MARKER) for t in texts)
    assert texts.count("a4ray.mcore: loaded model weights") == 4
    for rank in ("n0 r0", "n1 r3"):  # every rank's traceback, every line of it, indented lines too
        assert [t for r, t in shown if r == rank][-len(trace):] == trace
    assert stream.summary("/run/logs/train/rank-*.log") == (
        "library warnings: 2 shown once above came again from 3 rank(s); every copy is in the rank logs "
        "(/run/logs/train/rank-*.log)")
    assert stream.summary("/run/logs/train/rank-*.log") is None  # said once
    assert not stream.show("n0 r0", warning[0])  # a later launch of the run (a restart): not again
    assert "1 shown once above came again from 1 rank(s)" in stream.summary("/run/logs/train/rank-*.log")
    # A frozen module's warning (its "file" has a space): what `python -m pkg.mod` prints on every rank when the
    # package imported the module first.
    frozen = warnings.formatwarning("'a4ray.mcore.training' found in sys.modules after import of package "
                                    "'a4ray.mcore', but prior to execution", RuntimeWarning, "<frozen runpy>", 128,
                                    None).splitlines()[0]
    assert [stream.show(rank, frozen) for rank in ("n0 r0", "n0 r1", "n1 r2")] == [True, False, False]


def test_a_table_wraps_cells_at_spaces_never_inside_a_path():
    from a4ray.core.console import table

    path = "/tmp/run/.a4ray/ckpts/huggingface/Qwen3-Next-tiny-to-mcore/ae9633209ec8/" + "deep/" * 30 + "x"
    detail = f"PASS: converted {path} (native, te naming) " + "and more words " * 20
    text = table("pipeline", ["step", "detail"], [["convert", detail]])
    assert any(path in line for line in text.splitlines())  # whole, on one line, however wide that makes it
    assert all(line == line.rstrip() for line in text.splitlines())


def ras_verbose_status() -> str:
    """A `VERBOSE STATUS` answer of NCCL's RAS, built with NCCL's own format strings: src/ras/client_support.cc at
    tag v2.28.9-1 (NVIDIA/nccl), rasClientRunInit lines 542-544 (version), rasClientRunComms lines 1020 (the
    gathering time), 1174-1175 and 1213 (the table), 1225-1230 and 1280 (Errors, INCOMPLETE job processes),
    1295-1296 and 1313 (DEAD), 1336-1337 and 1348 (a communicator's INCOMPLETE), 1396-1397 (Warnings), 1413
    (MISMATCH), 1423 and 1471/1479/1485 (ranks' status), 1549, 1578 and 1588, 1595-1596, 1601-1602 (operation
    counts). C's %ld and %016lx are Python's %d and %016x. Communicator #0-0 is the issue's 2-H200 hang (rank 1
    never launched AllReduce #3); #1-0 an 8-rank one where 6 ranks launched 40 and ranks 5 (alone) and 6-7
    (together, so listed under their count) are behind; rank 9's process is dead; rank 3 of #1-0 is in teardown."""
    host = "192.0.2.2"
    out = ["NCCL version 2.28.9+cuda12.9 compiled with CUDA 12.9\n",
           "CUDA runtime version %d, driver version %d\n\n" % (12090, 12080),
           "\nCommunicators...", " (%.3fs)\n=============\n\n" % 0.012,
           "Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors\n"
           "    #  in group  per comm  per node  per comm  in group\n",
           "%5d  %8d  %8d  %8s  %8d  %8d  %8s  %6s\n" % (0, 1, 1, "2", 2, 2, "RUNNING", "MISMATCH"),
           "%5d  %8d  %8d  %8s  %8d  %8d  %8s  %6s\n" % (1, 1, 2, "4", 8, 8, "RUNNING", "INCOMPLETE,MISMATCH"),
           "\nErrors\n======\n\n",
           "INCOMPLETE\n  Missing communicator data from %d job process%s\n" % (1, ""),
           "  Process %d on node %s managing GPU%s %s\n" % (803, "192.0.2.3", "", "3"), "\n",
           "DEAD\n  %d job process%s considered dead (unreachable via the RAS network)\n" % (1, " is"),
           "  Process %d on node %s managing GPU%s %s\n" % (809, "192.0.2.3", "", "1"), "\n",
           "#%d-%d (%016x) INCOMPLETE\n  Missing communicator data from %d rank%s\n" % (1, 0, 0x5a, 1, ""),
           "  Rank %d -- GPU %s managed by process %d on node %s\n" % (3, "3", 803, "192.0.2.3"), "\n",
           "Warnings\n========\n\n",
           "#%d-%d (%016x) MISMATCH\n" % (0, 0, 0x8ac639d88b72043d),
           "  Communicator ranks have different %s operation counts\n" % "AllReduce",
           "  Rank %d has launched up to operation %d -- GPU %s managed by process %d on node %s\n"
           % (0, 3, "0", 750, host),
           "  Rank %d has launched up to operation %d -- GPU %s managed by process %d on node %s\n"
           % (1, 2, "1", 751, host), "\n",
           "#%d-%d (%016x) MISMATCH\n" % (1, 0, 0x5a),
           "  Communicator ranks have different status\n",
           "  %d ranks have status %s\n" % (7, "RUNNING"),
           "  Rank %d has status %s -- GPU %s managed by process %d on node %s\n"
           % (4, "FINALIZE", "0 (NVML 4)", 804, "192.0.2.3"),
           "  Communicator ranks have different %s operation counts\n" % "AllGather",
           "  %d ranks have launched up to operation %d\n" % (5, 40),
           "  %d ranks have launched up to operation %d\n" % (2, 39),
           "  Rank %d -- GPU %s managed by process %d on node %s\n" % (6, "2", 806, "192.0.2.3"),
           "  Rank %d -- GPU %s managed by process %d on node %s\n" % (7, "3", 807, "192.0.2.3"),
           "  Rank %d has not launched any operations -- GPU %s managed by process %d on node %s\n"
           % (5, "1", 805, "192.0.2.3"), "\n"]
    return "".join(out)


def test_nccl_ras_text_names_the_ranks_behind_and_the_dead_and_tells_teardown_from_evidence():
    from a4ray.observe.ras import parse

    report = parse(ras_verbose_status())
    assert report.version.startswith("NCCL version 2.28.9") and report.complete
    got = {(f.kind, f.comm, f.comm_rank, f.pid, f.host, f.gpu): f for f in report.findings}
    behind = got[("missing-ops", "#0-0 (8ac639d88b72043d)", 1, 751, "192.0.2.2", "1")]
    assert behind.evidence and behind.detail == ("launched up to AllReduce operation 2 while rank(s) 0 of its "
                                                 "communicator launched up to 3")
    assert ("missing-ops", "#0-0 (8ac639d88b72043d)", 0, 750, "192.0.2.2", "0") not in got  # ahead: waits
    comm = "#1-0 (000000000000005a)"
    for rank, pid, gpu in ((6, 806, "2"), (7, 807, "3")):
        assert got[("missing-ops", comm, rank, pid, "192.0.2.3", gpu)].detail.startswith(
            "launched up to AllGather operation 39 while 5 ranks of its communicator launched up to 40")
    assert got[("missing-ops", comm, 5, 805, "192.0.2.3", "1")].detail.startswith("launched no AllGather operation")
    assert got[("dead", "", None, 809, "192.0.2.3", "1")].evidence
    for teardown in (got[("unresponsive", "", None, 803, "192.0.2.3", "3")],
                     got[("unresponsive", comm, 3, 803, "192.0.2.3", "3")],
                     got[("status", comm, 4, 804, "192.0.2.3", "0 (NVML 4)")]):
        assert not teardown.evidence
    assert len(report.findings) == 8


def test_the_ras_client_speaks_ncclras_protocol_and_maps_processes_to_global_ranks():
    """A local TCP server speaking RAS's side of the protocol as src/ras/client_support.cc (v2.28.9-1) does (lines
    354-376: `CLIENT PROTOCOL` -> `SERVER PROTOCOL 2`, `TIMEOUT n` -> `OK`, `VERBOSE STATUS` -> the report, then
    the connection closed, line 467), the report from NCCL's format strings (`ras_verbose_status`)."""
    import socket
    import threading

    from a4ray.observe import ras

    server = socket.create_server(("127.0.0.1", 0))
    heard: list[str] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn, conn.makefile("rb") as lines:
            for raw in lines:
                cmd = raw.decode().strip()
                heard.append(cmd)
                if cmd.upper().startswith("CLIENT PROTOCOL "):
                    conn.sendall(b"SERVER PROTOCOL 2\n")
                elif cmd.upper().startswith("TIMEOUT "):
                    conn.sendall(b"OK\n")
                elif cmd.upper() == "VERBOSE STATUS":
                    conn.sendall(ras_verbose_status().encode())
                    return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    addr = f"127.0.0.1:{server.getsockname()[1]}"
    node = ras.ask(0, {0: 750, 1: 751}, addr, timeout_s=5)
    thread.join(timeout=5)
    server.close()
    assert heard == ["CLIENT PROTOCOL 2", "TIMEOUT 1", "VERBOSE STATUS"], heard
    assert node.report is not None and node.why == ""
    # Node 0's address as RAS names it (a simulated node's would be its own); node 1 has ranks 2-7.
    node.host_addresses = ["192.0.2.2"]
    other = ras.NodeRas(node=1, address=addr, host_addresses=["192.0.2.3"],
                        pids={2: 802, 3: 803, 4: 804, 5: 805, 6: 806, 7: 807}, why="not asked")
    found, line = ras.attribute([node, other])
    assert {r: f.kind for r, f in found.items()} == {1: "missing-ops", 3: "unresponsive", 4: "status",
                                                    5: "missing-ops", 6: "missing-ops", 7: "missing-ops"}
    assert line.startswith("NCCL RAS (2.28.9+cuda12.9): rank 1 launched up to AllReduce operation 2 while rank(s) 0")
    assert "rank 3 sent RAS no communicator data (unresponsive, or in teardown) (not evidence)" in line
    assert "considered dead by NCCL" in line and "process 809 on 192.0.2.3" in line  # not one of these ranks
    # Where nothing listens: one line says so.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{probe.getsockname()[1]}"
    silent = ras.ask(0, {0: 750}, closed, timeout_s=2)
    assert silent.report is None and silent.why.startswith(f"RAS not listening on {closed} (NCCL < 2.24")
    assert ras.attribute([silent]) == ({}, f"NCCL RAS not heard: {silent.why}")


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_watchdog_suspects_a_hang_at_the_runs_own_pace():
    """3 s per iteration, a line every iteration: suspected once 120 s (the floor, above 20 x 3 s) pass without
    one; a line every 10 iterations: 20 x 30 s; a checkpoint being saved suspends it until it is done; no_progress_s
    is the upper bound, the only alarm that ends a launch whatever an inspection finds."""
    from a4ray.observe.hang import Watchdog
    from a4ray.spec.resilience import WatchdogSpec

    pace_only = {"no_progress_s": 1800, "no_output_s": None, "look_after_s": None}
    clock = _Clock()
    dog = Watchdog(WatchdogSpec(**pace_only), clock=clock)
    dog.progress(1)
    for it in range(2, 6):
        clock.now += 3
        dog.progress(it)
        dog.progress(it)  # another rank's line of the same iteration
    clock.now += 119
    assert dog.alarm() is None
    clock.now += 2
    alarm = dog.alarm()
    assert alarm.why == ("no new iteration for 121s (after iteration 5; the run's pace: 20 x its median 3s per "
                         "iteration (60s), under observe.watchdog.pace_floor_s=120)")
    assert (alarm.window_s, alarm.bound) == (120, False)
    dog.rearm()  # an inspection found every rank computing: a whole window again from now
    clock.now += 119
    assert dog.alarm() is None
    clock.now += 2
    assert dog.alarm().why.startswith("no new iteration for 242s")

    done = Watchdog(WatchdogSpec(**pace_only), clock=clock)  # after the final iteration the ranks save and exit
    for it in range(1, 6):
        done.progress(it, last=it == 5)
        clock.now += 3
    clock.now += 600
    assert done.alarm() is None

    sparse = Watchdog(WatchdogSpec(**pace_only), clock=clock)
    for it in (1, 10, 20, 30):  # Megatron-LM's first line, then every log_interval
        sparse.progress(it)
        clock.now += 30
    clock.now += 600 - 30 - 1
    assert sparse.alarm() is None
    clock.now += 2
    assert "the run's pace: 20 x its median 3s per iteration x 10 iterations a line" in sparse.alarm().why

    busy = Watchdog(WatchdogSpec(**pace_only), clock=clock)
    for it in range(1, 5):
        busy.progress(it)
        clock.now += 3
    busy.output([" saving checkpoint at iteration       4 to /ckpt in torch_dist format"])
    clock.now += 1000
    assert busy.alarm() is None  # the pace waits while a save runs (as do the quiet windows)
    busy.output([" successfully saved checkpoint from iteration       4 to /ckpt"])
    clock.now += 119
    assert busy.alarm() is None
    clock.now += 2
    assert busy.alarm().why.startswith("no new iteration for 121s (after iteration 4; the run's pace")
    busy.output(["a4ray: busy: evaluating on 10k samples"])
    clock.now += 1800
    alarm = busy.alarm()
    assert alarm.bound and alarm.why.startswith("no new iteration for 1921s (after iteration 4; "
                                                "observe.watchdog.no_progress_s=1800, the upper bound)")

    # Quiet: a look after 30 s (once a quiet spell), a suspicion after 120 s; repeats are no news.
    quiet = Watchdog(WatchdogSpec(), clock=clock)
    clock.now += 31
    look = quiet.alarm()
    assert look.window_s is None and "observe.watchdog.look_after_s=30" in look.why
    assert quiet.alarm() is None  # once
    quiet.output(["[W1128 ...] Failed to check the \"should dump\" flag on TCPStore"], news=False)
    clock.now += 90
    alarm = quiet.alarm()
    assert alarm.why == "no news from any node for 121s (observe.watchdog.no_output_s=120)" and not alarm.bound
    quiet.output(["a new line"])
    assert quiet.alarm() is None

    # no_progress_s is the upper bound; before a second line only it applies; pace_multiple null turns the pace off.
    for spec, lines, wait in ((WatchdogSpec(no_progress_s=4, **{k: v for k, v in pace_only.items() if k != "no_progress_s"}), 3, 4),
                              (WatchdogSpec(**pace_only), 1, 1800),
                              (WatchdogSpec(**pace_only, pace_multiple=None), 3, 1800)):
        dog = Watchdog(spec, clock=clock)
        for it in range(1, lines + 1):
            dog.progress(it)
            clock.now += 0.1
        clock.now += wait - 0.2
        assert dog.alarm() is None
        clock.now += 0.3
        assert dog.alarm().bound and dog.alarm().why.endswith(
            f"observe.watchdog.no_progress_s={spec.no_progress_s:g}, the upper bound)")


def test_the_plan_states_the_watchdogs_rule():
    from conftest import job

    from a4ray.driver.execute import plan, render

    text = render(plan(job("ddp_test", "observe.watchdog.pace_floor_s=90", "observe.watchdog.no_progress_s=600")))
    assert ("note: hang watchdog: a rank that ends while others run is judged at once; 30s without news, a look for "
            "an ended rank or a desync; a suspicion (no new iteration for max(90s, 20 x the run's median time per "
            "iteration x the iterations between its lines) once two iteration lines have come") in text, text
    assert "a hang whatever the evidence at no new iteration for 600s; ranks that ended wait 300s for the rest" in text


class _DumpPipe:
    """A rank's side of NCCL's debug pipe, as torch 2.13 (cf30153c, the venv's) does it in
    torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp lines 199-238 (`DumpPipe`): `<stem><rank>.pipe` made with
    mkfifo and opened O_RDONLY | O_NONBLOCK; its heartbeat thread reads it every TORCH_NCCL_COORD_CHECK_MILSEC and
    a byte read makes the rank dump its record to `<TORCH_FR_DUMP_TEMP_FILE><rank>`; the destructor closes the
    fd and leaves the file. `dumps=False`: a rank whose dump never comes (its watchdog is stuck)."""

    def __init__(self, stem: str, rank: int, dump_stem: str, dumps: bool = True):
        import os
        import threading

        self.path = f"{stem}{rank}.pipe"
        os.mkfifo(self.path, 0o666)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self.rank, self.dump_stem, self.dumps, self.closed = rank, dump_stem, dumps, threading.Event()
        self.thread = threading.Thread(target=self._heartbeat, daemon=True)
        self.thread.start()

    def _heartbeat(self) -> None:
        import os
        import pickle

        while not self.closed.wait(0.1):
            try:
                asked = len(os.read(self.fd, 128)) > 0
            except BlockingIOError:
                asked = False
            if asked and self.dumps:
                with open(f"{self.dump_stem}{self.rank}", "wb") as f:
                    pickle.dump({"version": "2.10", "entries": [], "rank": self.rank}, f)
        os.close(self.fd)

    def close(self) -> None:
        self.closed.set()
        self.thread.join()


def test_every_rank_of_a_node_is_asked_through_its_nccl_pipe_and_each_missing_record_says_why(tmp_path):
    """Five ranks of a node: 0 dumps when its pipe is written; 1's process group is gone (its pipe has no reader:
    in teardown); 2 has no pipe (and a dump left by a previous launch, which is not its record); 3's process has
    exited; 4 reads its pipe but never dumps (timed out, after the bounded wait)."""
    import os
    import pickle
    import time

    from a4ray.observe.flight import NoRecord, collect

    pipes, out = tmp_path / "pipes", tmp_path / "flight-recorder"
    pipes.mkdir()
    out.mkdir()
    env = {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{pipes}/pipe_", "TORCH_FR_DUMP_TEMP_FILE": f"{out}/nccl_trace_rank_",
           "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_COORD_CHECK_MILSEC": "100"}
    stale = out / "nccl_trace_rank_2"
    stale.write_bytes(pickle.dumps({"entries": [], "stale": True}))
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    since = time.time() - 60
    ranks = [_DumpPipe(env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"], r, env["TORCH_FR_DUMP_TEMP_FILE"], dumps=r != 4)
             for r in (0, 1, 4)]
    ranks[1].close()
    try:
        started = time.monotonic()
        found = collect({r: os.getpid() for r in (0, 1, 2, 4)}, [0, 1, 2, 3, 4], env, pipes, out, since, timeout_s=2)
        took = time.monotonic() - started
    finally:
        for r in ranks:
            if not r.closed.is_set():
                r.close()
    assert found[0] == {"version": "2.10", "entries": [], "rank": 0}
    why = {r: found[r] for r in (1, 2, 3, 4)}
    assert all(isinstance(w, NoRecord) for w in why.values()), why
    assert {r: w.reason for r, w in why.items()} == {1: "in teardown", 2: "no pipe", 3: "process gone", 4: "timed out"}
    assert why[1].detail.startswith("nothing reads pipe_1.pipe: its process group 0 is gone")
    assert why[2].detail.startswith("no NCCL debug pipe: process group 0's heartbeat thread makes one in an NCCL "
                                    "rank with TORCH_FR_BUFFER_SIZE > 0 (here 2000)")
    assert why[4].detail.startswith("no dump 2s after its debug pipe was written (its heartbeat thread reads it every "
                                    "100 ms while TORCH_NCCL_DUMP_ON_TIMEOUT is on)")
    assert [r for r, w in why.items() if w.evidence] == [3]
    assert 2 <= took < 10, took  # waited for rank 4, bounded (not forever; the slack is a loaded machine's)


def test_a_ranks_own_process_is_the_one_whose_parent_does_not_carry_its_rank():
    """A rank's data-loader workers inherit RANK: its flight record and RAS's pid are the rank's own process's."""
    import os
    import subprocess
    import sys

    from a4ray.observe.flight import rank_labels, rank_pids

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert rank_pids([("5", child.pid), ("5", os.getpid()), ("n0:pid1", 1)]) == {5: os.getpid()}
        assert rank_pids([("5", child.pid), ("6", os.getpid())]) == {5: child.pid, 6: os.getpid()}
        # Its stack too: the helper's dump is labelled apart, never read as rank 5's.
        assert rank_labels([("5", child.pid), ("5", os.getpid()), ("n0:pid1", 1)]) == [
            (f"r5:pid{child.pid}", child.pid), ("5", os.getpid()), ("n0:pid1", 1)]
    finally:
        child.kill()
        child.wait()


def test_torchs_warning_every_second_from_every_rank_is_shown_once_frames_and_all():
    """ProcessGroupNCCL's TCPStore warning, as a blocked rank prints it every second (glog's time stamp and
    thread id, the rank in its prefix, then the C++ frames): shown once, its copies and their frames held back."""
    from a4ray.observe.stream import StreamFilter

    def copy(rank: int, second: int) -> list[str]:
        return [f"[W1128 10:00:{second:02d}.{second * 7919:06d} {4700 + rank} torch/csrc/distributed/c10d/"
                f"ProcessGroupNCCL.cpp:1730] [PG ID 0 PG GUID 0(default_pg) Rank {rank}] Failed to check the "
                "\"should dump\" flag on TCPStore, (maybe TCPStore server has shut down too early), with error: "
                "Broken pipe",
                "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f in libc10.so)",
                "frame #1: <unknown function> + 0x5f3e (0x7f in libtorch_cpu.so)"]

    stream = StreamFilter()
    shown = [line for second in range(5) for rank in range(3) for line in copy(rank, second)
             if stream.show(f"n0 r{rank}", line)]
    assert len(shown) == 3 and shown[0].endswith("Broken pipe") and shown[1].startswith("frame #0")
    assert stream.show("n0 r1", "Traceback (most recent call last):")  # what follows is news again
    assert stream.show("n0 r1", "frame #0: an error's frame is shown")
