"""MPI through Ray, without SSH: real OpenMPI `mpirun` on node 0 of a gang of simulated nodes (each its
own loopback address, so OpenMPI treats them as separate hosts) starts its daemons on the other nodes
through a4ray's rsh agent and their node actors; real mpi4py ranks run under them. OpenMPI comes from
Debian's openmpi-bin (`make system-deps`); without it these tests fail, as they should in CI."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import psutil
import pytest
import ray

from a4ray.core.errors import Cancelled, GangFailed
from a4ray.runtime import rsh
from a4ray.runtime.gang import Gang
from a4ray.runtime.launch import Peer
from a4ray.runtime.mpirun import hostfile, mpi_launch
from a4ray.runtime.process import LAUNCH_ID_VAR
from conftest import SESSION_GPUS, SESSION_NODES, job

PROGRAM = str(Path(__file__).parent / "programs" / "mpi_ranks.py")


def _spec(tmp_path):
    return job("ddp_test", f"cluster.nodes={SESSION_NODES}", f"cluster.gpus_per_node={SESSION_GPUS}",
               "cluster.stop_grace_s=3", workspace=tmp_path)


def _mpi(*mode: str, env=None):
    return lambda node: mpi_launch(node, [sys.executable, PROGRAM, *mode], slots=SESSION_GPUS, env=env)


def test_mpirun_through_ray_places_ranks_by_hostfile_order(local_cluster, tmp_path):
    with Gang(_spec(tmp_path), log_dir=str(tmp_path / "logs")) as gang:
        result = gang.run(_mpi(env={"A4RAY_TEST_FORWARDED": "yes"}), timeout_s=180)
        ips = [n.ip for n in gang.nodes]

    world = SESSION_NODES * SESSION_GPUS
    ranks = sorted(result.records, key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == list(range(world))
    assert all(r["size"] == world and r["allreduce"] == world * (world - 1) // 2 for r in ranks)
    # The hostfile is the gang's rank order, so MPI rank r runs under node r // slots's node actor.
    assert [r["node_rank"] for r in ranks] == [r // SESSION_GPUS for r in range(world)]
    assert [r["local_rank"] for r in ranks] == [r % SESSION_GPUS for r in range(world)]
    assert all(r["forwarded"] == "yes" for r in ranks)
    assert [n.status for n in result.nodes] == ["succeeded"] + ["standby"] * (SESSION_NODES - 1)
    assert len(set(ips)) == SESSION_NODES and all(ip.startswith("127.") for ip in ips)
    (written,) = (tmp_path / "logs" / "mpi").iterdir()
    assert written.read_text() == "".join(f"{ip} slots={SESSION_GPUS}\n" for ip in ips)
    # Each node's OpenMPI daemon was started by that node's actor (no ssh anywhere).
    for rank in range(SESSION_NODES):
        log = (tmp_path / "logs" / f"node-{rank:02d}.log").read_text()
        assert re.search(r"^\[exec 1\] argv /bin/sh -c\s+orted ", log, re.M), log[-2000:]


def test_failing_rank_fails_the_job(local_cluster, tmp_path):
    with Gang(_spec(tmp_path), log_dir=str(tmp_path / "logs")) as gang:
        with pytest.raises(GangFailed) as failed:
            gang.run(_mpi("fail", "3"), timeout_s=180)
        leftovers = [pid for a in gang.actors for pid in ray.get(a.pids.remote())]
    result = failed.value.result
    assert result.nodes[0].status == "failed" and result.nodes[0].exit_code != 0
    assert "node 0" in str(failed.value)
    assert leftovers == []


def test_killed_job_leaves_no_daemon_or_rank(local_cluster, tmp_path):
    """Cancel (as Ctrl-C / `ray job stop` does) once every rank runs: mpirun, every orted and every
    rank must be gone, on every node."""
    world = SESSION_NODES * SESSION_GPUS
    seen: dict[str, int] = {}
    names: set[str] = set()
    with Gang(_spec(tmp_path), log_dir=str(tmp_path / "logs")) as gang:
        def on_line(rank, line):
            if line.text.startswith("A4RAY_RESULT "):
                record = json.loads(line.text.split(" ", 1)[1])
                seen[f"rank {record['rank']}"] = record["pid"]
            if line.text.startswith("ready ") and sum(k.startswith("rank") for k in seen) == world:
                for a in gang.actors:
                    for pid in ray.get(a.pids.remote()):
                        seen[f"pid {pid}"] = pid
                        names.add(psutil.Process(pid).name())
                raise KeyboardInterrupt  # what the supervisor sees on Ctrl-C

        gang.observers.append(on_line)
        with pytest.raises(Cancelled):
            gang.run(_mpi("hang"), timeout_s=180)
        launch_prefix = gang.launch_id

    pids = set(seen.values())
    assert {"mpirun", "orted"} <= names, names  # the node actors' process trees held them all
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"left behind: {alive} ({names})"
    stray = []
    for proc in psutil.process_iter(["name", "pid"]):
        try:
            if proc.environ().get(LAUNCH_ID_VAR, "").startswith(launch_prefix):
                stray.append((proc.pid, proc.info["name"]))
        except psutil.Error:
            continue
    assert stray == []


def test_rsh_agent_refuses_a_host_outside_the_gang(monkeypatch, capsys):
    monkeypatch.setenv(rsh.GANG_VAR, json.dumps({"address": "-", "namespace": "a4ray",
                                                 "hosts": {"127.0.0.2": "a", "127.0.0.3": "b"}}))
    assert rsh.main(["-x", "10.9.9.9", "orted", "--foo"]) == rsh.SSH_FAILURE
    err = capsys.readouterr().err
    assert "10.9.9.9 is not a node of this gang" in err and "127.0.0.2, 127.0.0.3" in err
    assert rsh.split_argv(["-o", "StrictHostKeyChecking=no", "-p", "2222", "h", "orted", "-mca", "x"]) == (
        "h", ["orted", "-mca", "x"])
    monkeypatch.delenv(rsh.GANG_VAR)
    assert rsh.main(["h", "true"]) == rsh.SSH_FAILURE
    assert "A4RAY_RSH_GANG is not set" in capsys.readouterr().err


def test_hostfile_is_in_rank_order():
    peers = [Peer(rank=i, ip=f"10.0.0.{9 - i}", hostname=f"h{i}", actor=f"a{i}") for i in range(3)]
    assert hostfile(peers, 8) == "10.0.0.9 slots=8\n10.0.0.8 slots=8\n10.0.0.7 slots=8\n"
