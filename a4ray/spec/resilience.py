"""Specs of what watches a job: progress summaries, the hang watchdog, and the restart policy."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from a4ray.spec.fields import ExitCode, Integer, NonNegativeSeconds, Number, PositiveInt, Seconds, Spec

# Failures worth another attempt: the fabric or a peer went away, not the job's configuration.
RETRY_PATTERNS = [
    r"Watchdog caught collective operation timeout",
    r"ProcessGroupNCCL.*(timed out|Timeout)",
    r"NCCL (error|WARN).*(remote process exited|unhandled system error|Connection closed|timeout)",
    r"ncclSystemError|ncclRemoteError",
    r"Connection (reset|closed) by peer",
    r"(RendezvousTimeoutError|DistNetworkError)",
    r"CUDA error: an illegal memory access|ECC error|Xid",
]
# Failures another attempt cannot fix.
NEVER_PATTERNS = [
    r"ModuleNotFoundError|ImportError|SyntaxError|NameError",
    r"error: (unrecognized|the following) arguments",
    r"FileNotFoundError|No such file or directory",
    r"CUDA out of memory|OutOfMemoryError",
    r"hybrid override pattern is the wrong length",
]


class WatchdogSpec(Spec):
    """A suspicion is, once training runs, no new iteration line for the run's own pace (`pace_multiple` x its
    median time per iteration, at least `pace_floor_s`; a checkpoint being saved, an evaluation or an `a4ray: busy`
    line suspends it until the run says it is done), nothing in the first `startup_s`, or no news from any node for
    `no_output_s`. A suspicion starts an inspection (flight records, stacks and NCCL's RAS of every rank); the launch
    ends on evidence of a collective that cannot complete (a rank gone or ended, a desync, ranks waiting a whole
    window in a collective some rank never joined), or at the upper bound `no_progress_s`. A rank that ends while
    others run is judged at once; finished ranks wait at most `exit_barrier_s` for the rest. Then restart (if the
    restart policy allows) or fail."""

    enabled: bool = Field(True, description="false: no watchdog (a hung launch runs to timeout_s)")
    no_progress_s: Seconds | None = Field(1800, description="max time between iteration lines, whatever the pace "
                                          "or the evidence: the upper bound")
    pace_multiple: Number | None = Field(20, gt=0, le=1_000_000, description="a hang is no new iteration for this "
                                         "many times the run's median time per iteration (null: no_progress_s only)")
    pace_floor_s: Seconds = Field(120, description="the run's pace never judges a hang sooner than this")
    startup_s: Seconds | None = Field(None, description="max time to the first iteration line")
    no_output_s: Seconds | None = Field(120, description="no news from any node this long starts an inspection "
                                        "(repeats and torch's heartbeat warnings are no news)")
    look_after_s: Seconds | None = Field(30, description="no news from any node this long: look once whether a rank "
                                         "ended or the ranks called different collectives (judges nothing else)")
    exit_barrier_s: Seconds | None = Field(300, description="how long ranks that ended wait for the others to end "
                                           "(torchrun's exit barrier is 300 s)")
    py_spy: bool = Field(True, description="dump the Python stacks of every rank on a hang")
    flight_recorder: bool = Field(
        True, description="keep PyTorch's NCCL flight recorder on (TORCH_FR_BUFFER_SIZE) and dump it on a hang")
    record_timeout_s: Seconds = Field(10, description="on a hang, how long each rank's flight record is waited for "
                                      "(a rank that is frozen or stuck in its teardown never sends one)")

    def rule(self) -> str:
        """The rule in words, for the plan."""
        if not self.enabled:
            return "off (observe.watchdog.enabled=false)"
        bound = f"{self.no_progress_s:g}s" if self.no_progress_s else "no bound"
        parts = [f"no new iteration for max({self.pace_floor_s:g}s, {self.pace_multiple:g} x the run's median time "
                 f"per iteration x the iterations between its lines) once two iteration lines have come (not while a "
                 f"checkpoint save, an evaluation or an `a4ray: busy` line runs)" if self.pace_multiple else ""]
        if self.startup_s:
            parts.append(f"no iteration line in the first {self.startup_s:g}s")
        if self.no_output_s:
            parts.append(f"no news from any node for {self.no_output_s:g}s")
        suspicion = "; or ".join(p for p in parts if p) or "nothing"
        look = (f"; {self.look_after_s:g}s without news, a look for an ended rank or a desync" if self.look_after_s
                else "")
        barrier = (f"; ranks that ended wait {self.exit_barrier_s:g}s for the rest" if self.exit_barrier_s else "")
        return (f"a rank that ends while others run is judged at once{look}; a suspicion ({suspicion}) starts an "
                f"inspection, and the launch ends on evidence of a collective that cannot complete (a rank gone or "
                f"ended, a desync, ranks waiting a whole window in a collective some rank never joined); a hang "
                f"whatever the evidence at no new iteration for {bound}{barrier}")


class RestartSpec(Spec):
    """Relaunch the gang (a new placement group, so a lost node is replaced by a free one) from the
    latest complete checkpoint, up to `max_restarts` times. Never after success or a config error."""

    max_restarts: Integer = Field(0, ge=0, le=1000, description="relaunches after failures worth another attempt "
                                  "(0: none)")
    backoff_s: NonNegativeSeconds = Field(10, description="wait before each relaunch")
    warm_ranks: bool = Field(True, description="while an attempt trains, start the next attempt's ranks on each node "
                             "(torch imported, at the idle CPU class) so that a restart on the same gang skips their "
                             "cold start")
    retry_exit_codes: list[ExitCode] = Field(default_factory=list, description="always retried")
    never_exit_codes: list[ExitCode] = Field(default_factory=lambda: [2], description="never retried (2: usage error)")
    retry_patterns: list[str] = Field(default_factory=lambda: list(RETRY_PATTERNS), description="regular "
                                      "expressions: a failure whose output matches one is retried")
    never_patterns: list[str] = Field(default_factory=lambda: list(NEVER_PATTERNS), description="regular "
                                      "expressions: a failure whose output matches one is never retried (checked "
                                      "before retry_patterns)")
    unknown: Literal["retry-if-progressed", "retry", "fail"] = Field(
        "retry-if-progressed",
        description="other failures: retry only if this attempt got past an iteration (a crash before the "
        "first step is most likely configuration)",
    )


class StragglerSpec(Spec):
    """A node whose ranks' own compute per step (forward and backward up to the gradient reduction, less the
    time in their collectives) is slower than the gang's median by more than `threshold`, and by at least
    `min_slower_s`, for `windows` logging windows in a row is flagged a straggler (the Megatron trainer reports
    it; Pai's and ms-swift's loops do not)."""

    enabled: bool = Field(True, description="false: no straggler check")
    threshold: Number = Field(0.15, gt=0, description="how much slower than the gang's median (0.15 = 15%)")
    min_slower_s: NonNegativeSeconds = Field(
        0.005, description="and by at least this much per step: a few ms of timer and launch jitter on a short step "
        "(an even 2 x 2 GPU gang's 20 ms steps read 16% apart) is no straggler")
    windows: PositiveInt = Field(3, description="consecutive slow windows before a node is flagged")


class ObserveSpec(Spec):
    """What watches a running job: progress summaries, the hang watchdog and the straggler check."""

    summary_every: PositiveInt = Field(10, description="print a progress summary every N iterations")
    seq_length: PositiveInt | None = Field(None, description="tokens per sample, to derive tokens/s")
    rank_lines: Literal["once", "all"] = Field(
        "once", description="the stream's lines that several ranks print: 'once', each line once with the ranks that "
        "printed it ([ranks 0-3] line); 'all', every rank's copy, each with its rank. The rank logs keep every copy")
    watchdog: WatchdogSpec = WatchdogSpec()
    straggler: StragglerSpec = StragglerSpec()


class DoctorSpec(Spec):
    """Preflight thresholds (`a4ray doctor`, and the pipeline's preflight step before training)."""

    min_shm_gb: Number = Field(8, ge=0, description="/dev/shm size below this is a warning (A4 pods: 250Gi)")
    min_free_disk_gb: Number = Field(20, ge=0, description="free space on the workspace below this is a failure")
    max_clock_skew_s: Seconds = Field(2.0, description="clock skew against the driver above this fails")
    network: bool = Field(True, description="run a short all-reduce over the gang and check NCCL's transport")
    network_bytes: str = Field("1G", description="all-reduce size of the network check (nccl-tests notation); "
                               "its busbw is held to nccl_test's all_reduce thresholds")
