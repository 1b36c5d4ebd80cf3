"""The stream's rules (`observe/stream.py`). A line several ranks print is shown once with their ranks, in each
rank's order, no line waiting longer than the bound for its copies, a traceback together; end to end, a public
program's report from 2 nodes x 2 ranks. And what a4ray's own Ray tasks print (the conversion's parts and verifier,
the staging tasks) follows the rules rank output does: each distinct warning shown once in the job's stream,
everything in the run's logs, no terminal colour codes; and nothing of it forwarded raw by Ray (`(task pid=N)` in
colours)."""

from __future__ import annotations

import os
import re
import sys
import time

from importlib.metadata import version

import pytest
import ray
from conftest import NODE_SECRET, REPO, job

from a4ray.observe import stream
from a4ray.runtime.gang import Gang
from a4ray.workloads.generic import Command

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


# ------------------------------------------------------------------------------- the same line from many ranks

class Clock:
    """The stream's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rank_lines(ranks: int = 4, **options) -> tuple[stream.RankLines, Clock, list[str]]:
    """A launch's rank lines of `ranks` ranks, two a node, what it prints in a list."""
    clock, shown = Clock(), []
    lines = stream.RankLines(stream.StreamFilter(), ranks=ranks, nodes=(ranks + 1) // 2, clock=clock,
                             write=shown.append, **options)
    return lines, clock, shown


def feed(lines: stream.RankLines, rank: int, *texts: str) -> None:
    for text in texts:
        lines.add(f"n{rank // 2} r{rank}", text, rank=rank, node=rank // 2)


def test_a_line_every_rank_prints_is_shown_once_with_its_ranks_in_order():
    lines, clock, shown = rank_lines()
    config = ["out_dir = 'out'", "batch_size = 12", "n_layer = 12", ""]
    for rank in (0, 1):  # node 0's poll
        feed(lines, rank, *config)
    assert lines.due() == stream.HOLD_S and shown == []  # waiting for the other ranks' copies
    clock.now += 0.15  # node 1's poll
    feed(lines, 2, *config)
    feed(lines, 3, *config[:2])
    # Those every rank printed are shown as the last copy comes; the others wait on, for the rest of their window.
    assert lines.due() == pytest.approx(stream.HOLD_S - 0.15)
    assert shown == ["[ranks 0-3] out_dir = 'out'", "[ranks 0-3] batch_size = 12"]
    feed(lines, 3, *config[2:])  # every rank has printed them: shown without waiting further
    lines.due()
    assert shown[2:] == ["[ranks 0-3] n_layer = 12", "[ranks 0-3] "]
    # Identical text only: a line with a rank's number in it is that rank's; ranks as compact ranges.
    for rank in (0, 1, 3):
        feed(lines, rank, f"rank {rank} ready", "model built")
    feed(lines, 2, "rank 2 ready", "model built on cpu")
    clock.now += stream.HOLD_S
    lines.due()
    assert shown[4:] == ["[n0 r0] rank 0 ready", "[n0 r1] rank 1 ready", "[n1 r3] rank 3 ready",
                         "[ranks 0-1, 3] model built", "[n1 r2] rank 2 ready", "[n1 r2] model built on cpu"]


def test_each_ranks_lines_keep_their_order_however_they_interleave():
    """Whatever order the ranks' lines come in, and whatever each rank prints of its own in between, the stream read
    back rank by rank (each line for every rank its tag names) is what each rank printed, in its order."""
    import random

    for seed in range(50):
        rng = random.Random(seed)
        common = [f"line {i}" for i in range(8)] + ["", "", "line 3"]
        printed = {}
        for rank in range(4):
            own = list(common)
            for _ in range(rng.randrange(3)):
                own.insert(rng.randrange(len(own) + 1), f"rank {rank} says {rng.randrange(1000)}")
            printed[rank] = own
        lines, clock, shown = rank_lines()
        queues = {rank: list(texts) for rank, texts in printed.items()}
        while any(queues.values()):
            rank = rng.choice([r for r, q in queues.items() if q])
            feed(lines, rank, queues[rank].pop(0))
            clock.now += rng.choice((0.0, 0.0, 0.01))
        lines.flush()
        read_back: dict[int, list[str]] = {rank: [] for rank in printed}
        for line in shown:
            tag, text = line[1:].split("] ", 1)
            for rank in stream_ranks(tag):
                read_back[rank].append(text)
        assert read_back == printed, f"seed {seed}: {shown}"
        assert len(shown) < sum(map(len, printed.values())) / 2  # and it is shorter


def stream_ranks(tag: str) -> list[int]:
    """The ranks a stream tag names: "n0 r1" -> [1], "ranks 0-1, 3" -> [0, 1, 3]."""
    if tag.startswith("n"):
        return [int(tag.split(" r")[1])]
    out = []
    for part in tag.removeprefix("ranks ").split(", "):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def test_a_line_only_one_rank_prints_is_shown_within_the_bound():
    """Rank 0 says something of its own every 0.1 s, the others are quiet; the driver wakes when `due` asks (as the
    supervisor does) or when a line comes. No line waits longer than HOLD_S, and they come in rank 0's order."""
    lines, clock, shown = rank_lines()
    read_at, waited = {}, []
    next_line, step, wait = clock.now, 0, None
    while step < 20 or wait is not None:
        never = float("inf")
        clock.now = min(next_line if step < 20 else never, clock.now + wait if wait is not None else never)
        if step < 20 and clock.now == next_line:
            read_at[f"rank 0 step {step}"] = clock.now
            feed(lines, 0, f"rank 0 step {step}")
            step, next_line = step + 1, next_line + 0.1
        wait = lines.due()
        assert wait is None or wait <= stream.HOLD_S
        for line in shown[len(waited):]:
            waited.append(clock.now - read_at[line.removeprefix("[n0 r0] ")])
    assert shown == [f"[n0 r0] {text}" for text in read_at] and max(waited) <= stream.HOLD_S


def test_copies_that_come_after_their_line_was_shown_are_one_line():
    """A node that starts late: its ranks' copies of lines already shown are counted and said in one line, before
    anything else of those ranks, or within FOLD_S."""
    lines, clock, shown = rank_lines()
    config = [f"config {i}" for i in range(5)]
    for rank in (0, 1):
        feed(lines, rank, *config)
    clock.now += stream.HOLD_S
    lines.due()
    assert shown == [f"[ranks 0-1] {text}" for text in config]
    clock.now += 3  # rank 2 prints the same, late, then a line of its own
    feed(lines, 2, *config, "rank 2 is last")
    assert lines.due() == stream.HOLD_S and len(shown) == 5
    clock.now += stream.HOLD_S
    lines.due()
    assert shown[5:] == ["[n1 r2] 5 more lines, copies of lines shown above (every copy is in the rank logs)",
                         "[n1 r2] rank 2 is last"]
    feed(lines, 3, *config)  # and rank 3, with nothing after
    assert lines.due() == stream.FOLD_S
    clock.now += stream.FOLD_S
    lines.due()
    assert shown[7:] == ["[n1 r3] 5 more lines, copies of lines shown above (every copy is in the rank logs)"]
    feed(lines, 3, "config 0")  # rank 3 printing it again: a line again
    lines.flush()
    assert shown[8:] == ["[n1 r3] config 0"]


def test_a_ranks_traceback_stays_together_and_identical_ones_are_folded():
    import traceback

    def trace(error: Exception) -> list[str]:
        try:
            raise error
        except Exception as e:  # noqa: BLE001 - formatted as Python prints it
            return "".join(traceback.format_exception(e)).splitlines()

    key_error, value_error = trace(KeyError("missing")), trace(ValueError("rank 1's shard is empty"))
    lines, clock, shown = rank_lines()
    for rank0, rank1 in zip(key_error, value_error, strict=False):  # read interleaved, line by line
        feed(lines, 0, rank0)
        feed(lines, 1, rank1)
    feed(lines, 1, *value_error[len(key_error):])
    feed(lines, 2, *key_error)
    feed(lines, 3, *key_error)
    clock.now += stream.HOLD_S
    lines.due()
    assert shown == [f"[ranks 0, 2-3] {text}" for text in key_error] + [f"[n0 r1] {text}" for text in value_error]
    # One that never reaches its exception line (the rank was killed as it printed) is shown as far as it got.
    feed(lines, 3, "Traceback (most recent call last):", '  File "train.py", line 9, in <module>')
    clock.now += stream.HOLD_S
    lines.due()
    assert shown[-2:] == ["[n1 r3] Traceback (most recent call last):",
                          '[n1 r3]   File "train.py", line 9, in <module>']


def test_a_warning_from_every_rank_is_shown_once_with_its_ranks():
    warning = "/venv/megatron/core/optimizer/__init__.py:24: UserWarning: Transformer Engine is not installed."
    lines, clock, shown = rank_lines()
    for rank in range(4):
        feed(lines, rank, warning, "  warnings.warn(")
    lines.due()
    assert shown == [f"[ranks 0-3] {warning}"]
    assert lines.stream.summary("rank-*.log") is None  # no copy held back: each is in the line shown
    feed(lines, 1, warning)  # again, later: the warning rule holds it back, and counts it
    clock.now += 10
    lines.flush()
    assert len(shown) == 1 and "1 shown once above came again from 1 rank(s)" in lines.stream.summary("rank-*.log")


def test_every_rank_shows_each_ranks_copy_at_once():
    """`observe.rank_lines: all`: the stream as it was, each rank's copy as it comes."""
    from a4ray.spec.loader import load_job

    assert load_job(None, ["command.argv=[true]", "observe.rank_lines=all"], kind="command").observe.rank_lines == "all"
    lines, clock, shown = rank_lines(every_rank=True)
    for rank in range(4):
        feed(lines, rank, "batch_size = 12")
    assert shown == [f"[n{rank // 2} r{rank}] batch_size = 12" for rank in range(4)] and lines.due() is None


TAGGED = re.compile(r"^\[(n\d+ r\d+|ranks [\d, -]+)\] (.*)$")
FOLDED = re.compile(r"^\[(n\d+ r\d+|ranks [\d, -]+)\] (\d+) more lines?( each)?, copies of lines shown above ")


def test_a_public_programs_lines_from_every_rank_are_shown_once_with_their_ranks(local_cluster, tmp_path, capfd):
    """A program no one here wrote, on 2 nodes x 2 ranks (a `command` job, a4ray's launcher: torchrun's contract):
    every rank prints the same 70-odd lines, and the stream shows each once with the ranks that printed it, while
    each rank's log keeps its every line.

    The program is torch's own `python -m torch.utils.collect_env` (torch is a dependency of a4ray): it prints the
    environment report (versions, OS, CPU, libraries) on every rank, as a trainer prints its config. No trainer that
    runs offline on CPU under torchrun installs with a4ray's dependencies: transformers' Trainer needs accelerate;
    nanoGPT, torchtitan and nanochat are not packages here or download their data and tokenizers; Ray Train's
    examples start workers of their own; megatron-core ships no training script. What the stream does with a
    program's lines depends on the lines and when they come, not on whether the program trains."""
    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=2", "command.argv=[-m,torch.utils.collect_env]",
               "command.torchrun=true", workspace=tmp_path)
    logs = tmp_path / "logs"
    gang = Gang(spec, log_dir=str(logs), run_dir=str(tmp_path / f"run-stream-{tmp_path.name}"))
    try:
        result = gang.run(Command(spec).launch)
    finally:
        gang.close()
    assert result.ok, result
    out = capfd.readouterr().out.splitlines()

    # Every rank's log has the whole report.
    printed = {rank: (logs / f"rank-{rank:04d}.log").read_text().splitlines() for rank in range(4)}
    report = [line for line in printed[0][printed[0].index("Collecting environment information..."):] if line.strip()]
    assert len(report) > 50 and "PyTorch version: " + version("torch") in report
    assert all(rank_lines.count(line) >= 1 for rank_lines in printed.values() for line in report)

    # The stream: each line of it once, with the ranks that printed it; a rank it does not name printed a copy that
    # came after the line was shown, and a line of its own says how many.
    tagged = [(stream_ranks(m.group(1)), m.group(2)) for line in out if (m := TAGGED.match(line))]
    folded = {rank for line in out if (m := FOLDED.match(line)) for rank in stream_ranks(m.group(1))}
    common = [line for line in dict.fromkeys(report) if all(line in lines for lines in printed.values())]
    for line in common:
        shown = [ranks for ranks, text in tagged if text == line]
        assert len(shown) == 1, (line, shown, out)
        assert set(shown[0]) | folded == {0, 1, 2, 3}, (line, shown, out)
    before, after = sum(map(len, printed.values())), len(tagged)
    print(f"the stream showed {after} rank lines for the {before} the 4 ranks printed", file=sys.stderr)
    assert after < before / 3, out
