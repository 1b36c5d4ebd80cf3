"""The notebooks in notebooks/ run top to bottom in a real Jupyter kernel (nbclient); their key cells assert on what
they show. `nccl_sweep` starts the embedded local cluster it connects to (a sweep row per variant with positive
busbw); `qwen3_next_rehearsal` runs on the `a4ray local up` of tests/test_dashboard.py, whose dashboard and
Prometheus then show its run (a falling loss, its goodput, the 4-node A4 plan and RayJob)."""

from __future__ import annotations

import pytest
from conftest import isolated_env, run_notebook

pytestmark = pytest.mark.slow


def test_the_nccl_sweep_notebook_runs_top_to_bottom_on_the_embedded_cluster_it_starts(tmp_path):
    run_notebook("nccl_sweep", tmp_path, isolated_env(tmp_path))
