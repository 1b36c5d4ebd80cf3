"""a4ray's Ray metrics: shown in the Ray dashboard's metrics view and scraped by Prometheus.

Exported by each node's Ray metrics agent (`ray_` is prepended), e.g. `ray_a4ray_train_loss{job,run,node,rank}`:

  a4ray_train_iteration            last iteration reported by a rank
  a4ray_train_loss                 lm loss of that iteration
  a4ray_train_step_time_seconds    elapsed time per iteration
  a4ray_train_tflops_per_gpu       throughput per GPU (as the trainer prints it)
  a4ray_train_tokens_per_second    printed, or global batch x seq length / step time
  a4ray_train_grad_norm            gradient norm
  a4ray_train_consumed_samples     samples consumed so far
  a4ray_train_last_progress_time   unix time of the last iteration line (a flat line = a hang)
  a4ray_gang_attempt               attempt number of the job's gang (0 = first launch)
  a4ray_gang_restarts_total        restarts after failures or hangs
  a4ray_gang_hangs_total           hangs the watchdog detected
  a4ray_goodput_ratio              productive step time / wall time of the run so far ({job,run}; observe/goodput.py)
  a4ray_badput_seconds             the run's seconds in each other bucket ({job,run,kind}: program_startup, ...)
  a4ray_convert_bytes_total        checkpoint bytes a conversion wrote, per node ({job,node})
  a4ray_convert_rate_bytes_per_s   write rate of the last conversion part a node finished ({job,node})
  a4ray_fabric_gbps                a fabric test's figure in GB/s ({job,run,test,figure,nodes}): nccl-tests' busbw at
                                   the largest size per collective, DeepEP's best dispatch/combine bandwidths

Staging's own (`a4ray_stage_*`) are staging/display.py's. `observe/grafana.py` charts them all.

Per node of the gang ({job,run,node,host}: node is its gang rank, host its machine), for the node verdicts:

  a4ray_node_step_time_seconds     that node's median rank compute time per step in the last window
  a4ray_node_straggler             1 once the node is flagged a straggler in the launch, else 0 (set every window)
  a4ray_hang_culprit_total         hang verdicts that named a rank of that node

Metrics are created lazily, once per process: Ray refuses two metrics with one name in a process. Ray exports a
process's values every metrics_report_interval_ms (10 s): a driver that exits sooner after its last value loses it
(a fabric test's figures, a run's final goodput), so it waits for that export first (`wait_exported`). A driver
process exports its own every second (`exporting_often`): that wait is ~1.5 s, not 10.5.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

from a4ray.observe.progress import Progress
from a4ray.observe.verdicts import NodeRef

TAGS = ("job", "run", "node", "rank")
NODE_TAGS = ("job", "run", "node", "host")
_lock = threading.Lock()
_metrics: dict[str, object] = {}
_last_set = 0.0  # monotonic: when this process last asked for a metric (to set it)


def _metric(kind: str, name: str, description: str, tags: tuple[str, ...] = TAGS):
    global _last_set
    with _lock:
        _last_set = time.monotonic()
        if name not in _metrics:
            from ray.util import metrics

            cls = {"gauge": metrics.Gauge, "counter": metrics.Counter}[kind]
            _metrics[name] = cls(name, description=description, tag_keys=tags)
        return _metrics[name]


_TRAIN = {
    "iteration": ("a4ray_train_iteration", "last training iteration reported"),
    "loss": ("a4ray_train_loss", "lm loss of the last reported iteration"),
    "step_time_s": ("a4ray_train_step_time_seconds", "elapsed time per iteration"),
    "tflops_per_gpu": ("a4ray_train_tflops_per_gpu", "model TFLOP/s per GPU as the trainer reports it"),
    "tokens_per_s": ("a4ray_train_tokens_per_second", "training tokens per second (whole job)"),
    "grad_norm": ("a4ray_train_grad_norm", "gradient norm of the last reported iteration"),
    "consumed_samples": ("a4ray_train_consumed_samples", "samples consumed so far"),
    "last_progress": ("a4ray_train_last_progress_time", "unix time of the last iteration line"),
}


def record_progress(progress: Progress, tags: dict[str, str], seq_length: int | None = None) -> None:
    values = {
        "iteration": progress.iteration,
        "loss": progress.loss,
        "step_time_s": progress.step_time_ms / 1000 if progress.step_time_ms is not None else None,
        "tflops_per_gpu": progress.tflops_per_gpu,
        "tokens_per_s": progress.tokens_per_second(seq_length),
        "grad_norm": progress.grad_norm,
        "consumed_samples": progress.consumed_samples,
        "last_progress": time.time(),
    }
    for key, value in values.items():
        if value is not None:
            name, description = _TRAIN[key]
            _metric("gauge", name, description).set(float(value), tags=tags)


def record_attempt(job: str, run: str, attempt: int) -> None:
    tags = {"job": job, "run": run}
    _metric("gauge", "a4ray_gang_attempt", "attempt number of the gang (0 = first launch)", ("job", "run")).set(
        attempt, tags=tags)
    if attempt:
        _metric("counter", "a4ray_gang_restarts_total", "gang restarts after failures or hangs",
                ("job", "run")).inc(1, tags=tags)


def record_hang(job: str, run: str) -> None:
    _metric("counter", "a4ray_gang_hangs_total", "hangs detected by the watchdog", ("job", "run")).inc(
        1, tags={"job": job, "run": run})


def _node_tags(job: str, run: str, node: NodeRef) -> dict[str, str]:
    return {"job": job, "run": run, "node": str(node.node), "host": node.host}


def record_culprit(job: str, run: str, node: NodeRef) -> None:
    _metric("counter", "a4ray_hang_culprit_total", "hang verdicts naming a rank of this node", NODE_TAGS).inc(
        1, tags=_node_tags(job, run, node))


def record_node_window(job: str, run: str, node: NodeRef, step_time_s: float, straggler: bool) -> None:
    tags = _node_tags(job, run, node)
    _metric("gauge", "a4ray_node_step_time_seconds", "median rank compute time per step of this node in the last "
            "window", NODE_TAGS).set(step_time_s, tags=tags)
    _metric("gauge", "a4ray_node_straggler", "1 once this node is flagged a straggler in the launch, else 0", NODE_TAGS).set(
        1.0 if straggler else 0.0, tags=tags)


def record_conversion_part(job: str, node: str, nbytes: int, seconds: float) -> None:
    """One part of a native conversion written: its bytes, and the rate it was written at."""
    tags = {"job": job, "node": node}
    _metric("counter", "a4ray_convert_bytes_total", "checkpoint bytes written by conversion", ("job", "node")).inc(
        float(nbytes), tags=tags)
    _metric("gauge", "a4ray_convert_rate_bytes_per_s", "write rate of the last conversion part",
            ("job", "node")).set(nbytes / max(seconds, 1e-9), tags=tags)


def record_goodput(job: str, run: str, ratio: float, buckets: dict[str, float]) -> None:
    """The run's goodput so far (observe/goodput.py): the ratio, and the seconds of each badput bucket."""
    tags = {"job": job, "run": run}
    _metric("gauge", "a4ray_goodput_ratio", "productive step time / wall time of the run so far", ("job", "run")).set(
        ratio, tags=tags)
    badput = _metric("gauge", "a4ray_badput_seconds", "the run's seconds in a bucket other than productive steps",
                     ("job", "run", "kind"))
    for kind, seconds in buckets.items():
        if kind != "productive_time":
            badput.set(seconds, tags={**tags, "kind": kind})


def record_fabric(job: str, run: str, test: str, nodes: list[int], figures: dict[str, float | None]) -> None:
    """A fabric test's figures in GB/s (`test`: the collective, or DeepEP's test) over gang nodes `nodes`."""
    gauge = _metric("gauge", "a4ray_fabric_gbps", "a fabric test's figure: busbw, or DeepEP's bandwidth (GB/s)",
                    ("job", "run", "test", "figure", "nodes"))
    where = ",".join(map(str, nodes))
    for figure, gbps in figures.items():
        if gbps is not None:
            gauge.set(gbps, tags={"job": job, "run": run, "test": test, "figure": figure, "nodes": where})


EXPORT_INTERVAL_ENV = "RAY_metrics_report_interval_ms"  # read by ray.init (Ray's config, read again on each init)
DRIVER_EXPORT_MS = 1000  # the floor of Ray's exporter


@contextlib.contextmanager
def exporting_often():
    """While the block connects this process to Ray (`ray.init`): it exports its own metric values every second,
    not every 10 s. A driver's last values are exported about a second after they are set, so `wait_exported` waits
    ~1.5 s, not 10.5, before the driver leaves a cluster that outlives it: every run submitted as a Ray job ends that
    much sooner. Only this process: the setting is out of the environment again before the block ends, so what it
    starts later (a cluster's nodes, their workers) exports at Ray's own interval, as more frequent exports in every
    process of a cluster would cost its CPU. An interval the environment sets is left as it is."""
    if EXPORT_INTERVAL_ENV in os.environ:
        yield
        return
    os.environ[EXPORT_INTERVAL_ENV] = str(DRIVER_EXPORT_MS)
    try:
        yield
    finally:
        del os.environ[EXPORT_INTERVAL_ENV]


def wait_exported() -> float:
    """Wait until Ray has exported what this process set last (its exporter runs every metrics_report_interval_ms,
    at least 1 s); returns the seconds waited. Call before disconnecting from a cluster that outlives this process."""
    if not _last_set:
        return 0.0
    import ray

    try:
        interval_s = max(ray._config.metrics_report_interval_ms(), 1000) / 1000  # as Ray's exporter floors it
    except Exception:  # noqa: BLE001 - Ray's internal config moved: its default
        interval_s = 10.0
    wait_s = max(0.0, _last_set + interval_s + 0.5 - time.monotonic())
    try:
        time.sleep(wait_s)
    except KeyboardInterrupt:  # a stop while waiting: what the run had to record is recorded; stop waiting
        pass
    return wait_s
