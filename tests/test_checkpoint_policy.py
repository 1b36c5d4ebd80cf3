"""The checkpoint policy (observe/checkpoint_policy.py): Meta's best interval, fixed and auto intervals, and which
checkpoint a restart resumes from. The auto interval end to end: test_pipeline's 4-node rerun."""

from __future__ import annotations

import math

import pytest

from a4ray.observe.checkpoint_policy import PUBLISHED_RATE, Interval, best_interval_s, resume_from
from a4ray.observe.goodput import project_ettr


def test_the_best_interval_is_metas_and_goodputs_projection_agrees():
    # 512 nodes, 6.5 failures per 1000 node-days, a save blocking 20 s: dt* = sqrt(2 x 20 / (512 x 6.5e-3 / 86400))
    assert best_interval_s(20, 512, 6.5) == pytest.approx(math.sqrt(40 / (512 * 6.5e-3 / 86400)))
    assert best_interval_s(20, 512, 6.5) == pytest.approx(1019.05, abs=0.01)
    (projected,) = project_ettr(300, 20, nodes=(512,), rates=(6.5,))
    assert projected.best_interval_s == best_interval_s(20, 512, 6.5)
    # a save 400x cheaper is best made 20x more often
    assert best_interval_s(0.05, 512, 6.5) == pytest.approx(best_interval_s(20, 512, 6.5) / 20)
    assert best_interval_s(0, 512, 6.5) == 0.0


def test_a_fixed_interval_saves_on_its_multiples_and_chooses_nothing():
    every = Interval("checkpoint", 10, nodes=2, failures_per_1000_node_days=PUBLISHED_RATE, rate_source="x", start=0)
    assert [i for i in range(1, 31) if every.due(i)] == [10, 20, 30]
    assert every.saved(10, 1.0, 0.1) is None


def test_an_auto_interval_saves_first_to_measure_then_at_dt_star_at_the_runs_pace():
    auto = Interval("checkpoint", None, nodes=512, failures_per_1000_node_days=6.5, rate_source="published",
                    start=100)
    assert not auto.due(100) and auto.due(101)  # the first iteration after the start measures the save
    said = auto.saved(101, 20.0, 2.0)  # 20 s blocked, 2 s a step: dt* 1019 s = 510 steps
    assert said == ("checkpoint interval auto: every 510 iteration(s) = dt* 1019s = sqrt(2 w / (N r_f)) with w 20.00s "
                    "blocked by this save, N 512 node(s), r_f 6.5 failures per 1000 node-days (published); a step "
                    "takes 2.000s")
    assert not auto.due(610) and auto.due(611)
    assert auto.saved(611, 20.0, 2.0) is None  # the same choice is not said again
    assert "every 23 iteration(s)" in auto.saved(611, 0.04, 2.0)  # cheaper saves: more often


def test_a_restart_resumes_from_the_newest_checkpoint_and_a_persistent_one_on_a_tie():
    assert resume_from(10, 15) == ("local", 15)
    assert resume_from(20, 15) == ("persistent", 20)
    assert resume_from(20, 20) == ("persistent", 20)
    assert resume_from(None, 5) == ("local", 5)
    assert resume_from(None, None) == (None, None)


def test_a_save_that_died_leaves_no_dirty_part_in_the_next_attempts_way(tmp_path):
    """A rank killed while writing its local part leaves `iter_N_<rank>_local.dirty.pt`; NVRx creates that file
    exclusively, so the next attempt reaching iteration N again failed ("already exists on the same machine", found
    by benchmarks/checkpoint.py's restore). A new attempt's LocalCheckpoints clears them before anything writes."""
    import torch.distributed as dist

    from a4ray.mcore.local_checkpoints import LocalCheckpoints

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        first = LocalCheckpoints(tmp_path / "shm", tmp_path / "save", replication_jump=1, replication_factor=1)
        first.directory.mkdir(parents=True)
        (first.directory / "iter_0000012_0_local.dirty.pt").write_bytes(b"cut short")
        (first.directory / "iter_0000008_0_local.pt").write_bytes(b"complete")
        again = LocalCheckpoints(tmp_path / "shm", tmp_path / "save", replication_jump=1, replication_factor=1)
        assert sorted(p.name for p in again.directory.iterdir()) == ["iter_0000008_0_local.pt"]
    finally:
        dist.destroy_process_group()


def test_the_failure_rate_is_the_workspaces_own_weighed_with_the_published_one(tmp_path):
    """Meta's published rate counts as 1000 node-days of history (a Gamma prior): a young workspace moves it a
    little, a long history decides it. Only the ends a node was blamed for count as failures; stragglers do not."""
    from a4ray.core.node_history import PRIOR_NODE_DAYS, NodeHistory

    history = NodeHistory(tmp_path)
    assert history.failure_rate().per_1000_node_days == PUBLISHED_RATE
    assert "no node time yet" in history.failure_rate().source

    day = 86400.0
    history.served({"a4-node-0": 10 * day, "a4-node-1": 10 * day}, run="r1")  # 20 node-days, no failure
    history.add("a4-node-1", "straggler", run="r1", detail="slow")
    young = history.failure_rate()
    assert (young.failures, young.node_days) == (0, pytest.approx(20))
    assert young.per_1000_node_days == pytest.approx(6.5 * PRIOR_NODE_DAYS / (PRIOR_NODE_DAYS + 20))
    assert young.source == ("this workspace's node history, 0 node failures in 20 node-days, weighed with "
                            "Meta's published 6.5 as 1000 node-days")

    # 4000 node-days more and 40 failures (10 per 1000 node-days): the history outweighs the prior 4 to 1
    history.served({f"a4-node-{i}": 1000 * day for i in range(4)}, run="r2")
    for i in range(40):
        history.add(f"a4-node-{i % 4}", "lost" if i % 2 else "hang-culprit", run="r2")
    old = history.failure_rate()
    assert (old.failures, old.node_days) == (40, pytest.approx(4020))
    assert old.per_1000_node_days == pytest.approx((40 + 6.5) / (4020 + 1000) * 1000)
    assert 9 < old.per_1000_node_days < 10
    assert "_service" not in history.hosts()  # node time is not a host
    assert "4,020 node-days" in old.source


def test_an_auto_interval_takes_the_rate_from_the_workspaces_node_history(tmp_path, capsys):
    """What the driver hands a4ray's Megatron trainer for `auto` intervals: the workspace's rate and where it comes
    from (the trainer says both when it chooses, as test_pipeline's auto rerun reads)."""
    from a4ray.core.node_history import NodeHistory
    from a4ray.driver.main import main as pipeline_main

    NodeHistory(tmp_path).served({"h0": 500 * 86400.0, "h1": 500 * 86400.0}, run="earlier")
    NodeHistory(tmp_path).add("h0", "lost", run="earlier")
    args = ["--dry-run", "--set", "train.trainer=megatron", "--set", f"storage.workspace={tmp_path}"]
    assert pipeline_main("qwen3_next", [*args, "--set", "train.local_save_interval=auto"]) == 0
    command = next(line for line in capsys.readouterr().out.splitlines() if " -m a4ray.mcore " in line)
    rate = (1 + 6.5) / (1000 + 1000) * 1000
    assert f"--failures-per-1000-node-days {rate:.4g} " in command
    assert ("--failure-rate-source 'this workspace'\"'\"'s node history, 1 node failure in 1,000 node-days, "
            "weighed with Meta'\"'\"'s published 6.5 as 1000 node-days'") in command

    assert pipeline_main("qwen3_next", args) == 0  # fixed intervals: no rate to hand
    command = next(line for line in capsys.readouterr().out.splitlines() if " -m a4ray.mcore " in line)
    assert "--failures-per-1000-node-days" not in command
