"""`python -m a4ray.nccl_test` on the local cluster of simulated nodes: the CPU rehearsal (the torch
benchmark over gloo under torchrun), the nccl-tests path (real mpirun through Ray; the CUDA-only binary
replaced by an MPI stand-in with the same flags and output), a missing nccl-tests, and bad-node
isolation with one really misconfigured node."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from a4ray import nccl_test
from a4ray.core.errors import ToolMissing
from a4ray.driver.execute import run
from a4ray.programs.collectives import bus_factor
from tests.conftest import job

STANDIN = Path(__file__).parent / "programs" / "nccl_tests_standin.py"


def test_cli_rehearsal_over_gloo_reports_every_collective(local_cluster, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = nccl_test.main(["--local-nodes", "2", "--gpus-per-node", "2", "--result", str(out),
                         "--set", f"storage.local_workspace={tmp_path}", "--set", "nccl.cpu_max_bytes=4M",
                         "--set", "nccl.iters=2", "--set", "nccl.warmup=1"])
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    result = json.loads(out.read_text())
    assert (result["ok"], result["implementation"], result["backend"]) == (True, "torch", "gloo")
    assert not result["thresholds_applied"] and "simulated nodes" in result["thresholds_note"]
    names = [c["collective"] for c in result["collectives"]]
    assert names == ["all_reduce", "all_gather", "reduce_scatter", "alltoall"]
    for c in result["collectives"]:
        rows = c["run"]["rows"]
        assert [r["size"] for r in rows] == [2**20, 2**21, 2**22]
        assert c["largest_bytes"] == 2**22 and c["busbw"] > 0 and c["ok"]
        assert len(c["run"]["devices"]) == 4
        for row in rows:
            for placement in ("out_of_place", "in_place"):
                t = row[placement]
                if t is not None:  # nccl-tests' formulas, over 4 ranks
                    assert t["wrong"] == 0
                    assert t["busbw"] == pytest.approx(t["algbw"] * bus_factor(c["collective"], 4), abs=0.011)
                    assert t["algbw"] == pytest.approx(row["size"] / t["time_us"] / 1e3, rel=0.01, abs=0.011)
    assert "busbw at the largest size (GB/s)" in printed and re.search(r"PASS: busbw GB/s at the largest", printed)


def _standin_binaries(tmp_path: Path) -> Path:
    bindir = tmp_path / "nccl-tests" / "build"
    bindir.mkdir(parents=True)
    binary = bindir / "all_reduce_perf"
    binary.write_text(f"#!{sys.executable}\nimport runpy\nrunpy.run_path({str(STANDIN)!r}, run_name='__main__')\n")
    binary.chmod(0o755)
    return bindir


def test_nccl_tests_path_runs_through_mpirun_on_every_gpu(local_cluster, tmp_path):
    spec = job("nccl_test", "cluster.nodes=3", "cluster.gpus_per_node=2",
               f"nccl.binaries_dir={_standin_binaries(tmp_path)}", "nccl.collectives=[all_reduce]",
               "nccl.min_bytes=64K", "nccl.max_bytes=1M", "nccl.factor=4", "nccl.iters=3", "nccl.warmup=1",
               workspace=tmp_path)
    result = run(spec)
    assert result.ok, result.verdict
    assert result.implementation == "nccl-tests"
    (c,) = result.collectives
    assert len(c.run.devices) == 6 and [r.size for r in c.run.rows] == [2**16, 2**18, 2**20]
    assert c.run.wrong == 0 and c.busbw > 0
    assert [n.status for n in result.gang.nodes] == ["succeeded", "standby", "standby"]
    logs = Path(result.gang.log_dir)
    assert "all_reduce_perf -b 64K -e 1M -f 4 -n 3 -w 1 -c 1 -d float -g 1" in (logs / "node-00.log").read_text()
    for rank in (1, 2):
        assert "orted" in (logs / f"node-{rank:02d}.log").read_text()


def test_missing_nccl_tests_names_the_nodes(local_cluster, tmp_path):
    spec = job("nccl_test", "cluster.nodes=2", "cluster.gpus_per_node=2", "nccl.implementation=nccl-tests",
               "nccl.binaries_dir=/nonexistent/nccl-tests/build", "nccl.collectives=[all_gather]", workspace=tmp_path)
    with pytest.raises(ToolMissing) as missing:
        run(spec)
    text = str(missing.value)
    assert "node 0" in text and "node 1" in text and "/nonexistent/nccl-tests/build/all_gather_perf" in text
    assert "nccl.implementation=auto" in text


@pytest.mark.slow
def test_isolation_names_the_misconfigured_node(extra_nodes, tmp_path):
    """Node 2's gloo is pointed at a NIC it does not have (as a node with a broken network setup would
    be): the all-node run fails, node pairs are tested, and node 2 is named."""
    nodes = extra_nodes(3, 1, node_env={2: {"GLOO_SOCKET_IFNAME": "a4ray-no-such-nic"}})
    spec = job("nccl_test", "cluster.nodes=3", "cluster.gpus_per_node=1", "cluster.stop_grace_s=3",
               "nccl.collectives=[all_reduce]", "nccl.cpu_min_bytes=1M", "nccl.cpu_max_bytes=1M", "nccl.iters=2",
               "nccl.warmup=1", "nccl.isolate=true", "timeout_s=120", *nodes.sets, workspace=tmp_path)
    result = run(spec)
    assert not result.ok
    iso = result.isolation
    assert [(b.rank, b.ip) for b in iso.bad_nodes] == [(2, nodes.ip(2))], iso
    assert [(t.nodes, t.ok) for t in iso.tests] == [([0, 1], True), ([0, 2], False)]
    assert "bad node(s): node 2" in result.verdict
    assert (Path(result.gang.log_dir) / "isolate" / "n0-n2" / "node-01.log").is_file()
