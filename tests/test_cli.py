"""The entry points as a user runs them: `python -m a4ray.ddp_test` on an embedded cluster, `--dry-run`,
cancellation by SIGTERM (what `ray job stop` sends), and `ray job submit` onto `a4ray local up`."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import uuid

import pytest
from conftest import PYTHON, REPO, isolated_env, wait_gone

pytestmark = pytest.mark.slow


def test_ddp_test_module_on_an_embedded_cluster(tmp_path):
    result = tmp_path / "r.json"
    env = isolated_env(tmp_path)
    proc = subprocess.run(
        [PYTHON, "-m", "a4ray.ddp_test", "--local-nodes", "2", "--gpus-per-node", "2", "--result", str(result),
         "--set", "ddp_test.hidden=128", "--set", f"storage.local_workspace={tmp_path / 'ws'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cluster: embedded local Ray cluster" in proc.stdout
    assert "[n1 r3]" in proc.stdout and "PASS: 4/4 ranks over 2 nodes" in proc.stdout
    data = json.loads(result.read_text())
    assert data["ok"] and data["nodes"] == 2
    assert sorted(r["rank"] for r in data["ranks"] if r["passed"]) == [0, 1, 2, 3]
    assert not wait_gone(env["RAY_TMPDIR"]), "the embedded cluster was shut down"


def test_dry_run_prints_the_plan_without_a_cluster(tmp_path):
    proc = subprocess.run(
        [PYTHON, "-m", "a4ray.ddp_test", "--dry-run", "--set", "cluster.nodes=4", "--set",
         "network.env.NCCL_DEBUG=INFO", "--result", str(tmp_path / "plan.json")],
        cwd=REPO, env=isolated_env(tmp_path), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "4 node(s)" in out and "node 3:" in out and "--node-rank=3" in out and "--nnodes=4" in out
    assert "source /usr/local/gib/scripts/set_nccl_env.sh" in out and "NCCL_SOCKET_IFNAME=eth0,eth1" in out
    assert "NCCL_DEBUG=INFO" in out  # a secret in the spec is refused (tests/test_bad_input.py)
    assert len(json.loads((tmp_path / "plan.json").read_text())["nodes"]) == 4


def test_a_bad_spec_fails_before_any_cluster_starts(tmp_path):
    proc = subprocess.run([PYTHON, "-m", "a4ray.ddp_test", "--set", "cluster.nodes=0"], cwd=REPO,
                          env=isolated_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "cluster.nodes: expected a value greater than 0" in proc.stderr
    assert "cluster:" not in proc.stdout


def test_ray_job_submit_onto_a4ray_local_up(shared_local_up):
    up, env = shared_local_up, shared_local_up.env
    job_id = f"a4ray-test-{uuid.uuid4().hex[:8]}"
    submit = subprocess.run(
        ["ray", "job", "submit", "--address", up.address, "--submission-id", job_id, "--working-dir", str(REPO),
         "--", "python", "-m", "a4ray.ddp_test", "--local-nodes", "2", "--gpus-per-node", "1",
         "--set", "ddp_test.hidden=64", "--set", "ddp_test.steps=3", "--set", "name=cli-submit"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    logs = subprocess.run(["ray", "job", "logs", "--address", up.address, job_id], env=env,
                          capture_output=True, text=True, timeout=60).stdout
    assert "cluster: Ray cluster at" in logs and "(from RAY_ADDRESS" in logs
    assert "[n0 r0]" in logs and "[n1 r1]" in logs and "PASS: 2/2 ranks over 2 nodes" in logs
    # The run directory is where `a4ray local up` was started, not in the job's temporary working_dir copy.
    results = list(up.root.glob(".a4ray/runs/cli-submit-*/result.json"))
    assert len(results) == 1 and json.loads(results[0].read_text())["ok"], results
    assert sorted(p.name for p in results[0].parent.glob("logs/node-*.log")), "per-node logs survive the job"


def test_every_option_says_what_it_does_and_help_imports_no_ray():
    """`a4ray --help` is for users (no internal docstring) and imports only the command wiring; every
    option of every command, nested ones included, has help text."""
    probe = ("import sys, contextlib, io\nfrom a4ray.cli import build_parser\n"
             "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
             "    build_parser(['--help']).parse_args(['--help'])\n"
             "print(out.getvalue()); print('HEAVY', sorted(m for m in ('ray', 'torch', 'megatron', 'pydantic', "
             "'kubernetes') if m in sys.modules))")
    done = subprocess.run([PYTHON, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout and "this file only wires them" not in done.stdout
    assert "python -m a4ray.qwen3_next" in done.stdout and "local" in done.stdout

    from a4ray.cli import COMMANDS, build_parser

    missing = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not action.help:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    for command in COMMANDS:
        parser = build_parser([command])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        walk(sub.choices[command], f"a4ray {command}")
    assert not missing, missing


_MAKE_PIPES = ("import sys; from a4ray.runtime.reaper import make_flight_recorder_pipes; "
               "make_flight_recorder_pipes(sys.argv[1]); print('made', flush=True); sys.stdin.read()")


def test_pipe_directories_of_gone_launches_go_with_the_next_gang_and_local_down(local_cluster, tmp_path):
    """A node actor killed with its gang (its reaper with it) cannot remove its launch's flight-recorder pipes in
    /tmp: the next node actor on the host, and `a4ray local down`, remove those whose owner is gone. Other test
    workers and clusters share /tmp: a live owner's directory, and one that records no owner, stay."""
    from a4ray.driver.execute import run
    from a4ray.runtime.reaper import flight_recorder_pipes, make_flight_recorder_pipes
    from conftest import job

    tag = uuid.uuid4().hex[:8]
    owners = {}
    for name in ("killed", "live", "later"):  # each makes its launch's pipes as a node actor does, and lives on
        owners[name] = subprocess.Popen([PYTHON, "-c", _MAKE_PIPES, f"test-{tag}-{name}"], cwd=REPO,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert owners[name].stdout.readline() == "made\n"
    dirs = {name: flight_recorder_pipes(f"test-{tag}-{name}") for name in (*owners, "mine", "unrecorded")}
    make_flight_recorder_pipes(f"test-{tag}-mine")  # this process's: alive
    dirs["unrecorded"].mkdir()  # no owner recorded (being made, or an older a4ray's): not a4ray's to judge
    try:
        owners["killed"].kill()  # SIGKILL: nothing of it cleans up
        owners["killed"].wait()
        spec = job("command", "cluster.nodes=1", "cluster.gpus_per_node=1", "command.argv=[true]", workspace=tmp_path)
        assert run(spec).ok
        assert not dirs["killed"].exists()
        assert all(dirs[name].is_dir() for name in ("live", "later", "mine", "unrecorded"))

        owners["later"].kill()
        owners["later"].wait()
        down = subprocess.run([PYTHON, "-m", "a4ray.cli", "local", "down"], cwd=REPO, env=isolated_env(tmp_path),
                              capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, down.stderr
        assert not dirs["later"].exists(), down.stdout
        assert all(dirs[name].is_dir() for name in ("live", "mine", "unrecorded"))
    finally:
        for owner in owners.values():
            owner.kill()
            owner.wait()
        for path in dirs.values():
            shutil.rmtree(path, ignore_errors=True)


def test_a_simulated_clusters_end_takes_the_pipe_directories_of_its_gone_launches(tmp_path):
    """A node lost with its launch (its reaper with it) leaves the launch's pipe directory: the embedded cluster's
    end removes those whose owner is gone, as `a4ray local down` does, so a rehearsal leaves nothing in /tmp."""
    from a4ray.runtime.reaper import flight_recorder_pipes
    from a4ray.runtime.simulated import SimulatedCluster

    launch = f"test-{uuid.uuid4().hex[:8]}-lost"
    owner = subprocess.Popen([PYTHON, "-c", _MAKE_PIPES, launch], cwd=REPO, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert owner.stdout.readline() == "made\n"
    cluster = SimulatedCluster(1, 1)
    try:
        cluster.start()
    finally:
        # Lost only now, just before the end: a node actor starting anywhere on the machine sweeps gone owners' too
        # (the other test worker's, in the suite), and would otherwise be the one that took it.
        owner.kill()
        owner.wait()
        cluster.shutdown()
    assert not flight_recorder_pipes(launch).exists()
