"""Ranks that end early or call a different collective, on the A4 shape in miniature (2 nodes x 2 gloo ranks
under a4ray's launcher, real torch programs): judged at once, on the evidence, naming the rank that caused it and
never an innocent one. With nothing configured: the watchdog's defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import job

from a4ray.core.errors import GangFailed
from a4ray.runtime.gang import Gang
from a4ray.workloads.generic import Command

pytestmark = pytest.mark.slow

# Rank 3 runs out of data after 3 steps and ends normally; the others go on to a 4th all-reduce. `hold`: the rank
# leaves a forked child holding its sockets (as NCCL's peers, gloo's then block instead of failing).
UNEVEN = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
steps = 3 if rank == {leaver} else 50
for it in range(1, steps + 1):
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 0:
        print(f" iteration {{it:8d}}/      50 | elapsed time per iteration (ms): 100.0 | lm loss: 1.0 |", flush=True)
    time.sleep(0.1)
if rank == {leaver}:
    if {hold} and os.fork() == 0:
        time.sleep(3600)
    print(f"rank {{rank}}: out of data after {{steps}} steps", flush=True)
    if not {hold}:
        dist.destroy_process_group()
    sys.exit(0)
"""

# Rank 2 calls all_gather_into_tensor where its peers call all_reduce, at the 4th collective.
DESYNC = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
for it in range(1, 50):
    t = torch.ones(4)
    if rank == 2 and it == 4:
        dist.all_gather_into_tensor(torch.empty(4 * world), t)
    else:
        dist.all_reduce(t)
    if rank == 0:
        print(f" iteration {it:8d}/      50 | elapsed time per iteration (ms): 100.0 | lm loss: 1.0 |", flush=True)
    time.sleep(0.1)
"""


# Every rank trains the same steps; rank 0 then saves for 8 s while the others have ended: not a failure.
LAST_SAVE = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
for it in range(3):
    dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
if os.environ["RANK"] == "0":
    print("saving the last checkpoint", flush=True)
    time.sleep(8)
"""


def _run(tmp_path: Path, program: str, *sets: str):
    script = tmp_path / "program.py"
    script.write_text(program)
    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=2", f"command.argv=[{script}]",
               "command.torchrun=true", *sets, workspace=tmp_path)
    with pytest.raises(GangFailed) as e:
        with Gang(spec, log_dir=str(tmp_path / "logs"), run_dir=str(tmp_path / tmp_path.name)) as gang:
            gang.run(Command(spec).launch)
    return e.value.result


def test_a_rank_that_leaves_cleanly_is_the_cause_and_its_peers_failures_are_its_echo(local_cluster, tmp_path):
    result = _run(tmp_path, UNEVEN.format(leaver=3, hold=False))
    verdict = result.hang_verdict
    assert result.failure_kind == "failed" and verdict is not None and verdict.kind == "ended", result.failure
    assert [c.rank for c in verdict.culprits] == [3], result.failure
    assert result.failure.startswith("rank 3 (node 1 (sim-host-"), result.failure
    assert "ended with exit 0 after all_reduce #3 of group default" in result.failure
    # rank 0 or 1 or 2 quotes gloo's words for a peer gone: "closed" or "reset", whichever socket noticed first
    assert "its echo, not a cause of its own" in result.failure, result.failure
    assert re.search(r"failed with 'Connection (closed|reset) by peer', its echo", result.failure), result.failure
    assert result.failed_node == 1


def test_a_rank_that_leaves_while_its_peers_block_is_judged_within_seconds(local_cluster, tmp_path):
    result = _run(tmp_path, UNEVEN.format(leaver=3, hold=True))
    verdict = result.hang_verdict
    assert result.failure_kind == "hang" and verdict.kind == "ended", result.failure
    assert [c.rank for c in verdict.culprits] == [3] and verdict.waiting == [0, 1, 2]
    assert result.failure.startswith("rank 3 (node 1 (sim-host-"), result.failure
    assert "ended with exit 0 after all_reduce #3 of group default; ranks 0-2 wait in all_reduce" in result.failure
    # judged on the event (the look after rank 3's end), not at a watchdog window (no_output_s 120)
    why = (Path(result.hang_report) / "summary.txt").read_text().splitlines()[0]
    assert why == "rank(s) 3 ended (exit 0) while the launch's other ranks run", why
    assert (Path(result.hang_report) / "verdict.json").is_file()
    # torch's own analyzer ran over the same records after the verdict: its words are in the report, not the stream
    assert "torch's analyzer" in (Path(result.hang_report) / "analyzer.txt").read_text()


def test_a_desync_names_the_minority_from_the_stacks(local_cluster, tmp_path):
    result = _run(tmp_path, DESYNC)
    verdict = result.hang_verdict
    assert verdict is not None and verdict.kind == "desync", result.failure
    assert [c.rank for c in verdict.culprits] == [2]
    assert result.failure.startswith("desync: rank 2 called all_gather_into_tensor while ranks 0-1, 3 called "
                                     "all_reduce"), result.failure
    why = (Path(result.hang_report) / "summary.txt").read_text().splitlines()[0]
    assert "no_output_s" not in why and "no_progress_s" not in why, why  # a look settled it, not a window's end


def test_ranks_that_end_while_rank_0_saves_its_last_checkpoint_are_no_failure(local_cluster, tmp_path):
    script = tmp_path / "program.py"
    script.write_text(LAST_SAVE)
    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=2", f"command.argv=[{script}]",
               "command.torchrun=true", workspace=tmp_path)
    with Gang(spec, log_dir=str(tmp_path / "logs"), run_dir=str(tmp_path / tmp_path.name)) as gang:
        result = gang.run(Command(spec).launch)
    assert result.ok and result.hang_verdict is None, result.failure
