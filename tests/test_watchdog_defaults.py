"""With nothing configured, on the A4 shape in miniature (2 nodes x 2 gloo ranks, real `a4ray run`s on their own
embedded clusters, started in the background as the suite starts: tests/watchdog_defaults.py): a plain hung
program, whose waiting ranks print the same warnings every second, is judged within 5 minutes naming the rank
outside the collective; a quiet healthy program that computes for 4 minutes without a line is left to finish."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import WATCHDOG_DEFAULTS_ENV, isolated_env
from watchdog_defaults import QUIET_S, RUNS, start, wait

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[Path]:
    root = os.environ.get(WATCHDOG_DEFAULTS_ENV)
    if not root:
        root = tmp_path_factory.mktemp("watchdog-defaults")  # the conftest did not start them: start them now
        start(root, isolated_env(root))
        yield root
        return
    yield Path(root)
    # The conftest's runs are in /tmp, outside pytest's tmp_path: removed once both have ended (else kept to read).
    if all((Path(root) / name / "rc").is_file() for name in RUNS):
        shutil.rmtree(root, ignore_errors=True)


def test_a_plain_hang_is_judged_within_five_minutes_and_repeated_warnings_are_no_news(runs):
    code, out = wait(runs, "hung", timeout_s=600)
    assert code == 1, out[-3000:]
    result = json.loads((runs / "hung" / "result.json").read_text())
    gang = result["gang"]
    verdict = gang["hang_verdict"]
    assert [c["rank"] for c in verdict["culprits"]] == [3] and verdict["waiting"] == [0, 1, 2], out[-3000:]
    # A user's gloo program serves no flight record: the stacks are the evidence. Rank 1's data-loader worker is
    # dumped under its own label, in its dataset, never read as rank 1.
    assert verdict["collective"] is None and "program.py" in verdict["culprits"][0]["where"], verdict
    assert verdict["evidence"][0].startswith("stacks of rank(s) 0-3 (no flight record: no pipe"), verdict
    summary = (Path(gang["hang_report"]) / "summary.txt").read_text()
    assert re.search(r"rank r1:pid\d+ in data loading", summary) and "ranks 0-2 in all_reduce" in summary, summary
    stopped = float(re.search(r"rank 3 stops joining at ([\d.]+)", out).group(1))
    assert gang["times"]["verdict_at"] - stopped < 300, gang["times"]
    # Each warning shown once; the copies held back were no news to the watchdog (else no window would close).
    assert out.count("the same warning, every second") == 1 and out.count("Failed to check the") == 1, out[-3000:]
    assert out.count("verdict: ") == 1 and "FAILED: the launch hung (rank 3; the verdict above)" in out


def test_a_quiet_healthy_program_computing_for_four_minutes_is_left_to_finish(runs):
    code, out = wait(runs, "quiet", timeout_s=QUIET_S + 300)
    assert code == 0, out[-3000:]
    assert out.count("no rank waits in a collective") == 1 and out.count(": not a hang") == 1, out[-3000:]
    assert "computed" in out
