"""`python -m a4ray.deepep_test` on the local cluster of simulated nodes, through mpirun over Ray and
directly from the node actors. DeepEP needs GPUs and NVSHMEM, so a stand-in test script with DeepEP's
launch contract and output format runs instead (tests/programs/deepep_standin): its ranks really
rendezvous at MASTER_ADDR as RANK x processes + local rank, so a wrong rank order would hang or fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from a4ray.core.errors import SpecError
from a4ray.driver.execute import run
from a4ray.driver.kinds import job_for
from tests.conftest import job

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
    assert result.verdict.startswith("PASS: 8/8 cases on each of 2 nodes")
    log = (Path(result.gang.log_dir) / "node-01.log").read_text()
    # DeepEP's env: the script sourced on the node, then the spec's value on top.
    assert "NVSHMEM_REMOTE_TRANSPORT=ibgda  [script unified-env.sh]" in log
    assert f"DEEP_EP_DEVICE_TO_HCA_MAPPING={HCA}  [deepep_test]" in log
    assert ("orted" in log) == (launcher == "mpi")


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
