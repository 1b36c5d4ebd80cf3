"""What a4ray's own Ray tasks print (the conversion's parts and verifier, the staging tasks) follows the rules rank
output does (`observe/stream.py`): each distinct warning shown once in the job's stream, everything in the run's
logs, no terminal colour codes; and nothing of it forwarded raw by Ray (`(task pid=N)` in colours)."""

from __future__ import annotations

import os
import re
import sys
import time

import pytest
import ray
from conftest import NODE_SECRET, REPO

from a4ray.observe import stream

NOISY = REPO / "tests" / "programs" / "noisy_task.py"
DEPRECATED = "load_common is deprecated and will be removed; use load_common_state_dict instead"
TRANSFORMERS = "[transformers] GPTModel IS DEPRECATED and will be removed; use GPTModel from megatron.core.models"
RAY_ITSELF = re.compile(r"\((raylet|gcs_server|pid=gcs_server|autoscaler|monitor|dashboard)[^)]*\)")


def without_ray_itself(lines: list[str]) -> list[str]:
    """The lines this driver heard, less what Ray's own processes said meanwhile, each message with its indented
    continuation lines: the session cluster's raylet says a node another test removed was 'marked dead' (over two
    lines, in colours, '[repeated 2x across cluster]'), its GCS that it failed to remove that node's bundles. What a
    task of a4ray's prints is judged; Ray's processes are not a4ray's to quiet."""
    kept, in_ray = [], False
    for line in lines:
        if RAY_ITSELF.search(line):
            in_ray = True
        elif not (in_ray and line[:1] in ("\t", " ")):
            in_ray = False
            kept.append(line)
    return kept


def test_what_an_a4ray_task_prints_follows_the_stream_rules(local_cluster, tmp_path, capfd):
    log = stream.TaskLog.open(tmp_path / "runs" / "convert-x" / "logs" / "convert", "verify")
    assert log.run == "convert-x"
    marker = f"a4ray-test-after-the-task {tmp_path.name}"

    @ray.remote(num_cpus=0)
    def verify_like(path: str) -> int:
        stream.captured(path, "runpy:run_path", str(NOISY))
        # Raw: Ray forwards each, after whatever the task printed before it on that stream.
        print(marker, flush=True)
        print(marker, file=sys.stderr, flush=True)
        return os.getpid()

    ray.get(verify_like.remote(str(log.path)), timeout=120)
    forwarded, deadline = "", time.monotonic() + 120
    while forwarded.count(marker) < 2:  # the event: Ray's forwarding reached the end of the task's stdout and stderr
        out, err = capfd.readouterr()
        forwarded += out + err
        if time.monotonic() > deadline:
            pytest.fail(f"Ray never forwarded the task's own marker line: {forwarded[-2000:]}")
        time.sleep(0.2)
    forwarded = "\n".join(without_ray_itself(forwarded.splitlines()))
    assert DEPRECATED not in forwarded and "GPTModel" not in forwarded and "comparing logits" not in forwarded
    assert "fd 2" not in forwarded and "\x1b[32m" not in forwarded, forwarded

    # Everything is in the run's logs: each copy, the C library's line, the bar where it got to, no colours, no secret.
    written = log.path.read_text().splitlines()
    assert sum(DEPRECATED in line for line in written) == 6 and written.count(TRANSFORMERS) == 3
    assert "verify: comparing logits" in written and "written by C to fd 2" in written
    assert "loading 100%" in written and not any("loading 10%" in line for line in written)
    assert not any("\x1b" in line or NODE_SECRET in line for line in written), written
    assert any(line.startswith("the node's key: ") for line in written)

    # The stream: each warning once, tagged with the task, then one line on the copies held back.
    stream.relay([log])
    shown = without_ray_itself(capfd.readouterr().out.splitlines())
    assert sum(DEPRECATED in line for line in shown) == 1 and shown.count(f"[verify] {TRANSFORMERS}") == 1, shown
    assert "[verify] verify: comparing logits" in shown and "[verify] loading 100%" in shown
    assert not any("\x1b" in line or "pid=" in line for line in shown), shown
    assert shown[-1] == (f"a4ray: library warnings: 2 shown once above came again from 1 task(s); every copy is in "
                         f"the task logs ({log.path.parent}/*.log)")

    # A second verification in the same run: only what it adds is shown, and no warning the run has shown.
    again = stream.TaskLog.open(log.path.parent, "verify")
    ray.get(verify_like.remote(str(again.path)), timeout=120)
    stream.relay([again])
    shown = without_ray_itself(capfd.readouterr().out.splitlines())
    assert not any(DEPRECATED in line or "GPTModel" in line for line in shown), shown
    assert shown.count("[verify] verify: comparing logits") == 1
    assert sum(DEPRECATED in line for line in log.path.read_text().splitlines()) == 12


def test_a_staging_task_writes_its_output_into_the_runs_logs(local_cluster, tmp_path):
    """The staging service's task (a detached actor's task: Ray would forward its output to whichever job started
    the service) writes into the requesting run's logs."""
    from a4ray.spec import ArtifactSpec, StageJob
    from a4ray.staging import stage
    from a4ray.staging.display import Display

    source = tmp_path / "src"
    source.mkdir()
    (source / "weights.bin").write_bytes(b"w" * 1000)
    spec = StageJob(artifacts=[ArtifactSpec(name="model", source=f"file://{source}", target="model")],
                    storage={"local_workspace": str(tmp_path / "ws")})
    logs = tmp_path / "runs" / "stage-x" / "logs"
    result = stage(spec, display=Display(every_s=3600, tty=False), log_dir=logs)
    assert result.artifacts[0].status == "ran" and (logs / "stage-model.log").is_file()
