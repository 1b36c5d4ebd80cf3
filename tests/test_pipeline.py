"""The local rehearsal end to end: `python -m a4ray.qwen3_next` with no cluster (the README's main command).

One run in its own embedded cluster of 2 simulated nodes, every step for real: stand-ins staged with the
real staging code; Qwen3-Next-tiny converted natively (verified by its exact round trip and by its logits
against transformers' model); the doctor; and the Megatron trainer training Qwen3-Next-tiny itself
(megatron-core GPTModel on its local layers, gated DeltaNet on mcore's torch reference, expert parallelism
across the two nodes, GPTDataset over the staged .bin/.idx) from the converted checkpoint, with one rank killed while
a checkpoint is being written: the restart policy relaunches the gang, training resumes from the newest
complete checkpoint (the partial one is named and skipped), the loss falls, every saved checkpoint loads back through megatron-core equal to
what was saved, and the A4 plan is printed. Then, on the session cluster, the same spec again: every step
but the preflight is cached; and `--skip` of a step whose outputs are missing fails naming them.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from conftest import PYTHON, REPO, isolated_env, run_to_end, seed_standins
from upstream import PAI_DLC_ENV, PAI_RUN_ARGS, pai_standin

from a4ray.driver.main import main as pipeline_main
from a4ray.pipeline.runner import PipelineResult

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the rehearsal runs in the first test that reads it
PROFILE = str(REPO / "jobs" / "qwen3_next_local.yaml")
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) .*\| lm loss: ([0-9.E+-]+)")
_CHECK_SAVE = re.compile(r"check-save (iter_\d+): loaded back through megatron-core: model tensors equal (\d+)/(\d+), "
                         r"optimizer state tensors equal (\d+)/(\d+)")


def _kill_a_rank_while_a_checkpoint_is_written(workspace: Path, save: Path, killed: list,
                                               stop: threading.Event) -> None:
    """SIGKILL the trainer process of rank 1 (a crashed GPU, say) while a checkpoint after iteration 10's is being
    written in the background (an async save): once a save's `.iter_NNNNNNN.tmp` directory has its first data file
    and rank 0 has logged that training went on (its "to host memory" line, in its rank log: a line printed once the
    gang is stopping goes to the logs only, and rank 0 must not be stopped before it says it). Rank 1 is found once
    iteration 10's is complete, so the kill lands within milliseconds of the write's start, long before the save
    could be finalized (every rank, at a later iteration)."""
    victim = None
    while not stop.is_set():
        if victim is None and (save / "iter_0000010" / "metadata.json").is_file():
            for proc in psutil.process_iter(["pid", "cmdline"]):
                cmd = " ".join(proc.info["cmdline"] or [])
                if "a4ray.mcore" in cmd and str(save) in cmd and "a4ray.runtime.ranks" not in cmd:
                    try:  # the trainer itself, not its async writer (a child, with its RANK and command line)
                        if proc.environ().get("RANK") == "1" and "RANK" not in proc.parent().environ():
                            victim = proc
                    except psutil.Error:
                        continue
        writing = [p.parent.name for p in save.glob(".iter_*.tmp/*.distcp")] if victim is not None else []
        if writing and _rank0_said(workspace, writing[0]):
            try:
                victim.kill()
            except psutil.Error:
                return
            killed.append((victim.pid, writing[0]))
            return
        time.sleep(0.005)


def _rank0_said(workspace: Path, writing: str) -> bool:
    """Whether rank 0's log says the save being written (".iter_0000020.tmp") left host memory: training went on."""
    iteration = int(writing.removeprefix(".iter_").removesuffix(".tmp"))
    said = f"saved checkpoint iteration {iteration} to host memory in "
    return any(said in log.read_text(errors="replace") for log in workspace.glob(".a4ray/runs/*/logs/train/rank-0000.log"))


@dataclass(frozen=True)
class Rehearsal:
    """The killed-rank rehearsal, run once for the module's tests: its workspace, what it printed, its result and
    the rank it killed (pid, the partial checkpoint directory it was writing)."""

    workspace: Path
    out: str
    result: dict
    killed: tuple[int, str]

    @property
    def steps(self) -> dict[str, dict]:
        return {s["name"]: s for s in self.result["steps"]}

    @property
    def run_dir(self) -> Path:
        return Path(self.result["run_dir"])

    @property
    def save(self) -> Path:
        return self.workspace / ".a4ray" / "logs" / "output_megatron_qwen3_next_pretrain" / "checkpoint"


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory, standins) -> Rehearsal:
    """`python -m a4ray.qwen3_next` with no cluster (the README's main command) in a checkout of its own, with one
    rank killed while a checkpoint is being written: the whole pipeline, every step for real, and a restart."""
    workspace = tmp_path_factory.mktemp("rehearsal")
    seed_standins(workspace, standins)
    save = workspace / ".a4ray" / "logs" / "output_megatron_qwen3_next_pretrain" / "checkpoint"
    killed: list[tuple[int, str]] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_a_rank_while_a_checkpoint_is_written, args=(workspace, save, killed, stop),
                              daemon=True)
    killer.start()
    cmd = [PYTHON, "-m", "a4ray.qwen3_next", "--set", "restart.max_restarts=1", "--set", "restart.backoff_s=1",
           "--set", "train.megatron.check_save=true", "--result", "r1.json"]
    try:
        run = run_to_end(cmd, cwd=workspace, env=isolated_env(workspace), timeout=600)
    finally:
        stop.set()
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert killed, "the trainer finished before a rank could be killed"
    return Rehearsal(workspace, run.stdout, json.loads((workspace / "r1.json").read_text()), killed[0])


def test_the_rehearsal_runs_every_step_for_real_and_records_it(rehearsal):
    out, result, steps = rehearsal.out, rehearsal.result, rehearsal.steps
    assert f"local profile {PROFILE}" in out
    assert [s["name"] for s in result["steps"]] == ["stage", "convert", "preflight", "train"]
    assert [s["status"] for s in result["steps"]] == ["ran", "ran", "ran", "ran"]
    assert "Ray tasks of the staging service" in steps["stage"]["runs"]
    assert PipelineResult.model_validate(result).model_dump(mode="json") == result  # the typed result, whole
    # The preflight held the free space where the checkpoints go to the 3 the run saves, reckoned from the model.
    disk = [c for c in steps["preflight"]["result"]["checks"] if c["name"] == "disk"]
    assert len(disk) == 2 and all(c["status"] == "ok" and str(rehearsal.save) in c["detail"] and
                                  c["detail"].endswith("the 3 checkpoints of ~4.8 MiB each fit") for c in disk), disk
    # ... and each node's own RAM disk to the local checkpoints it holds: its part and the other node's replica.
    local = [c for c in steps["preflight"]["result"]["checks"] if c["name"] == "local checkpoints"]
    assert len(local) == 2 and len({c["detail"].split(" in ")[1].split(":")[0] for c in local}) == 2, local
    assert all(c["status"] == "ok" and c["detail"].endswith("the local checkpoints' 9.6 MiB fit") for c in local), local

    # Qwen3-Next converted natively, verified tensor by tensor and by its logits; nothing stands in for it.
    (verdict,) = steps["convert"]["detail"].splitlines()
    assert "Qwen3-Next-tiny" in verdict and "round trip 154/154 HF tensors identical" in verdict
    assert "top-1 agreement 100.0%" in verdict
    assert not [line for line in out.splitlines() if "stand-in" in line and "train" in line] and "Qwen3-MoE" not in out
    run_dir = rehearsal.run_dir
    assert (run_dir / "spec.yaml").is_file() and (run_dir / "plan.txt").is_file()
    assert (run_dir / "logs" / "train" / "node-01.log").is_file()
    assert (run_dir / "logs" / "preflight" / "node-00.log").is_file()  # every step writes under the one run dir


def test_the_megatron_trainer_trains_qwen3_next_tiny_and_resumes_past_a_killed_rank(rehearsal):
    """Qwen3-Next-tiny from its converted checkpoint, expert parallel across the two nodes; the rank killed while a
    checkpoint was written failed the gang, the restart relaunched it, and the trainer resumed from the newest
    complete checkpoint (the partial one named and skipped); the loss falls over iterations 1..30."""
    out = rehearsal.out
    assert "a4ray.mcore: loaded model weights from " in out and "Qwen3-Next-tiny-to-mcore" in out
    assert "a4ray.mcore: model: qwen3_next: 4 layers (3 gated DeltaNet, 1 gated attention)" in out
    assert "gated delta rule: megatron-core's torch reference (torch_chunk_gated_delta_rule): no GPU" in out
    assert "ep 2 dp 2" in out and "distributed optimizer: on" in out
    train = rehearsal.steps["train"]["result"]
    restart = [line for line in out.splitlines() if re.search(r"attempt 1/1|keep off|straggler|restarting", line)]
    assert "attempt 1/1: relaunching on the same gang; the trainer resumes from checkpoint iteration" in out, restart
    _, writing = rehearsal.killed
    partial = int(writing.removeprefix(".iter_").removesuffix(".tmp"))
    resumed, persisted = train["start_iteration"], partial - 10
    assert (f"a4ray.mcore: not loading checkpoint iteration {partial}: {writing}: its save did not finish (a rank "
            f"died while writing it); the newest complete one is iteration {persisted}") in out, rehearsal.killed
    # The newest checkpoint is the local one (every 5, saved beside each persistent one too), on each node's own RAM
    # disk: of the iteration whose persistent save the kill cut short.
    assert resumed == partial and (f"a4ray.mcore: resuming from local checkpoint iteration {resumed} (newer than "
                                   f"the persistent checkpoint iteration {persisted})") in out
    assert (f"a4ray.mcore: local checkpoint iteration {resumed}: every rank's part from its own node's storage"
            in out)
    assert train["iterations"] == 30 and train["world_size"] == 2 and train["backend"] == "gloo"
    lines = [m.groups() for log in sorted((rehearsal.run_dir / "logs" / "train").glob("rank-*.log"))
             for m in map(_ITERATION.search, log.read_text().splitlines()) if m]
    losses = {int(i): float(loss) for i, _, loss in lines}  # both attempts: 1..killed, then resumed + 1..30
    assert set(losses) == set(range(1, 31)) and losses[30] < losses[1] - 1.0, losses
    printed: dict[int, list[str]] = {}
    for i, _, loss in lines:
        printed.setdefault(int(i), []).append(loss)
    # done before the kill and again after it: at most the iterations the async write overlapped (often none); the
    # same loss, digit for digit (the lost-node test below redoes more, and checks the same)
    redone = [i for i, seen in printed.items() if len(seen) == 2]
    assert all(i > resumed for i in redone) and all(len(set(printed[i])) == 1 for i in redone), printed
    history = PipelineResult.model_validate(rehearsal.result).progress()  # the run's metrics, from its iteration lines
    assert [p.iteration for p in history] == list(range(1, 31)) and history[-1].loss == losses[30]
    assert "progress: iteration 30/30" in out and "tokens/s" in out


def test_interval_saves_are_async_and_the_last_loads_back_equal_and_complete(rehearsal):
    """The interval's saves block training only for the copy and are written in the background; one counts only once
    every rank's part is written (the one the kill cut short never did: the resume above). The last save is
    synchronous and loads back through megatron-core with every tensor equal to what was saved; Megatron-LM's
    layout: iter_0000030/ complete, the tracker written last."""
    out = rehearsal.out
    for iteration in (10, 20):  # 20's write is the one the kill cut short
        assert f"a4ray.mcore: saved checkpoint iteration {iteration} to host memory in " in out
    assert re.search(r"a4ray.mcore: checkpoint iteration 10 complete: written in the background in [0-9.]+s; the "
                     r"newest to resume from", out)
    assert "a4ray.mcore: checkpoint iteration 20 complete" not in out  # the restart resumed at 20: its next save is 30
    checked = {m.group(1): m.groups()[1:] for m in _CHECK_SAVE.finditer(out)}
    assert set(checked) == {"iter_0000030"}
    # goodput: what a save blocked (w, the model's) and what an async save wrote after training went on, apart
    goodput = rehearsal.steps["train"]["result"]["goodput"]
    assert 0 < goodput["checkpoint_save_s"] < 5 and 0 < goodput["background_save_s"] < 30, goodput
    (incident,) = goodput["incidents"]
    assert incident["redone_iterations"] <= 5, incident  # at most one local interval
    assert all(a == b and c == d and int(b) > 0 for a, b, c, d in checked.values()), checked
    save, final = rehearsal.save, rehearsal.save / "iter_0000030"
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "30"
    assert {"metadata.json", "common.pt", ".metadata"} <= {p.name for p in final.iterdir()}
    assert rehearsal.steps["train"]["result"]["checkpoint"] == str(final)
    assert f"train: checkpoint: {final}" in rehearsal.out


def test_the_stream_says_each_thing_once_and_points_at_the_a4_plan(rehearsal, capsys):
    _stream_says_each_thing_once(rehearsal.out, rehearsal.run_dir)
    # What the same run launches on A4: one line pointing at the plan, which --dry-run prints node by node.
    a4 = [line for line in rehearsal.out.splitlines() if line.startswith("on A4, ")]
    assert len(a4) == 1 and a4[0].endswith("every node's command and env: python -m a4ray.qwen3_next --dry-run")
    capsys.readouterr()
    assert pipeline_main("qwen3_next", ["--dry-run"]) == 0
    plan = capsys.readouterr().out
    for rank in (0, 1):
        assert (f"node {rank}:\n    cd /mnt/Pai-Megatron-Patch/examples/qwen3_next\n    bash run_mcore_qwen3.sh dlc A3B 1 "
                f"16 1e-05 1e-06 1024 1024 bf16 1 1 1 1 8 ") in plan


def test_the_rehearsal_again_on_another_cluster_is_cached_and_a_skip_names_missing_outputs(rehearsal, local_cluster,
                                                                                        monkeypatch, capsys):
    """The same spec again, on the session cluster: every step is current. Then `--skip` of a step whose outputs are
    missing: the pipeline stops there and names them."""
    monkeypatch.chdir(rehearsal.workspace)
    assert pipeline_main("qwen3_next", ["--config", PROFILE, "--skip", "preflight", "--set",
                                        "train.megatron.check_save=true", "--result", "r2.json"]) == 0
    again = json.loads((rehearsal.workspace / "r2.json").read_text())
    assert [s["status"] for s in again["steps"]] == ["cached", "cached", "skipped", "cached"]
    assert "OK: 3 artifact(s) (3 cached)" in again["steps"][0]["detail"]
    assert again["steps"][3]["detail"].startswith("finished ")

    capsys.readouterr()
    assert pipeline_main("qwen3_next", ["--config", PROFILE, "--skip", "stage,convert", "--set", "train.trainer=pai",
                                        "--set", "train.pai.parallel.ep=1", "--set", "convert.output=ckpts/none-yet",
                                        "--result", "r3.json"]) == 1
    skipped = json.loads((rehearsal.workspace / "r3.json").read_text())
    assert [s["status"] for s in skipped["steps"]] == ["skipped", "failed", "not-run", "not-run"]
    assert skipped["steps"][0]["detail"] == "--skip stage; its outputs are there (5 checked)"
    latest = rehearsal.workspace / ".a4ray" / "ckpts" / "none-yet" / "latest"
    assert skipped["steps"][1]["detail"] == (
        f"step convert is skipped (--skip convert), but its outputs are missing: the converted checkpoint "
        f"(convert.output/latest) ({latest}/latest_checkpointed_iteration.txt)\n  hint: run the convert step "
        f"(drop --skip convert)")
    assert "FAILED at convert: step convert is skipped" in capsys.readouterr().out


def _local_parts(node_dir: Path, iteration: int) -> list[Path]:
    """The local checkpoint files of `iteration` a simulated node holds (its ranks' parts and the replicas)."""
    return list(node_dir.glob(f"shm/a4ray-local-checkpoints/*/iter_{iteration:07d}_*_local.pt"))


def test_a_spare_in_a_lost_nodes_place_resumes_from_its_replica_of_the_local_checkpoint(rehearsal, extra_nodes,
                                                                                       monkeypatch, capfd):
    """The rehearsal's training again (its stage and convert are cached), on 2 nodes and a spare: node 0 is lost
    between local checkpoint 15 and persistent checkpoint 20, taking its RAM disk along. The spare takes its place,
    and its rank loads node 0's part of local checkpoint 15 from the replica node 1 holds: nothing older than the
    local interval is redone, and the redone iterations' losses are the first attempt's, digit for digit. The run
    removes its local checkpoints when it ends with a persistent one."""
    cluster = extra_nodes(nodes=3, gpus=1)
    node_dirs = {i: Path(cluster.session._node_dir(cluster._index[i])) for i in cluster.workers}
    monkeypatch.chdir(rehearsal.workspace)
    lost: list[int] = []

    def lose_node_0_after_local_15():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            held = {i: len(_local_parts(d, 15)) for i, d in node_dirs.items()}
            if sorted(held.values()) == [0, 2, 2]:  # both ranks' parts, each on both gang nodes
                victim = min(i for i, n in held.items() if n)  # the first gang node in topology order: node 0
                cluster.remove_node(victim)
                lost.append(victim)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=lose_node_0_after_local_15, daemon=True)
    killer.start()
    # Not the straggler check: on a loaded machine node 1 may read slower, and a restart keeps off a straggler too,
    # which leaves no node for the spare's gang (seen in the suite).
    # 20 iterations, not the profile's 30: the persistent save at 20 is the run's last, what a lost node must beat.
    sets = ["train.output=logs/lost-node", "train.iterations=20", "cluster.spare_nodes=1", "restart.max_restarts=1",
            "restart.backoff_s=1", "observe.straggler.enabled=false", *cluster.sets]
    code = pipeline_main("qwen3_next", ["--config", PROFILE, "--skip", "preflight", *[a for s in sets
                                                                                     for a in ("--set", s)],
                                        "--result", "lost.json"])
    killer.join(timeout=5)
    out = capfd.readouterr().out
    assert code == 0 and lost, out[-6000:]
    assert re.search(r"spare node 2 \(.*\) takes the place of node 0 \(sim-host-\d+\), which was lost", out), out
    # The spare is launch node 1 now (nodes go in topology order): its rank's part comes from the other node.
    assert ("a4ray.mcore: local checkpoint iteration 15: rank 1's part from the replica on rank(s) 0 (their own "
            "storage has none); the others' from their own") in out
    assert "a4ray.mcore: resuming from local checkpoint iteration 15 (newer than the persistent checkpoint " \
           "iteration 10)" in out
    train = json.loads((rehearsal.workspace / "lost.json").read_text())["steps"][3]["result"]
    assert train["start_iteration"] == 15 and train["iterations"] == 20
    run_dir = Path(json.loads((rehearsal.workspace / "lost.json").read_text())["run_dir"])
    losses: dict[int, set[str]] = {}
    for log in run_dir.glob("logs/train/rank-*.log"):
        for m in filter(None, map(_ITERATION.search, log.read_text().splitlines())):
            losses.setdefault(int(m.group(1)), set()).add(m.group(3))
    redone = [i for i in range(16, 21) if i in losses]
    assert redone and all(len(losses[i]) == 1 for i in losses), losses  # redone: the same loss, to every digit
    assert not [d for d in node_dirs.values() if list(d.glob("shm/a4ray-local-checkpoints/*"))]


def _stream_says_each_thing_once(out: str, run_dir: Path) -> None:
    """A first rehearsal's stream: each library warning once, no raw iteration or result line, no NameError
    as a skipped check's reason, one env summary per launch; the rank logs keep every line; and no
    flight-recorder pipe directory of its launches is left in /tmp."""
    lines = out.splitlines()
    warnings = [line for line in lines if re.search(r"\w*Warning: ", line)]
    assert warnings and len(warnings) == len({w.split("] ", 1)[-1] for w in warnings}), warnings
    assert "library warnings: " in out and "every copy is in the rank logs" in out
    assert "A4RAY_RESULT" not in out and "NameError" not in out and "Error: name" not in out
    assert not [line for line in lines if line.startswith("[n") and _ITERATION.search(line)]
    # One per 10 iterations and a launch's first and last, per attempt (1..20 then 11..30: 1, 11, 20; 11, 21, 30).
    assert sum(line.startswith("a4ray: progress: iteration") for line in lines) <= 3 + 3
    assert not [line for line in lines if re.match(r"a4ray: \[n\d+\] env", line)]
    assert "NCCL_DEBUG=INFO" in out and "[nccl_test]" not in out and "preflight all-reduce: NCCL_DEBUG=INFO" in out
    assert "downloading" not in out  # every source is a local directory: copied, not downloaded
    logged = "".join(log.read_text() for log in (run_dir / "logs" / "train").glob("rank-*.log"))
    assert "A4RAY_RESULT" in logged and logged.count("Transformer Engine and Apex are not installed") > 2
    _no_flight_recorder_pipes_left(run_dir)


def _no_flight_recorder_pipes_left(run_dir: Path) -> None:
    """Every launch of the run made its /tmp/a4ray-fr-<launch>/ (its node logs name it); none is left."""
    pipes = {m for log in run_dir.glob("logs/*/node-*.log")
             for m in re.findall(r"/tmp/a4ray-fr-[\w-]+", log.read_text())}
    assert pipes and not [p for p in pipes if Path(p).exists()], pipes


# A short rehearsal: a few iterations, no preflight (the doctor has its own tests), no verification.
_SHORT = ["--skip", "preflight", "--set", "train.iterations=12", "--set", "train.warmup_iterations=1", "--set",
          "train.save_interval=4", "--set", "observe.summary_every=1", "--set", "convert.verify.enabled=false"]


@pytest.mark.timeout(900)  # two whole pipeline runs on 4 nodes
def test_local_nodes_4_cancelled_then_resumed_and_3_planned(tmp_path, monkeypatch, capsys, standins):
    """`--local-nodes N` rehearses on N nodes: the profile derives its expert parallelism (it must divide the
    models' 8 experts) and global batch from N. On 4 nodes, a stop with notice (SIGTERM to the run's process group,
    as a shell or CI runner stops it) between two checkpoints: the ranks save at the iteration they reached, the
    record says which, nothing of the stopped ranks is streamed after "stopping", and the rerun resumes from that
    very iteration: nothing is redone. On 3 nodes, the plan: expert parallelism 1 (the only divisor of both 8 and 3)
    and one micro-batch per node. (A MoE model trained with ep 1 and dp 3 on 3 nodes: test_culprits' node made
    slower.)"""
    seed_standins(tmp_path, standins)
    cmd = [PYTHON, "-m", "a4ray.qwen3_next", "--local-nodes", "4", *_SHORT]
    env = isolated_env(tmp_path)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("a4ray: progress: iteration 5/"):  # a checkpoint at 4 is saved, the next is due at 8
            os.killpg(proc.pid, signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=300)
    out = "".join(seen) + rest
    assert proc.returncode == 130, out[-5000:]
    assert "--local-nodes 4: train.megatron.parallel.ep=4" in out and "ep 4 dp 4" in out
    assert "global batch 16 = micro 4 x dp 4" in out
    after = out[out.index("a4ray: stopping "):]
    assert not [line for line in after.splitlines() if line.startswith(("[n", "[ranks "))], after
    assert "a4ray: notice to 4 node(s): the ranks save a checkpoint at the iteration they reached" in after
    (record,) = tmp_path.glob(".a4ray/runs/*/result.json")
    steps = {s["name"]: s for s in json.loads(record.read_text())["steps"]}
    assert steps["train"]["status"] == "cancelled", steps["train"]
    reached, saved = map(int, re.search(r"at iteration (\d+); checkpoint iteration (\d+) saved on notice",
                                        steps["train"]["detail"]).groups())
    assert 5 <= reached == saved < 12, steps["train"]  # after the save at 4
    assert f"a4ray: saved checkpoint iteration {saved} on notice in " in after
    rank_logs = "".join(p.read_text() for p in record.parent.glob("logs/train/rank-*.log"))
    assert rank_logs.count(f"saved checkpoint iteration {saved} on notice (SIGUSR1)") == 1  # said by rank 0
    assert f"exiting after iteration {saved}: SIGUSR1 received" in rank_logs
    _no_flight_recorder_pipes_left(record.parent)

    # The rerun sets its interval from the model (save_interval=auto): a first save measures what one blocks.
    again = run_to_end([*cmd, "--set", "train.save_interval=auto", "--result", "r4.json"], cwd=tmp_path,
                       env=isolated_env(tmp_path), timeout=420)
    assert again.returncode == 0, again.stdout[-5000:] + again.stderr[-2000:]
    result = json.loads((tmp_path / "r4.json").read_text())
    assert [s["status"] for s in result["steps"]] == ["cached", "cached", "skipped", "ran"]
    train = result["steps"][3]["result"]
    assert train["world_size"] == 4 and train["iterations"] == 12 and train["start_iteration"] == saved
    assert f"resuming from checkpoint iteration {saved} " in again.stdout
    chosen = re.search(r"a4ray.mcore: checkpoint interval auto: every (\d+) iteration\(s\) = dt\* (\d+)s = sqrt\(2 w / "
                       r"\(N r_f\)\) with w ([0-9.]+)s blocked by this save, N 4 node\(s\), r_f ([0-9.]+) failures per 1000 "
                       r"node-days \((this workspace's node history, \d+ node failures? in [^,]+, weighed with Meta's "
                       r"published 6.5 as 1000 node-days|Meta's published RSC-1 rate; [^)]+)\); a step takes ([0-9.]+)s",
                       again.stdout)
    assert chosen, again.stdout[-5000:]
    every, best, blocked, rate, step = (int(chosen[1]), int(chosen[2]), float(chosen[3]), float(chosen[4]),
                                        float(chosen[6]))
    assert rate == pytest.approx(6.5, abs=0.01)  # this workspace's seconds of history hardly move the published rate
    assert best == pytest.approx(math.sqrt(2 * blocked / (4 * rate * 1e-3 / 86400)), abs=max(1.0, best * 0.02))
    assert every == max(1, round(best / step)) or abs(every - best / step) <= 0.01 * every
    assert f"saving checkpoint at iteration {saved + 1:7d}" in again.stdout  # the measuring save

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert pipeline_main("qwen3_next", ["-f", PROFILE, "--local-nodes", "3", "--gpus-per-node", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--local-nodes 3 --gpus-per-node 1: train.megatron.parallel.ep=1 " in out and "global batch: 12" in out
    nodes = [line for line in out.splitlines() if "-m a4ray.mcore " in line]
    assert len(nodes) == 3 and all("--nnodes=3 " in line and " --global-batch-size 12 " in line and " --ep 1 " in line
                                   for line in nodes), out


def test_a_converted_checkpoint_that_does_not_fit_the_model_is_refused_before_training(tmp_path, local_cluster,
                                                                                      monkeypatch, standins):
    """The Qwen3 rehearsal's conversion, then a model config whose experts are wider than the checkpoint's:
    the Megatron trainer refuses it before any iteration, naming each tensor and both shapes."""
    monkeypatch.chdir(tmp_path)
    profile = str(REPO / "jobs" / "qwen3_local.yaml")
    seed_standins(tmp_path, standins)
    common = ["--config", profile, "--skip", "preflight", "--set", "train.iterations=4", "--set",
              "train.warmup_iterations=1", "--set", "train.save_interval=4"]
    assert pipeline_main("qwen3", [*common, "--result", "r1.json"]) == 0
    ws = tmp_path / ".a4ray" / "ckpts" / "huggingface"
    wide = ws / "Qwen3-MoE-wide"
    wide.mkdir()
    for f in (ws / "Qwen3-MoE-tiny").iterdir():
        if f.suffix == ".json" or f.name == "merges.txt":
            (wide / f.name).write_bytes(f.read_bytes())
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 48}))
    assert pipeline_main("qwen3", [*common, "--skip", "stage,convert", "--set", "train.model=ckpts/huggingface/"
                                   "Qwen3-MoE-wide", "--set", "convert.input=ckpts/huggingface/Qwen3-MoE-tiny",
                                   "--set", "train.output=logs/wide", "--result", "r2.json"]) == 1
    train = json.loads((tmp_path / "r2.json").read_text())["steps"][3]
    assert train["status"] == "failed" and "exited with code 2" in train["detail"]
    rank_log = next(Path(json.loads((tmp_path / "r2.json").read_text())["run_dir"]).glob("logs/train/rank-0000.log"))
    text = rank_log.read_text()
    assert "does not fit the model the config describes" in text and " iteration " not in text
    assert ("decoder.layers.mlp.experts.experts.linear_fc1.weight: checkpoint shape (2, 8, 64, 64), model shape "
            "(2, 8, 96, 64)") in text


def test_skipping_stage_in_an_empty_workspace_names_every_missing_artifact(tmp_path, local_cluster, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert pipeline_main("qwen3_next", ["--config", PROFILE, "--from", "preflight", "--result", "r.json"]) == 1
    result = json.loads((tmp_path / "r.json").read_text())
    assert [s["status"] for s in result["steps"]] == ["failed", "not-run", "not-run", "not-run"]
    detail = result["steps"][0]["detail"]
    assert detail.startswith("step stage is skipped (--from preflight), but its outputs are missing: ")
    ws = tmp_path / ".a4ray"
    for what in (f"artifact qwen3-next-tiny (staged to ckpts/huggingface/Qwen3-Next-tiny) "
                 f"({ws}/ckpts/huggingface/Qwen3-Next-tiny)",
                 f"artifact pretrain-mmap: mmap_qwen3_datasets_text_document.idx "
                 f"({ws}/datasets/qwen-mmap/mmap_qwen3_datasets_text_document.idx)",
                 f"artifact sft-alpaca (staged to datasets/alpaca) ({ws}/datasets/alpaca)"):
        assert what in detail
    assert Path(result["run_dir"], "result.json").is_file()


# Stands in for Pai's run_mcore_qwen3.sh (made by tests/upstream.py's pai_standin, which refuses another
# argument count than the pinned script's 27 or an unset dlc variable): reports what it was given.
PAI_STUB = """echo "A4RAY_RESULT {\\"argc\\": $#, \\"env\\": \\"$1\\", \\"load\\": \\"${24}\\", \\"out\\": \\"${27}\\", \\
\\"world\\": \\"$WORLD_SIZE\\", \\"rank\\": \\"$RANK\\", \\"gpus\\": \\"$KUBERNETES_CONTAINER_RESOURCE_GPU\\", \\
\\"master\\": \\"$MASTER_ADDR:$MASTER_PORT\\", \\"cwd\\": \\"$(pwd)\\", \\"type\\": \\"$MP_DATASET_TYPE\\"}"
echo " [2026-11-21 12:00:00] iteration        2/       2 | consumed samples: 4 | lm loss: 4.500000E+00 |"
"""


def test_pai_launch_on_the_nodes_gets_its_arguments_and_the_dlc_contract(tmp_path, local_cluster, monkeypatch):
    """The train step with trainer pai on 2 simulated nodes, Pai's script replaced by a stub that reports what
    it received: 27 arguments, WORLD_SIZE = nodes and RANK = node rank (not Ray's or torchrun's), its cwd;
    and a model that is not the size the script hard-codes is refused before any launch."""
    ws, ckpt = tmp_path / "ws", tmp_path / "ws" / "mcore" / "latest"
    script = ws / "Pai-Megatron-Patch" / "examples" / "qwen3_next" / "run_mcore_qwen3.sh"
    script.parent.mkdir(parents=True)
    pai_standin(script, args=len(PAI_RUN_ARGS), env=PAI_DLC_ENV, body=PAI_STUB)
    ckpt.mkdir(parents=True)
    for name in ("latest_checkpointed_iteration.txt", "tokenizer.json", "tokenizer_config.json", "vocab.json",
                 "merges.txt"):
        (ckpt / name).write_text("release" if name.startswith("latest") else "{}")
    data = ws / "datasets" / "qwen-mmap" / "mmap_qwen3_datasets_text_document"
    data.parent.mkdir(parents=True)
    for ext in ("bin", "idx"):
        Path(f"{data}.{ext}").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    common = ["-f", str(REPO / "jobs" / "qwen3_next.yaml"), "--skip", "stage,convert,preflight", "--local-nodes", "2",
              "--gpus-per-node", "1",
              "--set", f"storage.local_workspace={ws}", "--set", "artifacts=[]", "--set", "train.pai.parallel.ep=1",
              "--set", "train.iterations=2", "--set", "train.warmup_iterations=1", "--set", "convert.output=mcore"]
    assert pipeline_main("qwen3_next", [*common, "--set", "train.model=no-hf-checkpoint", "--result", "r.json"]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert [s["status"] for s in result["steps"]] == ["skipped", "skipped", "skipped", "ran"]
    train = result["steps"][3]
    assert train["detail"].startswith("PASS: Pai trained 2 iterations, lm loss 4.5; checkpoints in ")
    records = [json.loads(line.split("A4RAY_RESULT ", 1)[1]) for node in (0, 1) for line in
               (Path(result["run_dir"]) / "logs" / "train" / f"node-{node:02d}.log").read_text().splitlines()
               if line.startswith("A4RAY_RESULT ")]
    assert [(r["world"], r["rank"], r["gpus"]) for r in records] == [("2", "0", "1"), ("2", "1", "1")]
    assert {r["argc"] for r in records} == {27} and {r["env"] for r in records} == {"dlc"}
    assert {r["cwd"] for r in records} == {str(script.parent)} and {r["load"] for r in records} == {str(ckpt)}
    assert records[0]["master"] == records[1]["master"] and records[0]["type"] == "idxmap"
    assert {r["out"] for r in records} == {f"{ws}/logs/output_pai_qwen3_next_pretrain"}

    # The tiny stand-in as train.model: its config is not Pai's A3B, refused with the field named.
    hf = ws / "ckpts" / "huggingface" / "tiny"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps({"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 4,
                                                "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                                                "num_experts": 8}))
    assert pipeline_main("qwen3_next", [*common, "--set", "train.model=ckpts/huggingface/tiny", "--result",
                                        "r2.json"]) == 1
    refused = json.loads((tmp_path / "r2.json").read_text())["steps"][3]
    assert refused["status"] == "failed" and "train.model: " in refused["detail"]
    assert "layers 4 (the script's A3B: 48)" in refused["detail"] and "architecture" not in refused["detail"]
