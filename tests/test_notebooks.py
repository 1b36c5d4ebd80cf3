"""The notebooks in notebooks/ run top to bottom in a real Jupyter kernel (nbclient), each on the embedded local
cluster it starts; their key cells assert on what they show (a sweep row per variant with positive busbw, a
falling loss, the 4-node A4 plan and RayJob)."""

from __future__ import annotations

import nbformat
import pytest
from conftest import REPO, isolated_env, seed_standins
from nbclient import NotebookClient

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["nccl_sweep", "qwen3_next_rehearsal"])
def test_notebook_runs_top_to_bottom(name, tmp_path, standins):
    source = REPO / "notebooks" / f"{name}.ipynb"
    notebook = nbformat.read(source, as_version=4)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), f"{source}: clear its outputs in git"
    # A copy beside the repo's jobs/, so the notebook's workspace (.a4ray next to it) is this test's own.
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "jobs").symlink_to(REPO / "jobs")
    if name == "qwen3_next_rehearsal":  # its cluster starts in notebooks/: its stand-ins go there
        seed_standins(tmp_path / "notebooks", standins)
    client = NotebookClient(notebook, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path / "notebooks")}})
    client.execute(env=isolated_env(tmp_path))
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors
    shown = "".join(str(o.get("data", {}).get("text/html", "")) for c in code for o in c.outputs)
    assert "<table" in shown  # results render as tables in Jupyter
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)  # and plots as images
