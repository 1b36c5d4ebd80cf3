"""`python -m a4ray.deepep_test` on the local cluster of simulated nodes, through mpirun over Ray and
directly from the node actors; the judgement of DeepEP's real intranode and low-latency output; the build's
refusal where a node lacks what DeepEP needs. DeepEP needs GPUs and NVSHMEM, so a stand-in test script with DeepEP's
launch contract and output format runs instead (tests/programs/deepep_standin): its ranks really
rendezvous at MASTER_ADDR as RANK x processes + local rank, so a wrong rank order would hang or fail."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from a4ray.builds.builder import BuildFailed
from a4ray.core.errors import SpecError
from a4ray.driver.execute import run
from a4ray.driver.kinds import job_for
from conftest import job, scrape_until

STANDIN = Path(__file__).parent / "programs" / "deepep_standin"
HCA = "0:mlx5_0:1,1:mlx5_1:1"


def _spec(tmp_path, *sets):
    return job("deepep_test", "cluster.nodes=2", "cluster.gpus_per_node=2", "deepep.num_processes=2",
               "deepep.num_experts=8", f"deepep.deepep_dir={STANDIN}", f"deepep.env_script={STANDIN}/unified-env.sh",
               f'deepep.env.DEEP_EP_DEVICE_TO_HCA_MAPPING="{HCA}"', "cluster.stop_grace_s=3", "timeout_s=180", *sets,
               workspace=tmp_path)


@pytest.mark.parametrize("launcher", ["mpi", "direct"])
def test_deepep_internode_launch(local_cluster, tmp_path, launcher):
    result = run(_spec(tmp_path, f"deepep.launcher={launcher}"))
    assert result.ok, result.verdict
    assert [r.node for r in result.reports] == [0, 1]
    assert all((r.cases, r.passed) == (8, 8) and r.layout_ms == 0.101 for r in result.reports)
    assert set(result.reports[1].best) == {"dispatch FP8", "dispatch BF16", "combine"}
    assert result.verdict.startswith("PASS: internode 8/8 cases on each of 2 nodes")
    log = (Path(result.gang.log_dir) / "node-01.log").read_text()
    # DeepEP's env: the script sourced on the node, then the spec's value on top.
    assert "NVSHMEM_REMOTE_TRANSPORT=ibgda  [script unified-env.sh]" in log
    assert f"DEEP_EP_DEVICE_TO_HCA_MAPPING={HCA}  [deepep_test]" in log
    assert ("orted" in log) == (launcher == "mpi")
    # DeepEP's best bandwidths at the slowest node, for the dashboard's Fabric bandwidth panel
    run_id = Path(result.gang.log_dir).parent.name
    [internode] = result.runs
    gauges = scrape_until(rf'^ray_a4ray_fabric_gbps\{{.*run="{run_id}"', lambda g: len(g) == len(internode.figures))
    scraped = {re.search(r'figure="([^"]+)"', g).group(1): float(g.split()[-1]) for g in gauges}
    assert scraped == pytest.approx(internode.figures, rel=1e-6) and len(scraped) >= 3, gauges
    assert all('test="deepep internode"' in g and 'nodes="0,1"' in g for g in gauges), gauges


def test_deepep_refuses_uneven_experts_and_one_node(tmp_path):
    with pytest.raises(SpecError, match=r"256 experts do not divide evenly over 24 ranks .* 264"):
        job_for(job("deepep_test", "cluster.nodes=3", workspace=tmp_path)).check()
    with pytest.raises(SpecError, match="at least 2 nodes"):
        job_for(job("deepep_test", "cluster.nodes=1", workspace=tmp_path)).check()


def test_mpi_rank_on_the_wrong_node_refuses_to_start():
    """Under mpirun, a rank whose MPI rank is not its node's gang rank (a hostfile out of topology order)
    stops at once with a reason, instead of hanging in DeepEP's rendezvous as the seeds could."""
    import subprocess

    from a4ray.workloads.internode import _MPI_GUARD

    run_guard = lambda mpi, node: subprocess.run(  # noqa: E731
        ["bash", "-c", _MPI_GUARD, "deepep", "bash", "-c", 'echo "RANK=$RANK"'], capture_output=True, text=True,
        env={"PATH": "/usr/bin:/bin", "OMPI_COMM_WORLD_RANK": mpi, "A4RAY_NODE_RANK": node})
    wrong = run_guard("1", "0")
    assert wrong.returncode == 97 and "MPI rank 1 runs on gang node 0" in wrong.stderr
    right = run_guard("1", "1")
    assert right.returncode == 0 and right.stdout.strip() == "RANK=1"


def test_missing_env_script_names_the_node(local_cluster, tmp_path):
    from a4ray.core.errors import EnvScriptFailed

    with pytest.raises(EnvScriptFailed, match=r"node \d .*cannot source /nonexistent/unified-env.sh: no such file"):
        run(_spec(tmp_path, "deepep.launcher=direct", "deepep.env_script=/nonexistent/unified-env.sh"))


FIXTURES = Path(__file__).parent / "fixtures"


def _real(name: str) -> list[tuple[int, str]]:
    return [(0, line) for line in (FIXTURES / name).read_text().splitlines()]


def test_intranode_and_low_latency_held_to_the_spec_thresholds(tmp_path):
    """DeepEP's real output on 2 x H200 (tests/fixtures/deepep_8a07e7e_*_2xh200.txt) judged as a run of one node:
    the figures at the slowest rank, each against its threshold; a missing figure is a failure, not a pass."""
    from a4ray.runtime.launch import GangResult
    from a4ray.workloads.internode import DeepEPTest

    spec = job("deepep_test", "cluster.nodes=1", "cluster.gpus_per_node=2", "deepep.tests=[intranode,low_latency]",
               'deepep.thresholds={"intranode": {"dispatch BF16 NVL": 300, "combine NVL": 300}, '
               '"low_latency": {"dispatch": 250, "dispatch+combine": 100}}', workspace=tmp_path)
    test = DeepEPTest(spec)
    test.check()
    ended = GangResult(job="deepep", launch_id="l", ok=True)
    intranode = test.judge("intranode", [0], _real("deepep_8a07e7e_intranode_2xh200.txt"), ended)
    assert not intranode.ok and intranode.problems == ["combine NVL 287.24 < 300 GB/s"]
    assert intranode.figures["dispatch BF16 NVL"] == 339.25
    low = test.judge("low_latency", [0], _real("deepep_8a07e7e_low_latency_2xh200.txt"), ended)
    assert low.ok and low.figures["dispatch"] == 255.83, low.problems
    assert test.describe(low, 1) == "low_latency: dispatch 255.8, combine 360.7, dispatch+combine 307.2 GB/s"
    failed = GangResult(job="deepep", launch_id="l", ok=False, failure="node 0 (vm) exited with code 1; last lines:")
    timeout = [(0, "DeepEP timeout for dispatch receivers, rank 0, responsible_channel = 3, tokens remained: 17")]
    stuck = test.judge("intranode", [0], timeout, failed)
    assert not stuck.ok and stuck.problems[0] == ("node 0: DeepEP timeout for dispatch receivers, rank 0, "
                                                  "responsible_channel = 3, tokens remained: 17")


def test_deepep_build_refused_naming_what_the_node_lacks(local_cluster, tmp_path):
    """No DeepEP at deepep_dir: a4ray would build it, and says first what the node lacks for that: here CUDA 13's
    CCCL headers (a stand-in toolkit: an nvcc script, no GPU here) and NVSHMEM."""
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "bin" / "nvcc").write_text('#!/bin/sh\necho "Cuda compilation tools, release 13.0, V13.0.88"\n')
    (cuda / "bin" / "nvcc").chmod(0o755)
    (tmp_path / "nvshmem").mkdir()
    spec = job("deepep_test", "cluster.nodes=1", "cluster.gpus_per_node=1", "deepep.tests=[low_latency]",
               f"deepep.deepep_dir={tmp_path}/no-deepep", "deepep.env_script=", f"deepep.build.cuda_home={cuda}",
               f"deepep.build.nvshmem_dir={tmp_path}/nvshmem", "deepep.build.gpu_arch=9.0", workspace=tmp_path)
    with pytest.raises(BuildFailed) as refused:
        run(spec)
    text = str(refused.value)
    assert text.startswith("cannot build deepep: node 0 (")
    assert "the CCCL headers: cuda/std/tuple is in neither" in text and "NVSHMEM: no include/ and lib/" in text
