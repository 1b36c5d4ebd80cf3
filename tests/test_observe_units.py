"""Progress lines, stack-dump summaries and the restart rules, on the formats the trainers really print."""

from __future__ import annotations

from a4ray.observe.progress import parse_progress, progress_summary
from a4ray.observe.stacks import StackDump, summarize, where
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


def test_a_table_wraps_cells_at_spaces_never_inside_a_path():
    from a4ray.core.console import table

    path = "/tmp/run/.a4ray/ckpts/huggingface/Qwen3-Next-tiny-to-mcore/ae9633209ec8/" + "deep/" * 30 + "x"
    detail = f"PASS: converted {path} (native, te naming) " + "and more words " * 20
    text = table("pipeline", ["step", "detail"], [["convert", detail]])
    assert any(path in line for line in text.splitlines())  # whole, on one line, however wide that makes it
    assert all(line == line.rstrip() for line in text.splitlines())
