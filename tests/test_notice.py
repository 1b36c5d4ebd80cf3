"""The notice's addressees (runtime/notice.py): a launch's rank processes, not the launcher and not a rank's own
forked helpers, which inherit RANK (an async save's writer, a data-loader worker) and would die of the signal's
default action. Real processes: a launcher-like parent without RANK, two ranks, one of which forks a helper.
The whole stop with notice, end to end on 4 simulated nodes: test_pipeline's 4-node cancel."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from a4ray.core.ports import free_port
from a4ray.runtime.node_local import NODE_LOCAL_ENV
from a4ray.runtime.notice import NOTICE_EXIT_CODE, NOTICE_SIGNAL, SAVED_ON_NOTICE, give_notice
from a4ray.runtime.notice import main as notice_main
from a4ray.runtime.process import LAUNCH_ID_VAR, launch_processes, rank_processes

# A rank: acts on the notice by printing and ending; its forked helper ignores nothing (the default action ends it).
RANK = """
import os, signal, sys, time
if os.environ["RANK"] == "0" and os.fork() == 0:
    time.sleep(60)
    os._exit(0)
# One write a line: with PYTHONUNBUFFERED (CI sets it) print writes word by word, and the two ranks' lines interleave.
signal.signal(signal.SIGUSR1, lambda *_: (os.write(1, f"noticed {os.environ['RANK']}\\n".encode()), sys.exit(0)))
os.write(1, b"up\\n")
time.sleep(60)
"""
LAUNCHER = f"""
import os, subprocess, sys, time
ranks = [subprocess.Popen([sys.executable, "-c", {RANK!r}], env={{**os.environ, "RANK": str(r), "LOCAL_RANK": str(r)}},
                          stdout=sys.stdout) for r in range(2)]
time.sleep(60)
"""


def _launch(tmp_path, launch_id: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], env={**env, LAUNCH_ID_VAR: launch_id},
                                stdout=open(tmp_path / "out", "w"), start_new_session=True)
    deadline = time.monotonic() + 30
    while (tmp_path / "out").read_text().count("up") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return launcher


def _end(launcher: subprocess.Popen, launch_id: str) -> None:
    os.killpg(launcher.pid, signal.SIGKILL)
    for proc in launch_processes(None, launch_id):
        proc.kill()
    launcher.wait()


def test_the_notice_reaches_each_rank_and_nothing_else(tmp_path):
    launch_id = f"notice-test-{os.getpid()}"
    launcher = _launch(tmp_path, launch_id)
    try:
        procs = launch_processes(launcher.pid, launch_id)
        assert len(procs) == 4  # the launcher, two ranks, rank 0's helper
        ranks = rank_processes(procs)
        assert sorted(p.environ()["RANK"] for p in ranks) == ["0", "1"]
        helper = next(p for p in procs if p.pid not in {r.pid for r in ranks} and p.pid != launcher.pid)

        assert give_notice(launcher.pid, launch_id) == 2
        deadline = time.monotonic() + 10
        while sorted((tmp_path / "out").read_text().split("noticed")[1:]) != [" 0\n", " 1\n"] and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted((tmp_path / "out").read_text().split("noticed")[1:]) == [" 0\n", " 1\n"]
        assert launcher.poll() is None and helper.is_running()  # neither was told
        assert NOTICE_SIGNAL == signal.SIGUSR1
    finally:
        _end(launcher, launch_id)


def test_the_pods_prestop_hook_gives_every_launch_here_the_notice_and_waits_for_its_ranks(tmp_path, capsys):
    """`python -m a4ray.runtime.notice`, as a worker pod's preStop hook runs it (k8s/render.py): every a4ray launch's
    ranks on the machine, found by their launch id, are told, and the hook returns once they have ended."""
    launch_id = f"notice-hook-{os.getpid()}"
    launcher = _launch(tmp_path, launch_id)
    try:
        assert notice_main(["--grace-s", "20", "--launch-id", launch_id]) == 0  # not the suite's other launches
        said = capsys.readouterr().out
        assert "a4ray notice: 2 rank(s) told to save and end (SIGUSR1)" in said and "every rank ended" in said
        assert sorted((tmp_path / "out").read_text().split("noticed")[1:]) == [" 0\n", " 1\n"]
        assert launcher.poll() is None
    finally:
        _end(launcher, launch_id)


@pytest.mark.slow
def test_a_notice_whose_full_save_would_not_fit_keeps_the_newest_local_checkpoint_and_the_rerun_resumes_from_it(
        standins, tmp_path):
    """a4ray's Megatron trainer on 2 ranks under real torchrun (no Ray: the trainer's own decision), given a grace
    period no full save fits in (--notice-grace-s 0.001, against the save it measured at iteration 1: --save-interval
    auto saves first to measure, and its next save is hours of steps away, so the notice cannot race one). On notice
    it copies its newest local checkpoint (every 2 iterations) to --save instead of saving in full, says why, and
    ends with the notice's exit code. The node's RAM disk then goes (new nodes): the rerun finds the persisted copy,
    puts each rank's part in its node's storage, resumes from it, and removes the copy once it ends with a
    persistent checkpoint. The full save on notice, end to end through the supervisor: test_pipeline's 4-node
    cancel."""
    data = standins["qwen3-moe-tiny"].parent / "qwen-datasets" / "mmap_qwen3_datasets_text_document"
    save, shm = tmp_path / "checkpoint", tmp_path / "node-shm"

    def trainer(iters: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "a4ray.mcore",
                "--model", str(standins["qwen3-moe-tiny"]), "--data-path", str(data), "--save", str(save),
                "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters",
                str(iters), "--ep", "2", "--naming", "local", "--save-interval", "auto",
                "--non-persistent-save-interval", "2", "--exit-signal-handler", "--exit-signal", "SIGUSR1",
                "--notice-grace-s", "0.001"]

    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "OMP_NUM_THREADS": "1",
           LAUNCH_ID_VAR: "notice-local", NODE_LOCAL_ENV: str(shm), "TMPDIR": str(tmp_path)}
    run = subprocess.Popen(trainer(400), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           cwd=tmp_path, start_new_session=True)
    lines = []
    for line in run.stdout:
        lines.append(line)
        if " iteration        3/" in line:  # after the persistent save at 1 and the local one at 2
            assert give_notice(run.pid, "notice-local") == 2
    run.wait(timeout=60)
    out = "".join(lines)
    kept = re.search(r"a4ray.mcore: persisted local checkpoint iteration (\d+) on notice \(SIGUSR1\) to (\S+) in "
                     r"[0-9.]+s: a full save takes ~[0-9.]+s \(the last one\) and 0.0s of the 0.001s grace period "
                     r"are left", out)
    assert kept and SAVED_ON_NOTICE.search(kept[0]), out[-4000:]
    assert int(kept[1]) % 2 == 0 and Path(kept[2]) == save / f"local_iter_{int(kept[1]):07d}"
    assert sorted(p.name for p in Path(kept[2]).iterdir()) == [f"iter_{int(kept[1]):07d}_{r}_local.pt" for r in (0, 1)]
    assert f"exitcode  : {NOTICE_EXIT_CODE}" in out  # torchrun's report of the ranks' end
    assert out.count("saving checkpoint at iteration") == 1  # the first, at 1: no full save on notice was begun

    shutil.rmtree(shm)  # the nodes' RAM disks went with them
    again = subprocess.run(trainer(int(kept[1]) + 2), env=env, capture_output=True, text=True, cwd=tmp_path,
                           timeout=300)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-2000:]
    assert (f"a4ray.mcore: local checkpoint iteration {kept[1]}: persisted at a stop with notice; each rank's part "
            "copied to its node's storage") in again.stdout
    assert f"a4ray.mcore: resuming from local checkpoint iteration {kept[1]} (newer than the persistent checkpoint " \
           "iteration 1)" in again.stdout
    assert not list(save.glob("local_iter_*")), "the persisted copy outlived the run's last persistent checkpoint"
