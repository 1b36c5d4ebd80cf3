"""The gang on a real local multi-node Ray cluster: placement, rank order, the DDP test over gloo, and the
failure paths (a failing rank, a hanging rank, a killed node actor, a lost node, a timeout), each of which
must end the whole gang with a message naming the node and leave no process of the launch alive."""

from __future__ import annotations

import fcntl
import getpass
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from conftest import NODE_SECRET, job

from a4ray.core.errors import GangFailed, GangStartTimeout, GangTimeout, GangUnplaceable, GibMissing
from a4ray.driver.execute import run
from a4ray.runtime import gang as gang_module
from a4ray.runtime.gang import Gang, cluster_growth
from a4ray.runtime.process import LAUNCH_ID_VAR
from a4ray.runtime.simulated import (
    _patient_registration,
    _raylet_exited,
    _start_node,
    _unadvertised,
    machine_cores,
    simulated_ip,
)
from a4ray.spec.cluster import GKE_HOST_LABEL
from a4ray.workloads.generic import Command

pytestmark = pytest.mark.slow



def launch_leftovers(launch_id: str) -> list[psutil.Process]:
    """Processes still carrying one of this gang's launch ids in their environment."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(LAUNCH_ID_VAR, "").startswith(launch_id):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def assert_no_leftovers(launch_id: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while (left := launch_leftovers(launch_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of launch {launch_id} survived: {[p.cmdline() for p in left]}"


def run_gang(spec, on_line=None):
    """Run a command job on a gang; returns (result or error, gang)."""
    gang = Gang(spec, log_dir=str(Path(spec.storage.local_workspace) / "logs"))
    if on_line:
        gang.observers.append(lambda rank, line: on_line(gang, rank, line))
    try:
        return gang.run(Command(spec).launch, timeout_s=spec.timeout_s), gang
    except GangFailed as error:
        return error, gang
    finally:
        gang.close()


def test_ddp_test_end_to_end_over_gloo(local_cluster, tmp_path):
    spec = job("ddp_test", "cluster.nodes=2", "cluster.gpus_per_node=2", "ddp_test.steps=5",
               "ddp_test.hidden=128", workspace=tmp_path)
    result = run(spec)
    assert result.ok, result.verdict
    assert result.verdict.startswith("PASS: 4/4 ranks over 2 nodes")
    assert sorted(r.rank for r in result.ranks) == [0, 1, 2, 3]
    assert {(r.rank, r.node_rank) for r in result.ranks} == {(0, 0), (1, 0), (2, 1), (3, 1)}
    assert all(r.backend == "gloo" and r.param_max_diff == 0 and r.allreduce_ok for r in result.ranks)

    gang = result.gang
    hosts = [n.location.rsplit("/", 1)[-1] for n in gang.nodes]
    assert hosts == sorted(hosts), "node ranks follow the simulated physical topology"
    run_dir = Path(gang.log_dir).parent
    assert {"spec.yaml", "plan.json", "result.json"} <= {p.name for p in run_dir.iterdir()}
    assert json.loads((run_dir / "result.json").read_text())["ok"] is True
    logs = Path(gang.log_dir)
    for rank in range(4):
        assert "A4RAY_RESULT" in (logs / f"rank-{rank:04d}.log").read_text()
    node0 = (logs / "node-00.log").read_text()
    assert "# env A4RAY_NODE_RANK=0" in node0 and "[default0]:" in node0


def test_compile_caches_are_one_directory_in_the_workspace_for_every_node_unless_set(local_cluster, tmp_path):
    """torch.compile's and Triton's on-disk caches are one directory of the workspace for every node, attempt and run:
    a restart on another node, or the next run, loads the kernels compiled before (on 1 x H200 the rehearsal's first
    iteration took 27 s with both caches cold, 3.7 s with both warm). A value the user sets wins."""
    probe = "echo CACHES inductor=$TORCHINDUCTOR_CACHE_DIR triton=$TRITON_CACHE_DIR"
    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=1", f"command.argv=[bash, -c, '{probe}']",
               "network.env.TRITON_CACHE_DIR=/var/cache/triton-of-mine", workspace=tmp_path)
    result = run(spec)
    assert result.ok, result.verdict
    lines = [next(t for t in node.last_lines if t.startswith("CACHES")) for node in result.gang.nodes]
    assert lines == [f"CACHES inductor={tmp_path}/cache/compile/inductor triton=/var/cache/triton-of-mine"] * 2


def test_inductors_own_default_in_a_nodes_env_is_no_choice(extra_nodes, tmp_path):
    """Importing megatron-core sets TORCHINDUCTOR_CACHE_DIR to inductor's default in the importing process; nodes
    started by such a driver carry it, and the workspace's compile cache applies all the same."""
    default = f"/tmp/torchinductor_{getpass.getuser()}"
    nodes = extra_nodes(nodes=2, node_env={i: {"TORCHINDUCTOR_CACHE_DIR": default} for i in range(2)})
    probe = "echo CACHES inductor=$TORCHINDUCTOR_CACHE_DIR"
    result = run(job("command", "cluster.nodes=2", "cluster.gpus_per_node=1", f"command.argv=[bash, -c, '{probe}']",
                     *nodes.sets, workspace=tmp_path))
    assert result.ok, result.verdict
    lines = [next(t for t in node.last_lines if t.startswith("CACHES")) for node in result.gang.nodes]
    assert lines == [f"CACHES inductor={tmp_path}/cache/compile/inductor"] * 2, default


def test_rank_order_and_master_follow_topology_labels(local_cluster):
    spec = job("command", "cluster.nodes=3", "cluster.gpus_per_node=1", "command.argv=[true]")
    gang = Gang(spec, log_dir="/tmp")
    try:
        nodes = gang.start()
        hosts = [n.labels[GKE_HOST_LABEL] for n in nodes]
        assert hosts == ["sim-host-000", "sim-host-001", "sim-host-002"]
        assert gang.context(2).master_addr == nodes[0].ip
        assert gang.context(2).rank == 2 and gang.context(2).nnodes == 3
    finally:
        gang.close()


def test_a_gang_that_can_never_be_placed_fails_at_once_where_nothing_can_add_nodes(local_cluster):
    # start_timeout_s=120: before, it waited all of it; a cluster of simulated nodes cannot grow.
    spec = job("command", "cluster.nodes=5", "cluster.gpus_per_node=2", "command.argv=[true]")
    t0 = time.monotonic()
    with pytest.raises(GangUnplaceable) as e:
        Gang(spec, log_dir="/tmp").start()
    assert time.monotonic() - t0 < 60  # not the 120 s start timeout (the slack is a loaded machine's)
    text = str(e.value)
    assert "needs 5 node(s) with resource 'a4-highgpu-8g' and 2 GPU(s) each" in text
    assert "the cluster has 3 such node(s)" in text and "nothing can add nodes" in text
    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=4", "command.argv=[true]")
    with pytest.raises(GangUnplaceable) as e:
        Gang(spec, log_dir="/tmp").start()
    assert "0 with enough GPUs" in str(e.value)
    # The failed gangs released what they had: a feasible gang still places.
    gang = Gang(job("command", "cluster.nodes=3", "cluster.gpus_per_node=2", "command.argv=[true]"), log_dir="/tmp")
    gang.start()
    gang.close()


def test_where_an_autoscaler_can_add_nodes_the_gang_waits_its_timeout_saying_for_what(local_cluster, monkeypatch,
                                                                                      capsys):
    monkeypatch.setattr(gang_module, "cluster_growth", lambda: (True, "Ray's autoscaler can add nodes"))
    spec = job("command", "cluster.nodes=5", "cluster.gpus_per_node=2", "cluster.start_timeout_s=3",
               "command.argv=[true]")
    t0 = time.monotonic()
    with pytest.raises(GangStartTimeout) as e:
        Gang(spec, log_dir="/tmp").start()
    assert time.monotonic() - t0 >= 3 and not isinstance(e.value, GangUnplaceable)
    assert "start_timeout_s=3" in str(e.value)
    out = capsys.readouterr().out
    assert "waiting up to cluster.start_timeout_s=3s for nodes the cluster does not have yet" in out
    assert "Ray's autoscaler can add nodes" in out


def test_a_static_ray_cluster_is_told_from_one_that_autoscales(local_cluster, monkeypatch):
    """Read from the GCS as Ray writes it: the session cluster's head runs only the read-only monitor."""
    assert cluster_growth()[0] is False  # its nodes are simulated
    real = [dict(n, Labels={}) for n in ray.nodes()]
    monkeypatch.setattr(ray, "nodes", lambda: real)  # as if its nodes were real machines
    deadline = time.monotonic() + 30
    while (answer := cluster_growth())[0] is None and time.monotonic() < deadline:
        time.sleep(1)  # the monitor reports every few seconds after the head starts
    assert answer == (False, "the cluster has no autoscaler (a static Ray cluster: nothing adds nodes)")


@pytest.mark.parametrize("launcher, node_code", [("a4ray", 3), ("torchrun", 1)])
def test_a_failing_rank_ends_the_gang_and_a_hanging_rank_is_killed(local_cluster, tmp_path, launcher, node_code):
    """Either launcher names the rank that failed first; a4ray's passes on its exit code, torchrun's exits 1."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "rank = int(os.environ['RANK'])\n"
        "print(f'rank {rank} up', flush=True)\n"
        "if rank == 1:\n"
        "    time.sleep(2); print('rank 1 fails now', flush=True); sys.exit(3)\n"
        "if rank >= 2:  # node 1's ranks hang and ignore SIGTERM: a4ray must escalate to SIGKILL\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "time.sleep(600)\n"
    )
    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=2", "cluster.stop_grace_s=2",
               f"cluster.launcher={launcher}", f"command.argv=[{script}]", "command.torchrun=true", workspace=tmp_path)
    error, gang = run_gang(spec)
    assert isinstance(error, GangFailed) and not isinstance(error, GangTimeout)
    text = str(error)
    assert text.startswith("rank 1 (local rank 1) on node 0 (") and " exited with code 3; " in text
    # a4ray's launcher reports the rank as it sees it (the gang stops then); torchrun's node, once it has exited
    assert ("reported it)" if launcher == "a4ray" else f"exited with code {node_code})") in text
    assert "rank 1 fails now" in text  # the failing node's last lines are in the message
    nodes = {n.rank: n for n in error.result.nodes}
    assert nodes[0].status == "failed" and nodes[0].exit_code == node_code
    assert nodes[1].status == "stopped"
    assert_no_leftovers(error.result.launch_id)


def test_a_killed_node_actor_ends_the_gang_and_its_processes(local_cluster, tmp_path):
    def kill_node_1(gang, rank, line):
        if rank == 1 and "started" in line.text:
            threading.Thread(target=ray.kill, args=(gang.actors[1],)).start()

    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=1",
               "command.argv=[bash, -c, 'echo started; sleep 600']", workspace=tmp_path)
    error, gang = run_gang(spec, on_line=kill_node_1)
    assert isinstance(error, GangFailed)
    assert "node 1 (" in str(error)
    assert "was lost: its node actor is gone (Ray: The actor is dead because it was killed by `ray.kill`.)" \
        in str(error)
    assert {n.rank: n.status for n in error.result.nodes} == {0: "stopped", 1: "lost"}, error.result.model_dump_json(indent=1)
    assert_no_leftovers(error.result.launch_id)


def test_a_restart_keeps_its_gang_unless_another_node_could_take_the_place_of_one_to_leave(local_cluster, tmp_path,
                                                                                           capsys):
    """A failed launch (a real one: node 1's rank exits 3) leaves its gang, placed and with its node actors, for the
    next attempt, unless a node is to be kept off and the cluster has another to take its place. The 3-node gang
    fills the 3-node cluster: a new gang would land on the same nodes, so it stays, saying why. The 2-node gang
    has the third node to move to: it does not stay. A lost node never stays (test_observe's restart)."""
    for nodes, stays in ((3, True), (2, False)):
        spec = job("command", f"cluster.nodes={nodes}", "cluster.gpus_per_node=1", "cluster.stop_grace_s=2",
                   "command.argv=[bash, -c, 'test $RANK != 1 || exit 3; sleep 600']", workspace=tmp_path)
        gang = Gang(spec, log_dir=str(tmp_path / "logs"))
        try:
            with pytest.raises(GangFailed) as failed:
                gang.run(Command(spec).launch, timeout_s=60)
            result = failed.value.result
            assert gang.serves_again(result, {})
            host = gang.nodes[1].labels[GKE_HOST_LABEL]
            capsys.readouterr()
            assert gang.serves_again(result, {host: "a straggler"}) is stays
            out = capsys.readouterr().out
            if stays:
                assert f"cannot keep off {host} ({host}: a straggler): only 2 other node(s) fit and the gang needs 3, " \
                       "and nothing can add nodes" in out and "the next attempt runs on this gang, that node included" \
                       in out, out
            else:
                assert out == ""
            assert gang.serves_again(result, {"sim-host-not-in-the-gang": "a straggler"})
        finally:
            gang.close()


def test_a_spare_node_takes_the_place_of_one_to_leave(local_cluster, tmp_path, capsys):
    """2 nodes and a spare on the 3-node cluster: the spare stands by in the launch (no command of its own, no rank)
    and, when node 1 is to be kept off, takes its place on the same gang; the next launch runs on nodes 0 and 2, in
    that order (topology order), node 2 as launch rank 1. With no spare left, the gang stays as before."""
    spec = job("command", "cluster.nodes=2", "cluster.spare_nodes=1", "restart.max_restarts=1",
               "cluster.gpus_per_node=1", "cluster.stop_grace_s=2", "command.argv=[bash, -c, 'echo node=$NODE_RANK; "
               "test $NODE_RANK != 1 || exit 3; sleep 600']", workspace=tmp_path)
    gang = Gang(spec, log_dir=str(tmp_path / "logs"))
    try:
        with pytest.raises(GangFailed) as failed:
            gang.run(Command(spec).launch, timeout_s=60)
        assert [n.gang_rank for n in failed.value.result.nodes] == [0, 1] and failed.value.result.failed_node == 1
        assert gang.spares == [2]
        host = gang.nodes[1].labels[GKE_HOST_LABEL]
        assert "spare node 2 stands by for the next attempt, its ranks cold: the launch is not a4ray's rank launcher" \
            in capsys.readouterr().out  # a plain command: no launcher of a4ray's to keep warm
        assert gang.serves_again(failed.value.result, {host: "a straggler"})
        assert re.search(rf"spare node 2 \(.*\) takes the place of node 1 \({host}\), which is kept off "
                         r"\(a straggler\)", capsys.readouterr().out)
        assert gang.members == [0, 2] and gang.spares == []
        with pytest.raises(GangFailed) as failed:
            gang.run(Command(spec).launch, timeout_s=60)
        result = failed.value.result
        assert [(n.rank, n.gang_rank) for n in result.nodes] == [(0, 0), (1, 2)]
        assert result.failed_node == 2 and "node=1" in result.nodes[1].last_lines
        capsys.readouterr()
        assert gang.serves_again(result, {gang.nodes[2].labels[GKE_HOST_LABEL]: "a straggler"})  # nowhere else to go
        assert "the gang needs 3, and nothing can add nodes" in capsys.readouterr().out
    finally:
        gang.close()

    # A spare whose actor is gone by the time it is needed takes no place: it has left, and the gang goes on as
    # without spares.
    gang = Gang(spec, log_dir=str(tmp_path / "logs-2"))
    try:
        with pytest.raises(GangFailed) as failed:
            gang.run(Command(spec).launch, timeout_s=60)
        ray.kill(gang.actors[2])
        deadline = time.monotonic() + 30  # ray.kill returns before the actor is gone
        with pytest.raises(ray.exceptions.RayActorError):
            while time.monotonic() < deadline:
                ray.get(gang.actors[2].alive.remote(), timeout=30)
                time.sleep(0.1)
        capsys.readouterr()
        assert gang.serves_again(failed.value.result, {gang.nodes[1].labels[GKE_HOST_LABEL]: "a straggler"})
        assert gang.left == {2: "was lost while standing by"} and gang.members == [0, 1] and gang.spares == []
        assert "takes the place" not in (out := capsys.readouterr().out) and "cannot keep off" in out, out
    finally:
        gang.close()


def test_a_lost_nodes_bundle_placed_again_is_a_spare_again_and_takes_the_next_lost_place(extra_nodes, tmp_path, capsys):
    """2 nodes and a spare, on nodes of their own. Node 0, the master, is lost mid-launch: the spare takes its place. A
    node of the same kind joins (a recreated pod, last in topology order): Ray places the lost node's bundle there, and
    while the next launch runs the gang starts a node actor in it, a spare again. When node 1 is lost in turn, that
    spare takes its place: two nodes lost, one placement. The third launch runs on node 2 and the new node, in that
    order: the launch ranks follow the nodes' topology, not the gang rank the restored spare kept (node 0's)."""
    cluster = extra_nodes(nodes=3, gpus=1)
    hold = tmp_path / "hold"  # a launch runs while it exists
    spec = job("command", "cluster.nodes=2", "cluster.spare_nodes=1", "restart.max_restarts=2",
               "cluster.gpus_per_node=1", "cluster.stop_grace_s=2",
               f"command.argv=[bash, -c, 'echo node=$NODE_RANK; while [ -e {hold} ]; do sleep 0.2; done']",
               *cluster.sets, workspace=tmp_path)
    gang = Gang(spec, log_dir=str(tmp_path / "logs"))

    def extra_index(g: int) -> int:
        return next(i for i, node in cluster.workers.items() if node.node_id == gang.nodes[g].node_id)

    def lose_the_master_once_started() -> GangFailed:
        """Launch with `hold` there, and lose launch rank 0's node once its command has started."""
        hold.touch()
        gone = gang.members[0]

        def observer(rank, line):
            if rank == 0 and line.text.startswith("node="):
                threading.Thread(target=cluster.remove_node, args=(extra_index(gone),)).start()

        with gang.observing(observer), pytest.raises(GangFailed) as failed:
            gang.run(Command(spec).launch, timeout_s=60)
        assert [n.status for n in failed.value.result.nodes][0] == "lost", failed.value.result
        return failed.value

    try:
        gang.start()
        failed = lose_the_master_once_started()
        pg = gang.pg.id
        assert gang.serves_again(failed.result, {}) and gang.members == [1, 2] and gang.left == {0: "was lost"}
        new = cluster.workers[cluster.grow()].node_id

        done: list = []
        second = threading.Thread(target=lambda: done.append(gang.run(Command(spec).launch, timeout_s=180)))
        second.start()
        deadline = time.monotonic() + 150  # Ray first declares the lost node dead, then places its bundle again
        while gang.spares != [0] and time.monotonic() < deadline:
            time.sleep(0.5)
        hold.unlink()
        second.join(timeout=60)
        out = capsys.readouterr().out
        assert gang.spares == [0] and gang.nodes[0].node_id == new and not gang.left, out
        assert re.search(r"the bundle of node 0, which was lost, is placed again on .*: a spare again, actor "
                         r"\S+-n0-s1$", out, re.M), out
        assert "spare node 0 stands by" in out and done and done[0].ok
        assert [(n.rank, n.gang_rank) for n in done[0].nodes] == [(0, 1), (1, 2)]

        failed = lose_the_master_once_started()  # node 1 now
        assert gang.serves_again(failed.result, {})
        out = capsys.readouterr().out
        assert re.search(r"spare node 0 \(.*\) takes the place of node 1 \(.*\), which was lost", out), out
        assert gang.members == [2, 0] and gang.left == {1: "was lost"}
        hold.unlink()
        result = gang.run(Command(spec).launch, timeout_s=120)  # no hold: each node says its rank and ends
        assert result.ok and [(n.rank, n.gang_rank, n.node_id) for n in result.nodes] == \
            [(0, 2, gang.nodes[2].node_id), (1, 0, new)]
        assert "node=1" in result.nodes[1].last_lines and gang.pg.id == pg  # placed once
    finally:
        hold.unlink(missing_ok=True)
        gang.close()


def test_timeout_stops_every_node(local_cluster, tmp_path):
    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=1", "timeout_s=3",
               "command.argv=[bash, -c, 'sleep 600 & wait']", workspace=tmp_path)
    error, gang = run_gang(spec)
    assert isinstance(error, GangTimeout) and "ran past its timeout (3s)" in str(error)
    assert_no_leftovers(error.result.launch_id)


def test_success_streams_lines_and_masks_secrets(local_cluster, tmp_path, capfd):
    # The secret is in the nodes' environment (kuberay.secrets on A4): a spec refuses one.
    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=1",
               "command.argv=[bash, -c, 'echo node=$NODE_RANK of $NNODES master=$MASTER_ADDR token=$A4RAY_TEST_API_KEY']",
               workspace=tmp_path)
    result, gang = run_gang(spec)
    assert result.ok and [n.status for n in result.nodes] == ["succeeded", "succeeded"]
    out = capfd.readouterr().out
    assert "[n0] node=0 of 2 master=" in out and "[n1] node=1 of 2" in out
    assert "token=***" in out
    logs = "".join(p.read_text() for p in Path(result.log_dir).glob("*.log"))
    assert NODE_SECRET not in out + logs + result.model_dump_json()


def test_a_simulated_clusters_gcs_declares_a_killed_node_dead_within_seconds(local_cluster):
    """All of a simulated cluster's nodes are on this machine: its GCS declares a node whose processes were killed
    dead after 3 failed health checks a second apart (~3 s), not Ray's 5 at 3 s (~15 s); a check still waits Ray's
    10 s for a slow reply. This process reads the cluster's settings from its GCS."""
    assert (ray._config.health_check_period_ms(), ray._config.health_check_failure_threshold(),
            ray._config.health_check_timeout_ms()) == (1000, 3, 10000)


def test_a_simulated_cluster_keeps_no_worker_idle_for_long(local_cluster):
    """A burst of tasks on one node reuses its workers, and none of them stays idle past 10 s (Ray's default keeps up
    to the node's CPU count idle for the cluster's life, each costing CPU). Its one log monitor globs the log directory
    twice a second, not ten times."""
    node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU"))

    @ray.remote(num_cpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    def pid(_) -> int:
        time.sleep(0.5)
        return os.getpid()

    burst = set(ray.get([pid.remote(i) for i in range(4)]))
    after_burst = time.time()
    again = ray.get([pid.remote(i) for i in range(2)])
    assert all(psutil.Process(p).create_time() < after_burst for p in again)  # idle workers reused, none started
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) for p in burst) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in burst if psutil.pid_exists(p)], "idle workers kept past 10 s"
    (monitor,) = [p for p in psutil.process_iter(["cmdline"]) if "log_monitor.py" in " ".join(p.info["cmdline"] or [])
                  and local_cluster.cluster.head_node.get_session_dir_path() in " ".join(p.info["cmdline"])]
    assert monitor.environ().get("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD") == "0"


def test_gib_env_on_nodes_and_node_loss(extra_nodes, tmp_path):
    """On nodes of their own that keep NVLink multicast off (as the GPU hosts do): gIB is sourced
    on the node, the operator's NCCL_NVLS_ENABLE=0 survives a user override; then a node is lost."""
    gib = tmp_path / "gib" / "scripts"
    gib.mkdir(parents=True)
    (gib / "set_nccl_env.sh").write_text("export NCCL_NET=gIB NCCL_IB_TC=52 NCCL_NVLS_ENABLE=1\n")
    cluster = extra_nodes(nodes=2, gpus=1, node_env={i: {"NCCL_NVLS_ENABLE": "0"} for i in range(2)})
    probe = "echo NET=$NCCL_NET IF=$NCCL_SOCKET_IFNAME NVLS=$NCCL_NVLS_ENABLE LD=$LD_LIBRARY_PATH"
    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=1", "network.gib=on",
               f"network.gib_script={gib / 'set_nccl_env.sh'}", "network.env.NCCL_NVLS_ENABLE=1",
               f"command.argv=[bash, -c, '{probe}']", *cluster.sets, workspace=tmp_path)
    result, _ = run_gang(spec)
    assert result.ok
    for node in result.nodes:
        line = next(t for t in node.last_lines if t.startswith("NET="))
        assert f"NET=gIB IF=eth0,eth1 NVLS=0 LD={tmp_path}/gib/lib64" in line

    with pytest.raises(GibMissing) as e:
        run_gang(spec.set("network.gib_script", "/nonexistent/set_nccl_env.sh"))
    assert "node 0 (" in str(e.value) or "node 1 (" in str(e.value)

    def lose_node_1(gang, rank, line):
        if rank == 1 and "started" in line.text:
            threading.Thread(target=cluster.remove_node, args=(1,)).start()

    error, _ = run_gang(spec.set("network.gib", "off").set("command.argv", ["bash", "-c", "echo started; sleep 600"]),
                        on_line=lose_node_1)
    assert isinstance(error, GangFailed) and "node 1 (" in str(error) and "was lost" in str(error)
    assert_no_leftovers(error.result.launch_id, within_s=60)


def test_a_peer_failing_because_a_node_was_lost_names_the_lost_node(extra_nodes, tmp_path):
    """When a node dies, its peers' collectives fail within milliseconds, often before Ray reports the
    node; the message must name the lost node as the cause, not the peer that failed first."""
    cluster = extra_nodes(nodes=2, gpus=1)
    script = tmp_path / "allreduce_forever.py"
    script.write_text(
        "import time, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "print('started', flush=True)\n"
        "while True:\n"
        "    dist.all_reduce(torch.ones(4)); time.sleep(0.05)\n"
    )

    def lose_node_1(gang, rank, line):
        if rank == 1 and "started" in line.text:
            threading.Thread(target=cluster.remove_node, args=(1,)).start()

    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=1", f"command.argv=[{script}]",
               "command.torchrun=true", *cluster.sets, workspace=tmp_path)
    error, _ = run_gang(spec, on_line=lose_node_1)
    assert isinstance(error, GangFailed), error
    assert str(error).startswith("node 1 (") and "was lost" in str(error), str(error)
    assert error.result.failure_kind == "lost"
    assert_no_leftovers(error.result.launch_id, within_s=60)


def test_simulated_nodes_give_their_programs_a_share_of_the_machines_cores(local_cluster, tmp_path):
    """Simulated nodes share this machine: a program a node runs gets its rank's share of the cores in
    OMP_NUM_THREADS (the session cluster: 3 nodes x 2 GPUs), not Ray's 1 for the node actor, and not a
    thread per core in every rank of every node."""
    spec = job("command", "cluster.nodes=3", "cluster.gpus_per_node=2",
               "command.argv=[bash, -c, 'echo OMP=$OMP_NUM_THREADS']", workspace=tmp_path)
    result, _ = run_gang(spec)
    assert result.ok
    share = max(1, machine_cores() // 6)
    assert [next(t for t in n.last_lines if t.startswith("OMP=")) for n in result.nodes] == [f"OMP={share}"] * 3


def test_local_rank_i_uses_the_nodes_ith_gpu_in_ascending_order(extra_nodes, tmp_path, capfd):
    """Ray hands a node actor its GPUs in an order of its own: where the node's raylet has CUDA_VISIBLE_DEVICES
    (a GPU host's slice, as a simulated cluster gives each node on one), `ray.get_gpu_ids()` comes from a set of
    strings, in hash order (`gpus=1,0` and `gpus=3,2` were seen), and the ranks inherited it: local rank 0 took
    the higher GPU. Local rank i uses the node's i-th GPU in ascending order, in the ranks'
    CUDA_VISIBLE_DEVICES and in the node lines. Logical GPUs: Ray assigns their ids as it does real ones."""
    slices = {i: {"CUDA_VISIBLE_DEVICES": ",".join(str(4 * i + g) for g in range(4))} for i in range(2)}
    nodes = extra_nodes(nodes=2, gpus=4, node_env=slices)
    script = tmp_path / "gpus.py"
    script.write_text("import os\nprint(f\"GPUS {os.environ['LOCAL_RANK']} {os.environ['CUDA_VISIBLE_DEVICES']}\")\n")
    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=4", "command.torchrun=true",
               f"command.argv=[{script}]", *nodes.sets, workspace=tmp_path)
    result = run(spec)
    assert result.ok, result.verdict
    out = capfd.readouterr().out
    lines = re.findall(r"a4ray:   node (\d): .* gpus=(\S+) actor", out)
    assert sorted(gpus for _, gpus in lines) == ["0,1,2,3", "4,5,6,7"], out[-3000:]
    for node, gpus in lines:
        log = (Path(result.gang.log_dir) / f"node-{int(node):02d}.log").read_text()
        assert sorted(re.findall(r"GPUS (\d) (\S+)", log)) == [(str(i), gpus) for i in range(4)], log[-3000:]


def test_a_starting_node_gets_longer_than_rays_30_s_to_register(monkeypatch, tmp_path):
    """Ray's node start asks the GCS for the node (`services.get_node`) until it is there, for 30 s (hard-coded);
    a busy 2-core CI runner missed that once ("The current node timed out during startup", its GCS answering
    'RPC error: Deadline Exceeded'). Within a4ray's node starts each ask keeps asking until the node is there
    or its own wait has passed; outside them Ray's own function is back."""
    from ray._private import services

    asks: list[float] = []

    def registers_on_the_third_ask(gcs_address, node_id):
        asks.append(time.monotonic())
        if len(asks) < 3:
            raise RuntimeError("b'RPC error: Deadline Exceeded'")
        return {"node_id": node_id}

    monkeypatch.setattr(services, "get_node", registers_on_the_third_ask)
    with _patient_registration(wait_s=30):
        assert services.get_node("127.0.0.1:1", "n1") == {"node_id": "n1"} and len(asks) == 3
    assert services.get_node is registers_on_the_third_ask
    asks.clear()

    def never_registers(gcs_address, node_id):
        asks.append(time.monotonic())
        raise RuntimeError("not yet")

    monkeypatch.setattr(services, "get_node", never_registers)
    t0 = time.monotonic()
    with _patient_registration(wait_s=0.5), pytest.raises(RuntimeError, match="not yet"):
        services.get_node("127.0.0.1:1", "n1")
    assert 0.5 <= time.monotonic() - t0 < 5 and len(asks) >= 2
    # A node whose raylet has exited (a failed agent ends it) is not waited for: the start fails at once, and
    # add_node stops what it left and starts the node once more.
    ended = subprocess.Popen(_failing_raylet(tmp_path))
    ended.wait()
    assert _raylet_exited([ended]) == "exit code 1"
    t0 = time.monotonic()
    with _patient_registration(wait_s=30, started=[ended]), pytest.raises(RuntimeError, match="not yet"):
        services.get_node("127.0.0.1:1", "n1")
    assert time.monotonic() - t0 < 5



def _failing_raylet(tmp_path: Path) -> list[str]:
    """Ray's own raylet binary, as Ray starts it (its log in --stdout_filepath), given a GCS that is not there and a
    node id it cannot parse: it logs a fatal line in Ray's log format and exits with code 1 at once."""
    from ray._private.services import RAYLET_EXECUTABLE

    return [RAYLET_EXECUTABLE, f"--stdout_filepath={tmp_path / 'raylet.out'}",
            f"--stderr_filepath={tmp_path / 'raylet.err'}", "--gcs-address=127.0.0.1:1", "--node_id=not-a-node-id"]

def test_a_node_whose_raylet_ended_while_starting_is_started_once_more_and_the_warning_says_why(tmp_path, capsys):
    """Head or worker, a node start that fails with Ray's "timed out during startup" is stopped and started once
    more with fresh ports, and the warning carries the raylet's exit and its last error line (clean-clone CI lost
    a run to a head whose raylet had died, with nothing to say why); a second failure is the user's to see."""
    from ray._private import services

    calls, fresh = [], []

    def start():
        calls.append(1)
        services.ConsolePopen(_failing_raylet(tmp_path)).wait()  # as Ray starts it
        if len(calls) == 1:
            raise Exception("The current node timed out during startup. This could happen because ...")
        return "node"

    assert _start_node("simulated node 1", start, fresh=lambda: fresh.append(1)) == "node"
    assert calls == [1, 1] and fresh == [1]
    err = capsys.readouterr().err
    assert re.search(r"simulated node 1: its raylet did not register with the GCS \(exit code 1; its last error: "
                     r"\(raylet\) main\.cc:\d+: +An unexpected system state has occurred.*\); starting it once more",
                     err), err

    def never_comes_up():
        calls.append(1)
        raise Exception("The current node timed out during startup.")

    calls.clear()
    with pytest.raises(Exception, match="timed out during startup"):
        _start_node("the simulated cluster's head", never_comes_up)
    assert calls == [1, 1]

def test_two_local_clusters_never_share_a_node_address(local_cluster):
    """Each local cluster's nodes take addresses from a loopback block it alone holds while it runs (the session
    cluster holds one now): a second claim gets another block, and a released block is free again."""
    from a4ray.runtime.simulated import LoopbackBlock

    session = {local_cluster.ip(i) for i in range(3)}
    other = LoopbackBlock()
    try:
        assert other.block != local_cluster._loopback.block
        assert not session & {simulated_ip(i, other.block) for i in range(3)}
        held = open(LoopbackBlock.DIR / f"{other.block}.lock")
        with pytest.raises(BlockingIOError):  # held: no other cluster can take it
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        other.release()
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released: free for the next cluster
    held.close()


def test_a_private_embedded_cluster_is_never_joined_by_another_process(local_cluster, tmp_path, monkeypatch):
    """An embedded cluster lives as long as its process: a second rehearsal started while it runs gets its own
    (joining it, it would fail when the first one finishes). The session cluster is such a cluster: another
    process with the same Ray temp directory finds no cluster to join. What Ray had recorded for the machine
    before one starts is put back; `a4ray local up`'s cluster (not private) stays recorded."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    probe = ("from a4ray.runtime.connect import will_embed, _running_local_address;"
             "print(will_embed(), _running_local_address())")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "None"], out.stdout + out.stderr

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    from ray._common.utils import get_ray_address_file

    recorded = Path(get_ray_address_file(None))
    recorded.parent.mkdir(parents=True, exist_ok=True)
    recorded.write_text("127.0.0.1:6379")  # a `ray start` head's
    with _unadvertised(private=True):
        recorded.write_text("127.0.0.1:7000")  # as Ray's Cluster writes its head's
    assert recorded.read_text() == "127.0.0.1:6379"
    recorded.unlink()
    with _unadvertised(private=True):
        recorded.write_text("127.0.0.1:7000")
    assert not recorded.exists()
    with _unadvertised(private=False):
        recorded.write_text("127.0.0.1:7000")
    assert recorded.read_text() == "127.0.0.1:7000"


def test_stopping_a_launch_that_has_ended_leaves_alone_the_group_its_number_now_names():
    """Pids wrap (32768 by default: this suite comes round in minutes) and a Ray worker leads its own process
    group, so once a launch's command has ended and been waited for, its old group number may name someone
    else's group. Stopping the ended launch (a node stopped after its command was done) must not signal it.
    The coming round is arranged by pointing the ended launch's pid at a live group; nothing else is faked."""
    from a4ray.runtime.process import ManagedProcess

    ended = ManagedProcess(["true"], env=dict(os.environ), cwd=None, launch_id="ended-launch", on_line=print)
    ended.start()
    assert ended.wait(timeout=30) == 0
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a group of its own, as a Ray worker's
    try:
        ended._proc.pid = bystander.pid  # the number has come round
        ended.terminate(grace_s=1)
        assert bystander.poll() is None, "an unrelated process group was signalled"
        assert not ended.stopped
    finally:
        bystander.kill()
        bystander.wait()
