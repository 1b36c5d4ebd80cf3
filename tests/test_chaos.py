"""Chaos: the job's driver SIGKILLed mid-run, as when the head evicts it or the kernel's OOM killer picks it.
It gets no chance to stop anything; Ray ends the actors it owned, and a4ray's reapers end their process
trees. Nothing of the run may outlive it by more than cluster.stop_grace_s + 5 s: no rank, node actor,
mpirun or orted; and the run's record must say that its driver was lost."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import PYTHON, isolated_env

from a4ray.driver.handle import Run, find_runs
from a4ray.runtime.process import LAUNCH_ID_VAR

pytestmark = pytest.mark.slow
GRACE_S = 3
STANDIN = Path(__file__).parent / "programs" / "nccl_tests_standin.py"
TRAIN = ("import os, time\nfor i in range(10**6):\n"
         "    print(f'iteration {i} loss {1 / (i + 1):.4f}', flush=True)\n    time.sleep(0.3)")


def _spec(tmp_path: Path, workload: str) -> dict:
    spec = {"cluster": {"nodes": 2, "gpus_per_node": 2, "stop_grace_s": GRACE_S},
            "storage": {"local_workspace": str(tmp_path / "ws")}}
    if workload == "training":  # ranks under a4ray's launcher (torchrun's contract), a loss every 0.3 s
        (tmp_path / "train.py").write_text(TRAIN)
        # observe.rank_lines=all: each rank's own copy of the line, so the driver's stream shows every node's ranks run
        return {"kind": "command", "command": {"argv": [str(tmp_path / "train.py")], "torchrun": True},
                "observe": {"rank_lines": "all"}, **spec}
    bindir = tmp_path / "nccl-tests"  # nccl-tests under mpirun: node 0 runs mpirun, node 1 an orted
    bindir.mkdir()
    binary = bindir / "all_reduce_perf"
    binary.write_text(f"#!{sys.executable}\nimport runpy\nrunpy.run_path({str(STANDIN)!r}, run_name='__main__')\n")
    binary.chmod(0o755)
    return {"kind": "nccl_test", "nccl": {"binaries_dir": str(bindir), "collectives": ["all_reduce"],
                                          "implementation": "nccl-tests", "min_bytes": "1K", "max_bytes": "1K",
                                          "iters": 10**7, "warmup": 1}, **spec}


def _running(pid: int) -> bool:
    """Whether `pid` runs (not a zombie). It may end between any two looks at it."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _processes() -> tuple[dict[int, str], dict[int, str]]:
    """(node actors, processes of any a4ray launch) of this test's cluster: pid -> what it is. Only this process's
    descendants (the session cluster's raylets, their workers and what those started): other tests, on other
    xdist workers or of other users of the machine, run node actors and launches of their own meanwhile."""
    actors, launched = {}, {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.cmdline())
            if cmdline.startswith("ray::NodeActor"):
                actors[proc.pid] = cmdline[:60]
            elif LAUNCH_ID_VAR in proc.environ():
                launched[proc.pid] = f"{proc.name()}: {cmdline[:80]}"
        except psutil.Error:
            continue
    return actors, launched


@pytest.mark.parametrize("workload", ["training", "mpi"])
def test_a_driver_killed_mid_run_leaves_nothing_behind_and_is_recorded_lost(local_cluster, tmp_path, workload):
    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps(_spec(tmp_path, workload)))
    driver = subprocess.Popen([PYTHON, "-m", "a4ray.cli", "run", "-f", str(path)], cwd=tmp_path,
                              env=isolated_env(tmp_path, RAY_ADDRESS=local_cluster.address),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        # Mid-run: every node's ranks are running (losses from both nodes; mpirun, its orted and ranks).
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            actors, launched = _processes()
            names = " ".join(launched.values())
            if workload == "training":
                line = driver.stdout.readline()
                assert line, "".join(seen)
                seen.append(line)
                if any("[n1 r3] iteration 2" in s for s in seen) and any("[n0 r0] iteration 2" in s for s in seen):
                    break
            elif "orted" in names and names.count("all_reduce_perf") >= 4:
                break
            else:
                time.sleep(0.5)
        else:
            pytest.fail(f"the run did not get going: {''.join(seen)[-3000:]}")
        actors, launched = _processes()
        assert len(actors) >= 2 and launched, (actors, launched)
    finally:
        driver.kill()  # SIGKILL: no handler runs, nothing is stopped by the driver
        driver.wait(timeout=30)
    killed = time.monotonic()
    while time.monotonic() - killed < GRACE_S + 5:
        alive = {pid: what for pid, what in {**actors, **launched}.items() if _running(pid)}
        if not alive:
            break
        time.sleep(0.5)
    assert not alive, f"outlived the driver by {GRACE_S + 5}s: {alive}"
    # The record says so: a reader finds the run, its driver gone, and records it lost.
    (run,) = find_runs(tmp_path / "ws")
    assert run.status() == "FAILED"
    verdict = json.loads((run.root / "result.json").read_text())["verdict"]
    assert verdict.startswith("DRIVER LOST: its driver (pid") and "is gone without recording a result" in verdict
    assert Run.at(run.root).result().verdict == verdict
