"""The docs site stays true to the code and builds: the reference pages generated from the code (docs/gen_reference.py)
are the committed ones, and `mkdocs build --strict` passes (a broken link or anchor, a page missing from the nav, a
missing snippet or a docstring mkdocstrings cannot read fails it). No cluster; seconds."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from conftest import REPO

GENERATOR = REPO / "docs" / "gen_reference.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_pages_are_what_the_code_generates():
    # A fresh interpreter: what this process imported before (other tests' result classes) must not shape the pages.
    check = subprocess.run([sys.executable, str(GENERATOR), "--check"], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 0, (f"{check.stderr}{check.stdout}\nThe reference pages in docs/reference/ are "
                                   "generated from the code: run `python docs/gen_reference.py` (or `make docs`) "
                                   "and commit what it writes.")


def test_every_file_the_run_directory_page_names_has_a_writer_in_the_code():
    gen = _generator()
    assert [writer for _, _, writer in gen.LAYOUT if not gen.writer_exists(writer)] == []


def test_the_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # Material's banner about its successor
    warnings = [line for line in build.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert build.returncode == 0, "\n".join(warnings) or build.stderr[-3000:]
    for page in ("index.html", "reference/job-spec/index.html", "reference/python-api/index.html",
                 "benchmarks/index.html"):
        assert (site / page).is_file(), page
    # The benchmarks page includes benchmarks/README.md itself (one file holds the figures), and the Python API page
    # holds what mkdocstrings read from a4ray.api.
    heading = next(line for line in (REPO / "benchmarks/README.md").read_text().splitlines() if line.strip())
    assert heading.lstrip("# ") in (site / "benchmarks/index.html").read_text()
    assert "get_run" in (site / "reference/python-api/index.html").read_text()
