"""Naming the culprit, on a real local cluster with real torchrun-contract ranks on gloo: which rank a hung
collective waits for (from the ranks' flight records, else their stacks), which node is a straggler, and
the next attempt kept off the node that failed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import job

from a4ray.core.errors import GangHang
from a4ray.runtime.gang import Gang
from a4ray.workloads.generic import Command

pytestmark = pytest.mark.slow

# Rank 3 (node 1's second rank) never enters the 4th all-reduce: it sits in its "data loader".
STUCK_AT_4TH = """
import os, time, torch, torch.distributed as dist
{init}
rank = dist.get_rank()

def load_batch(it):
    if rank == 3 and it == 4:
        time.sleep(3600)
    return torch.ones(4)

for it in range(1, 100):
    batch = load_batch(it)
    dist.all_reduce(batch)
    if rank == 0:
        print(f" iteration {{it:8d}}/      99 | elapsed time per iteration (ms): 100.0 | lm loss: 1.0 |", flush=True)
"""
A4RAY_INIT = "from a4ray.programs.distributed import init_distributed\ninit_distributed('gloo')"
PLAIN_INIT = "dist.init_process_group('gloo')"


def _hang(tmp_path: Path, init: str):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_AT_4TH.format(init=init))
    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=2", f"command.argv=[{script}]",
               "command.torchrun=true", "observe.watchdog.no_progress_s=4", workspace=tmp_path)
    with pytest.raises(GangHang) as e:
        with Gang(spec, log_dir=str(tmp_path / "logs"), run_dir=str(tmp_path / "run")) as gang:
            gang.run(Command(spec).launch)
    result = e.value.result
    assert result.failure_kind == "hang" and result.hang_verdict is not None
    return result, gang, str(e.value)


def test_a_hang_names_the_rank_that_never_joined_from_its_flight_record(local_cluster, tmp_path):
    """a4ray's rank programs serve their flight record; the verdict rests on it and names collective #4."""
    result, gang, message = _hang(tmp_path, A4RAY_INIT)
    verdict = result.hang_verdict
    assert [c.rank for c in verdict.culprits] == [3], verdict
    culprit = verdict.culprits[0].node
    assert culprit.node == 1 and culprit.host == gang.node_ref(1).host and culprit.ip == gang.node_ref(1).ip
    assert verdict.collective.seq == 4 and verdict.collective.op == "gloo:all_reduce"
    assert verdict.collective.input_sizes == [[4]] and verdict.waiting == [0, 1, 2]
    assert verdict.evidence[0].startswith("flight recorder of rank(s) 0-3")
    # Every rank's record is in the run's logs; the one that never joined stopped at #3.
    records = {r: json.loads((tmp_path / "logs" / "flight-recorder" / f"rank_{r}.json").read_text()) for r in range(4)}
    assert max(e["collective_seq_id"] for e in records[3]["entries"]) == 3
    assert f"rank 3 on node 1 ({culprit.host}" in message and "never joined gloo:all_reduce #4" in message
    saved = json.loads((Path(result.hang_report) / "verdict.json").read_text())
    assert saved["culprits"][0]["rank"] == 3


def test_a_hang_in_a_users_program_names_the_rank_from_the_stacks(local_cluster, tmp_path):
    """A user's program on gloo serves no flight record: the stacks are the evidence, and the verdict says so."""
    result, gang, message = _hang(tmp_path, PLAIN_INIT)
    verdict = result.hang_verdict
    assert [c.rank for c in verdict.culprits] == [3] and verdict.culprits[0].node.node == 1, verdict
    assert verdict.culprits[0].where == "load_batch (stuck.py:8)"
    assert verdict.collective is None and verdict.waiting == [0, 1, 2]
    assert verdict.evidence[0].startswith("stacks of rank(s) 0-3 (no flight record: no flight-record server")
    assert re.search(r"culprit: rank 3 on node 1 \(\S+, 127\.0\.0\.\d+", message), message
