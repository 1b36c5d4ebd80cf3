"""Goodput: a run's wall time cut into buckets that add up to it, the redone iterations counted as lost work, each
incident's times in order; on a fake clock, and on a real 2-node run whose rank is killed and restarted. Meta's ETTR
projection against the formula worked by hand; the time line drawn."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import matplotlib
import pytest
from conftest import REPO, job

import a4ray
from a4ray.driver.execute import run
from a4ray.observe.goodput import BUCKETS, LaunchTimes, Stopwatch, account, find, project_ettr
from a4ray.observe.progress import parse_progress

matplotlib.use("Agg")
PROGRAM = str(REPO / "tests" / "programs" / "goodput_train.py")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def feed(stopwatch: Stopwatch, clock: Clock, at: float, text: str) -> None:
    clock.now = at
    stopwatch(0, SimpleNamespace(text=text, progress=parse_progress(text)))


def iteration(i: int) -> str:
    return f" iteration {i:8d}/      10 | elapsed time per iteration (ms): 1000.0 | lm loss: 1.0E+00 |"


def test_a_killed_attempt_and_its_restart_on_a_fake_clock():
    """Attempt 0: placed 1 -> 2, iterations 1..6 each a second (first line at 5), a save after 4 (8.0 -> 8.5); the
    rank dies after iteration 6 (seen 10.5, verdict 10.6, stopped 11). Attempt 1 resumes from checkpoint 4: placed
    12 -> 13, iterations 5..10 (first line at 16), ends at 22; the loop returns at 22.5."""
    clock = Clock()
    first = Stopwatch(clock=clock)
    for i, at in zip(range(1, 5), (5, 6, 7, 8)):
        feed(first, clock, at, iteration(i))
    feed(first, clock, 8.0, "saving checkpoint at iteration       4 to /ckpt in torch_dist format")
    feed(first, clock, 8.5, "  successfully saved checkpoint from iteration       4 to /ckpt")
    feed(first, clock, 9.5, iteration(5))
    feed(first, clock, 10.0, iteration(6))
    second = Stopwatch(clock=clock)
    for i, at in zip(range(5, 11), range(16, 22)):
        feed(second, clock, at, iteration(i))
    attempts = [
        first.record(0, LaunchTimes(placing_at=1, started_at=2, first_iteration_at=5, first_iteration=1,
                                    last_progress_at=10, fault_seen_at=10.5, verdict_at=10.6, ended_at=11),
                     "failed", "rank 1 (local rank 0) on node 1 was killed by SIGKILL"),
        second.record(1, LaunchTimes(placing_at=12, started_at=13, first_iteration_at=16, first_iteration=5,
                                     last_progress_at=21, ended_at=22)),
    ]
    g = account(attempts, 0.0, 22.5)
    b = g.buckets
    assert set(b) == set(BUCKETS) and g.wall_s == 22.5
    assert math.isclose(sum(b.values()), g.wall_s, rel_tol=0.01)
    # iterations 2..4 in attempt 0 are productive (3 s); 5 and 6 there are redone: lost (2 s less the 0.5 s save
    # between the lines of 4 and 5); 6..10 in attempt 1 are productive (5 s)
    assert b["wasted_progress_from_disruption"] == pytest.approx(1.0 + 0.5)
    assert b["unproductive_checkpoint_save_time"] == pytest.approx(0.5)
    assert b["productive_time"] == pytest.approx(3.0 + 5.0)
    assert b["placement"] == pytest.approx(1.0) and b["program_startup"] == pytest.approx(3.0)
    assert b["fault_detection"] == pytest.approx(0.6)  # last progress 10 -> verdict 10.6
    assert b["recovery"] == pytest.approx(16 - 10.6)  # verdict -> the new gang's first iteration
    assert b["other"] == pytest.approx(1.0 + 0.5 + 1.0)  # before placing; after the last line; after the gang
    assert g.goodput == pytest.approx(8.0 / 22.5)
    [incident] = g.incidents
    assert incident.kind == "failed" and incident.resumed_from == 4 and incident.redone_iterations == 2
    assert incident.lost_work_s == pytest.approx(1.5) and incident.last_iteration == 6
    times = [incident.last_progress_at, incident.seen_at, incident.verdict_at, incident.stopped_at,
             incident.placed_at, incident.first_iteration_at, incident.caught_up_at]
    assert times == sorted(times) and incident.caught_up_at == 17  # iteration 6 again
    assert incident.detection_s == pytest.approx(0.6) and incident.recovery_s == pytest.approx(5.4)
    assert not incident.estimated and g.restart_overhead_s == pytest.approx(6.0)
    assert g.checkpoint_save_s == pytest.approx(0.5) and g.step_time_s == pytest.approx(1.0)
    assert g.line().startswith("goodput 35.6% of 22.5s: placement 4.4%, startup 13.3%, checkpoints 2.2%, "
                               "lost work 6.7%, detection 2.7%, recovery 24.0%, other 11.1%")
    # one bar per attempt: its stretches tile the time line
    spans = sorted((s.start, s.end) for s in g.segments)
    assert spans[0][0] == 0 and spans[-1][1] == pytest.approx(22.5)
    assert all(a[1] == pytest.approx(b[0]) for a, b in zip(spans, spans[1:]))
    assert {s.attempt for s in g.segments} == {0, 1}


def test_a_fault_time_the_launch_did_not_record_falls_back_to_its_end_and_says_so():
    clock = Clock()
    watch = Stopwatch(clock=clock)
    feed(watch, clock, 3, iteration(1))
    feed(watch, clock, 4, iteration(2))
    attempt = watch.record(0, LaunchTimes(placing_at=0, started_at=1, ended_at=6), "hang", "the launch hung")
    g = account([attempt], 0.0, 6.0)
    [incident] = g.incidents
    assert incident.verdict_at == 6 and incident.seen_at == 6 and len(incident.estimated) == 2
    assert g.buckets["fault_detection"] == pytest.approx(2.0) and g.notes
    assert incident.recovery_s is None and incident.cost_s is None  # the run never came back
    assert math.isclose(sum(g.buckets.values()), 6.0)


def test_an_iteration_line_read_after_the_verdict_counts_by_the_verdict():
    """Rank 0's line of iteration 3, made before rank 1 died, is drained 0.4 s after the verdict: the work counts,
    and the incident's last progress is no later than its verdict."""
    clock = Clock()
    watch = Stopwatch(clock=clock)
    feed(watch, clock, 3, iteration(1))
    feed(watch, clock, 4, iteration(2))
    feed(watch, clock, 5.4, iteration(3))
    attempt = watch.record(0, LaunchTimes(placing_at=0, started_at=1, fault_seen_at=4.9, verdict_at=5.0, ended_at=6),
                           "failed", "rank 1 was killed by SIGKILL")
    g = account([attempt], 0.0, 6.0)
    [incident] = g.incidents
    assert incident.last_progress_at == 5.0 <= incident.verdict_at and incident.last_iteration == 3
    assert g.buckets["productive_time"] == pytest.approx(2.0) and g.buckets["fault_detection"] == 0
    assert math.isclose(sum(g.buckets.values()), 6.0)


def test_lines_a_poll_hands_over_together_are_timed_by_when_their_node_read_them():
    """A node's poll gathers lines (up to 0.1 s), and a driver may fall behind: ten 5 ms iterations and a 0.2 s save
    that reach the driver in one batch at 10.0 are timed by their `at`, when the node read each, not by the batch."""
    clock = Clock()
    clock.now = 10.0  # the driver's clock: every line below reaches it at once
    watch = Stopwatch(clock=clock)
    lines = [(9.000 + 0.005 * i, iteration(i)) for i in range(1, 11)]
    lines += [(9.05, "saving checkpoint at iteration      10 to /ckpt"), (9.25, "  successfully saved checkpoint")]
    lines += [(9.255, iteration(11)), (9.26, iteration(12))]
    for at, text in lines:
        watch(0, SimpleNamespace(text=text, progress=parse_progress(text), at=at))
    g = account([watch.record(0, LaunchTimes(placing_at=8.0, started_at=8.5, ended_at=9.3))], 8.0, 10.0)
    b = g.buckets
    assert b["productive_time"] == pytest.approx(0.045 + 0.005 + 0.005)  # 1 -> 10, then the steps 11 and 12
    assert b["unproductive_checkpoint_save_time"] == pytest.approx(0.2, abs=0.006)  # 9.05 -> 9.255 less a step
    assert b["program_startup"] == pytest.approx(0.505) and math.isclose(sum(b.values()), 2.0)


def test_the_projection_is_metas_formula():
    """E[ETTR] = (1 - N r_f (u0 + dt/2)) / (1 + w/dt), dt* = sqrt(2 w / (N r_f)), r_f per node-second, by hand."""
    [p] = project_ettr(60.0, 10.0, 600.0, nodes=(1024,), rates=(6.50,))
    rate = 1024 * 6.50 / 1000 / 86400  # failures per second of the cluster: 7.7037e-5
    assert p.best_interval_s == pytest.approx(math.sqrt(20 / rate)) == pytest.approx(509.52, abs=0.01)
    assert p.ettr == pytest.approx((1 - rate * (60 + 300)) / (1 + 10 / 600)) == pytest.approx(0.95633, abs=1e-5)
    assert p.best_ettr == pytest.approx(0.95697, abs=1e-5)
    table = project_ettr(60.0, 10.0, nodes=(16, 64, 256, 1024))
    assert [(p.nodes, p.failures_per_1000_node_days) for p in table][:4] == [(16, 6.5), (64, 6.5), (256, 6.5),
                                                                              (1024, 6.5)]
    assert len(table) == 8 and all(p.ettr is None for p in table)
    assert table[0].best_ettr > table[3].best_ettr  # more nodes, more failures
    with pytest.raises(ValueError, match="u0_s"):
        project_ettr(-1.0, 10.0)


def test_the_time_line_draws_one_bar_per_attempt():
    clock = Clock()
    first, second = Stopwatch(clock=clock), Stopwatch(clock=clock)
    for i in range(1, 4):
        feed(first, clock, 2 + i, iteration(i))
    feed(second, clock, 9, iteration(3))
    feed(second, clock, 10, iteration(4))
    g = account([first.record(0, LaunchTimes(placing_at=0, started_at=1, ended_at=6), "failed", "x"),
                 second.record(1, LaunchTimes(placing_at=7, started_at=8, ended_at=11))], 0.0, 11.0)
    ax = g.plot()
    assert list(ax.get_yticks()) == [0, 1]
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= {"productive", "lost work", "recovery"}
    matplotlib.pyplot.close("all")


def restartable(tmp_path, *args: str):
    """A command job of PROGRAM (its ITERATIONS STEP_S SAVE_EVERY SAVE_S KILL_AT VICTIM: `args`) on 2 nodes x 1 rank,
    restarted once at most, at once."""
    argv = ", ".join([PROGRAM, str(tmp_path / "state.json"), *(f"'{a}'" for a in args)])
    return job("command", "cluster.nodes=2", "cluster.gpus_per_node=1", "command.torchrun=true",
               "restart.max_restarts=1", "restart.backoff_s=0", "cluster.stop_grace_s=2", f"command.argv=[{argv}]",
               workspace=tmp_path)


def test_a_real_run_whose_rank_is_killed_accounts_for_its_time(local_cluster, tmp_path, capfd):
    """2 nodes x 1 rank; rank 1 SIGKILLs itself after iteration 5 of attempt 0 (checkpoint 4): the gang is restarted,
    resumes after 4 and finishes; result.json's goodput adds up to the wall time and counts iteration 5 twice. No
    node is to blame for a killed rank: the restart relaunches on the same gang, placed once, on the ranks each node
    started with the first attempt (warm: the very processes, which became the ranks when the restart came)."""
    result = run(restartable(tmp_path, "8", "0.2", "2", "0.1", "5", "1"))
    assert result.ok and result.gang.attempt == 1, result.verdict
    out = capfd.readouterr().out
    assert "attempt 1/1: relaunching on the same gang" in out and len(re.findall(r"gang \S+: .* placed in", out)) == 1
    assert re.search(r"launch \S+-r1: ranks warm on every node", out), out
    for log in tmp_path.rglob("node-*.log"):
        text = log.read_text()
        assert text.count("# ranks warm: the launch runs on the launcher started with the last attempt") == 1, log
    g = result.goodput
    assert math.isclose(sum(g.buckets.values()), g.wall_s, rel_tol=0.01)
    [incident] = g.incidents
    assert incident.kind == "failed" and incident.resumed_from == 4 and incident.redone_iterations >= 1
    assert g.buckets["wasted_progress_from_disruption"] > 0 and incident.lost_work_s > 0
    times = [incident.last_progress_at, incident.verdict_at, incident.stopped_at, incident.placed_at,
             incident.first_iteration_at, incident.caught_up_at]
    assert None not in times and times == sorted(times), incident
    assert g.buckets["unproductive_checkpoint_save_time"] > 0 and 0 < g.goodput < 1
    [record] = list(tmp_path.rglob("result.json"))
    assert find(json.loads(record.read_text())) == g == a4ray.goodput(record.parent)  # the record, the API


def test_the_next_attempts_warm_ranks_end_with_a_run_that_succeeds(local_cluster, tmp_path):
    """A run that may be restarted starts the next attempt's ranks warm on every node; when it succeeds instead, they
    end with it: no process of the run is left, the warm ones included."""
    from test_gang import assert_no_leftovers

    result = run(restartable(tmp_path, "3", "0.1", "2", "0", "99", "1"))
    assert result.ok and result.gang.attempt == 0, result.verdict
    logs = list(tmp_path.rglob("node-*.log"))
    assert len(logs) == 2 and all("# the next attempt's launcher stands by, its ranks warm: pid " in log.read_text()
                                  for log in logs)
    assert_no_leftovers(result.gang.launch_id.rsplit("-r", 1)[0])
