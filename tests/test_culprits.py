"""Naming the culprit, on a real local cluster with real torchrun-contract ranks on gloo: which rank a hung
collective waits for (from the ranks' flight records, else their stacks), which node is a straggler, and
the next attempt kept off the node that failed."""

from __future__ import annotations

import contextlib
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
from conftest import free_port, job, scrape, scrape_until

from a4ray import api
from a4ray.cli import main as cli_main
from a4ray.core.node_history import NodeHistory
from a4ray.driver.execute import run
from a4ray.observe.stacks import StackDump, dump, where
from a4ray.observe.verdicts import HangVerdict
from a4ray.workloads.doctor import Doctor

pytestmark = pytest.mark.slow

HOST_LABEL = "cloud.google.com/gce-topology-host"  # the simulated nodes' host label, as GKE's


# a4ray's flight-record server on every rank. In attempt 0, rank 3 (node 1's second rank) never enters the 4th
# all-reduce, and the ranks in FREEZE stop themselves (SIGSTOP) a second after reaching it (rank 1: inside it;
# rank 3: asleep before it), so that they cannot answer; later attempts run through.
STUCK_AND_FROZEN = """
import os, signal, threading, time, torch, torch.distributed as dist
from a4ray.programs.distributed import init_distributed, exit_distributed
init_distributed('gloo')
rank = dist.get_rank()
first = os.environ['A4RAY_ATTEMPT'] == '0'
freeze = rank in {freeze} and first


def stop_soon():
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGSTOP)).start()


def load_batch(it):
    if rank == 3 and it == 4 and first:
        if freeze:
            stop_soon()
        time.sleep(3600)
    return torch.ones(4)


for it in range(1, 8):
    batch = load_batch(it)
    if it == 4 and freeze and rank != 3:
        stop_soon()
    dist.all_reduce(batch)
    if rank == 0:
        print(f" iteration {{it:8d}}/       7 | elapsed time per iteration (ms): 100.0 | lm loss: 1.0 |", flush=True)
exit_distributed(0)
"""


def _hang_with_frozen_ranks(tmp_path: Path, freeze: list[int], *sets: str):
    """2 nodes x 2 ranks, attempt 0 hung as STUCK_AND_FROZEN says, one restart allowed: the run, its verdict and
    what it printed."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_AND_FROZEN.format(freeze=set(freeze)))
    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=2", f"command.argv=[{script}]",
               "command.torchrun=true", "observe.watchdog.no_progress_s=4", "restart.max_restarts=1",
               "restart.backoff_s=0", "cluster.stop_grace_s=1", "observe.watchdog.record_timeout_s=3", *sets,
               workspace=tmp_path)
    result = run(spec)
    assert result.ok and result.gang.attempt == 1, result.verdict
    run_dir = Path(result.gang.log_dir).parent
    return result, run_dir, HangVerdict.model_validate_json((run_dir / "hang" / "verdict.json").read_text())


def test_a_hang_names_the_rank_that_never_joined_and_the_retry_keeps_off_its_node(local_cluster, tmp_path, capfd):
    """Attempt 0 hangs with rank 3 (node 1) outside the 4th all-reduce, and rank 1 (node 0), which entered it,
    frozen so that it cannot answer. The verdict names rank 3 on its own record and not rank 1 (its silence, and
    its stack frozen inside the collective, are no evidence); the restart decision takes it, attempt 1 runs on
    nodes other than rank 3's, and the node history blames rank 3's host only."""
    result, run_dir, verdict = _hang_with_frozen_ranks(tmp_path, [1])
    out = capfd.readouterr().out
    assert [c.rank for c in verdict.culprits] == [3] and not verdict.undetermined, verdict
    assert verdict.culprits[0].why == "its flight record stops before #4"
    culprit = verdict.culprits[0].node
    labelled = next(n for n in ray.nodes() if n["Alive"] and n["Labels"].get(HOST_LABEL) == culprit.host)
    assert culprit.node == 1 and culprit.ip == labelled["NodeManagerAddress"]
    assert verdict.collective.seq == 4 and verdict.collective.op == "gloo:all_reduce"
    assert verdict.collective.input_sizes == [[4]] and verdict.waiting == [0, 2]
    assert verdict.evidence[0] == "flight recorder of rank(s) 0, 2-3"
    assert "rank(s) 1 not judged: no evidence either way (timed out)" in verdict.note
    assert verdict.ras.startswith("NCCL RAS not heard: RAS not listening on localhost:28028 (NCCL < 2.24")
    # Every rank that could answer is in the run's logs; the one that never joined stopped at #3.
    records = {r: json.loads((run_dir / "logs" / "flight-recorder" / f"rank_{r}.json").read_text()) for r in (0, 2, 3)}
    assert max(e["collective_seq_id"] for e in records[3]["entries"]) == 3
    host = culprit.host
    assert re.search(rf"the launch hung: .*culprit: rank 3 on node 1 \({host}, {culprit.ip}, \S+\) "
                     r"\[load_batch \(stuck.py:\d+\)\] never joined gloo:all_reduce #4 of process group default, "
                     r"sizes \[\[4\]\] that ranks 0, 2 wait in", out), out
    # The restart decision and the next gang's placement take the verdict; the node history keeps it.
    assert re.search(rf"restarting in 0s: the launch hung on rank 3 \({host}\)", out), out
    assert re.findall(r"keeping off (\S+) \(", out) == [host], out
    assert re.search(rf"keeping off {host} \({host}: rank 3 on node 1 never joined gloo:all_reduce #4 of process "
                     r"group default", out), out
    assert host not in {n.host for n in result.gang.nodes}
    assert {h: [e.event for e in events] for h, events in NodeHistory(tmp_path).hosts().items()} == \
        {host: ["hang-culprit"]}
    counted = scrape_until(rf'^ray_a4ray_hang_culprit_total\{{.*run="{run_dir.name}"', bool)
    assert len(counted) == 1 and 'node="1"' in counted[0] and f'host="{host}"' in counted[0], counted


def test_a_hang_no_evidence_decides_is_undetermined_and_blames_no_node(local_cluster, tmp_path, capfd):
    """The same hang with rank 3 frozen too and no stacks taken: ranks 0 and 2 wait in #4, and neither rank 1 nor
    rank 3 can answer. Nothing says which never joined: the verdict is undetermined, names no one and lists both
    with why; the restart keeps off no node and the node history blames no host."""
    result, run_dir, verdict = _hang_with_frozen_ranks(tmp_path, [1, 3], "observe.watchdog.py_spy=false")
    out = capfd.readouterr().out
    assert verdict.undetermined and verdict.culprits == [] and verdict.waiting == [0, 2], verdict
    assert [(c.rank, c.node.node) for c in verdict.candidates] == [(1, 0), (3, 1)]
    for candidate in verdict.candidates:
        assert candidate.why == ("no flight record: timed out (its flight-record server did not answer in 3s); "
                                 "no stack"), candidate
    assert verdict.evidence == ["flight recorder of rank(s) 0, 2"]
    assert re.search(r"verdict: the launch hung: .*undetermined: ranks 0, 2 wait in gloo:all_reduce #4 of process group "
                     r"default"
                     r".* no culprit named .*candidates: rank 1 on node 0 \(\S+\): no flight record: timed out", out)
    assert "restarting in 0s: the launch hung (undetermined: " in out
    assert "keeping off" not in out and NodeHistory(tmp_path).hosts() == {}
    assert sorted(p.name for p in (run_dir / "logs" / "flight-recorder").glob("rank_*.json")) == \
        ["rank_0.json", "rank_2.json"]


# Attempt 0 runs until its node is killed; a later attempt finishes. Each rank says where it ran.
ONE_ATTEMPT_DIES = """
import os, pathlib, sys, time
out = pathlib.Path(sys.argv[1])
attempt = os.environ["A4RAY_ATTEMPT"]
(out / f"attempt{attempt}-node{os.environ['GROUP_RANK']}").write_text(str(os.getpid()))
while attempt == "0":
    time.sleep(0.2)
"""


def _kill_node_actor_of(pid_file: Path, within_s: float = 60) -> None:
    """SIGKILL the node actor (the Ray worker) above the rank whose pid `pid_file` holds: the node stays in
    the cluster, its gang member is lost."""
    deadline = time.monotonic() + within_s
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.monotonic() < deadline, f"{pid_file} never written"
        time.sleep(0.1)
    proc = psutil.Process(int(pid_file.read_text()))
    actor = next(p for p in proc.parents() if "NodeActor" in " ".join(p.cmdline()))
    actor.kill()


def _attempt_after_a_lost_node(tmp_path: Path, nodes: int, capfd):
    out = tmp_path / "where"
    out.mkdir()
    script = tmp_path / "dies.py"
    script.write_text(ONE_ATTEMPT_DIES)
    # The A4 shape in miniature: 2 ranks a node (each rank writes where it ran; node 1's ranks both name its file).
    spec = job("command", f"cluster.nodes={nodes}", "cluster.gpus_per_node=2", "command.torchrun=true",
               f"command.argv=[{script}, {out}]", "restart.max_restarts=1", "restart.backoff_s=0", workspace=tmp_path)
    killer = threading.Thread(target=_kill_node_actor_of, args=(out / "attempt0-node1",), daemon=True)
    killer.start()
    result = run(spec)
    killer.join(timeout=5)
    return result, capfd.readouterr().out


def test_the_retry_keeps_off_the_node_that_was_lost(local_cluster, tmp_path, capfd):
    """3 nodes, a 2-node gang, node 1's actor killed: attempt 1 runs on the other two and says which it avoided;
    the workspace's node history records the loss, a new run keeps off that node from its start, and
    `a4ray nodes forget` clears it."""
    result, out = _attempt_after_a_lost_node(tmp_path, 2, capfd)
    assert result.ok and result.gang.attempt == 1, result.verdict
    host = re.search(r"node 1 \(\S+ \([\d.]+, \S+/(sim-host-\d+)\)\) was lost", out).group(1)
    assert re.search(rf"keeping off {host} \({host}: node 1 \([\d.]+\) was lost in launch \S+\); 2 other node\(s\) "
                     r"fit, the gang needs 2", out), out
    assert host not in {n.host for n in result.gang.nodes}
    history = NodeHistory(Path(result.gang.log_dir).parents[2])
    events = history.events(host)
    assert [e.event for e in events] == ["lost"] and events[0].run == Path(result.gang.log_dir).parent.name
    assert [e.event for e in api.nodes(history.dir.parent)[host]] == ["lost"]
    spec = job("ddp_test", "cluster.nodes=3", "cluster.gpus_per_node=1", "doctor.network=false",
               workspace=history.dir.parent)
    rows = {c.host: c for c in run(spec, job=Doctor(spec)).checks if c.name == "history"}
    assert rows[host].status == "warn" and rows[host].detail.startswith("1 lost (last ")
    assert rows[host].fix == f"`a4ray nodes forget {host}` once the node is repaired"
    assert [r.status for h, r in rows.items() if h != host] == ["ok", "ok"]
    assert cli_main(["nodes", "--workspace", str(history.dir.parent)]) == 0
    out = capfd.readouterr().out
    assert f"{host}: 1 lost" in out
    # Both attempts' node time went into the history: the failure rate auto checkpoint intervals use counts it.
    rate = history.failure_rate()
    assert rate.failures == 1 and 0 < rate.node_days * 86400 < 600, rate
    assert f"failure rate: {rate.per_1000_node_days:.3g} per 1000 node-days ({rate.source}); " in out
    # Never again on that node: a new run in the workspace is placed off it from its first attempt, and says why.
    spec = job("ddp_test", "cluster.nodes=2", "cluster.gpus_per_node=1", workspace=history.dir.parent)
    again = run(spec)
    out = capfd.readouterr().out
    assert again.ok and again.gang.attempt == 0 and host not in {n.host for n in again.gang.nodes}, again.verdict
    assert re.search(rf"keeping off {host} \({host}: 1 lost \(last .*: node 1 \([\d.]+\) was lost in launch \S+\); "
                     rf"`a4ray nodes forget {host}` once repaired\); 2 other node\(s\) fit, the gang needs 2", out), out
    assert cli_main(["nodes", "forget", host, "--workspace", str(history.dir.parent)]) == 0
    assert history.events(host) == [] and history.blamed() == {}  # the next run may use it again


def test_the_retry_says_when_it_cannot_keep_off_the_lost_node(local_cluster, tmp_path, capfd):
    """A gang as large as the cluster (3 of 3 nodes): the retry cannot avoid the node, says so and what it does."""
    result, out = _attempt_after_a_lost_node(tmp_path, 3, capfd)
    assert result.ok and result.gang.attempt == 1, result.verdict
    assert re.search(r"cannot keep off (\S+) \(.*\): only 2 other node\(s\) fit and the gang needs 3, and nothing "
                     r"can add nodes to a cluster of simulated nodes .*; placing the gang on the nodes there are, "
                     r"that one included", out), out


# Makes node argv[2]'s ranks (of the run whose command holds argv[1]) slower from outside, as a throttled node would
# be: each rank gets a share argv[4] (0.17: ~6x slower) of what a busy process gets of one core on this machine now
# (all of one where the machine is idle, ~1/8 of one where 15 busy processes share 2 cores), from when
# training starts (rank 0's log under argv[3] says its iterations) until its last iteration (the checkpoint saved
# after it is not slowed) or until terminated:
# - where this machine's cgroup CPU controller can be written and joined (here: a VM of our own, as root), a CPU
#   quota of that share for each of those ranks, on them together. The kernel enforces it whatever else runs;
# - else SIGSTOP / SIGCONT at a duty cycle (running that share of the time) and a lower priority (nice 10).
# A share of a whole core was not enough on a loaded machine: at a load of 15 on 2 cores every rank gets ~13% of a
# core, so a 10% quota read 1.1-2.6x the others in CI (the rule needs 3x in 2 windows in a row). A tenth of a busy
# process's share made both straggler tests 2-3x longer in CI (370-435 s): the share is as slow as the rules need.
# What a busy process gets is measured, not guessed: a probe at the ranks' priority spins a fifth of every second
# and reads the CPU time it got (the median of its last 5). The 1-minute load average overstated the contention (it
# counts every runnable thread of the suite's Ray processes, most of them brief): node 2 read 18-24x, not ~6x.
# Nor was the duty cycle alone enough: a rank resumed from a stop is a sleeper the scheduler favours, so it ran its
# slots at full speed. The ranks are found while they start, so the slow-down begins with the first iteration. It
# is a process of its own at a higher priority where it may be: as a thread of this busy test process its wake-ups
# came late.
SLOW_DOWN = """
import contextlib, os, pathlib, re, signal, statistics, subprocess, sys, threading, time
import psutil
marker, node, workspace, share = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3]), float(sys.argv[4])
PROBE = '''
import time
while True:
    wall, cpu = time.monotonic(), time.process_time()
    while time.monotonic() - wall < 0.2:
        pass
    print((time.process_time() - cpu) / (time.monotonic() - wall), flush=True)
    time.sleep(0.8)
'''
probe = subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, text=True)  # before our nice -10
readings = [1.0]
threading.Thread(target=lambda: [readings.append(float(line)) for line in probe.stdout], daemon=True).start()
with contextlib.suppress(OSError):
    os.nice(-10)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def find_ranks():
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(proc.info["cmdline"] or [])
            if marker in cmd and "a4ray.mcore" in cmd and "a4ray.runtime.ranks" not in cmd \\
                    and proc.environ().get("GROUP_RANK") == node:
                yield proc


def now_share():
    # `share` of what a busy process gets of one core now, as the probe read it lately
    return share * min(1.0, statistics.median(readings[-5:]))


def set_quota(group):
    quota = max(1000, int(50000 * now_share() * max(1, len(ranks))))  # microseconds of CPU per 50 ms, all ranks
    if group.parent.name == "cpu":
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (group / "cpu.max").write_text(f"{quota} 50000")


def cpu_quota_group():
    # cgroup v1's cpu controller, else v2's; None where neither can be written.
    v1, v2 = pathlib.Path("/sys/fs/cgroup/cpu"), pathlib.Path("/sys/fs/cgroup")
    group = (v1 if (v1 / "cpu.cfs_quota_us").exists() else v2) / f"a4ray-test-slow-{os.getpid()}"
    try:
        group.mkdir()
        if group.parent == v1:
            (group / "cpu.cfs_period_us").write_text("50000")
        set_quota(group)
        return group
    except OSError:
        with contextlib.suppress(OSError):
            group.rmdir()
        return None


def logged(pattern, ranks="*"):
    return any(re.search(pattern, log.read_text(errors="replace"))
               for log in workspace.glob(f"runs/*/logs/rank-{ranks}.log"))


def joined(group, ranks):
    # True when every rank is in the group: a container's cgroup rules may let a group be made but not joined
    for proc in ranks:
        with contextlib.suppress(OSError):
            (group / "cgroup.procs").write_text(str(proc.pid))
    try:
        return {str(proc.pid) for proc in ranks} <= set((group / "cgroup.procs").read_text().split())
    except OSError:
        return False


def release(group):
    with contextlib.suppress(OSError):
        for pid in (group / "cgroup.procs").read_text().split():
            (group.parent / "cgroup.procs").write_text(pid)
        group.rmdir()


while not logged(r"iterations 1\\.\\.", "0000"):  # every rank is up: all of the node's are found
    time.sleep(0.02)
ranks = list(find_ranks())
while not ranks:  # node's ranks may be a moment behind rank 0's line under load
    time.sleep(0.1)
    ranks = list(find_ranks())
group = cpu_quota_group()
if group is not None and not joined(group, ranks):
    release(group)
    group = None
print(f"slowing node {node}'s ranks {[p.pid for p in ranks]} by", "a CPU quota" if group else "SIGSTOP/SIGCONT",
      f"(a busy process gets {statistics.median(readings[-5:]):.2f} of a core now)", file=sys.stderr, flush=True)
trained = r" iteration +(\\d+)/ +\\1 \\|"  # the last one, printed by the last rank
try:
    if group is not None:
        while not logged(trained):
            with contextlib.suppress(OSError):
                set_quota(group)
            time.sleep(1)
        sys.exit(0)
    for proc in ranks:
        with contextlib.suppress(psutil.Error):
            proc.nice(10)
    cycles = 0
    while ranks and (cycles % 20 or not logged(trained)):
        cycles += 1
        for proc in list(ranks):
            try:
                proc.suspend()
            except psutil.Error:
                ranks.remove(proc)
        running = now_share()
        time.sleep(0.05 * (1 - running))
        for proc in ranks:
            with contextlib.suppress(psutil.Error):
                proc.resume()
        time.sleep(0.05 * running)
finally:
    probe.kill()
    for proc in ranks:
        with contextlib.suppress(psutil.Error):
            proc.resume()
    if group is not None:
        release(group)
"""


def _megatron_on_three_nodes(tmp_path: Path, standins: dict, slow_node: int | None):
    # Flagged at 3x the gang's median: the throttled node reads 5-15x in every window, quiet or loaded; an even
    # gang's noisiest window on a loaded machine read 2.4x (and never two such windows in a row).
    return _megatron_with_a_slow_node(tmp_path, standins, slow_node, 0.17, nodes=3, ranks_per_node=1, threshold=2.0,
                                      model="qwen3-moe-tiny", argv=["--global-batch-size", "12", "--train-iters", "16"])


def _megatron_with_a_slow_node(tmp_path: Path, standins: dict, slow_node: int | None, share: float, *, nodes: int,
                               ranks_per_node: int, threshold: float, model: str, argv: list[str]):
    save = tmp_path / "save"
    spec = job("command", f"cluster.nodes={nodes}", f"cluster.gpus_per_node={ranks_per_node}", "command.torchrun=true",
               "command.argv=[x]", f"observe.straggler.threshold={threshold}", "observe.straggler.windows=2",
               workspace=tmp_path)
    spec = spec.set("command.argv", [
        "-m", "a4ray.mcore", "--model", str(standins[model]), "--save", str(save), "--data-path",
        str(standins["qwen-datasets"] / "mmap_qwen3_datasets_text_document"), "--seq-length", "32",
        "--log-interval", "4", "--save-interval", "1000", "--distributed-optimizer", "off", "--naming", "local",
        "--threads", "1", *argv])
    slower = None if slow_node is None else \
        subprocess.Popen([sys.executable, "-c", SLOW_DOWN, str(save), str(slow_node), str(tmp_path), str(share)])
    try:
        result = run(spec)
    finally:
        if slower is not None:
            slower.terminate()
            slower.wait(timeout=10)
    assert result.ok, result.verdict
    return result


def test_a_node_made_slower_is_flagged_a_straggler_and_an_even_gang_flags_none(local_cluster, tmp_path, standins,
                                                                               capfd):
    result = _megatron_on_three_nodes(tmp_path / "slow", standins, slow_node=2)
    out, err = capfd.readouterr()
    out += "".join(line + "\n" for line in err.splitlines() if line.startswith("slowing node"))
    flagged = result.gang.stragglers
    windows = [line for log in Path(result.gang.log_dir).glob("rank-*.log")
               for line in log.read_text().splitlines() if "A4RAY_COMPUTE" in line]
    assert [s.node.node for s in flagged] == [2], "\n".join(windows) + "\n" + out[-4000:]
    node2 = next(n for n in result.gang.nodes if n.gang_rank == 2)
    assert flagged[0].node.host == node2.host and flagged[0].slower_pct > 200
    assert re.search(rf"a4ray: straggler: node 2 \({node2.host}, [\d.]+, \S+\) computes \d+% slower than the gang's "
                     r"median \(\S+s vs \S+s per step\) for 2 window\(s\)", out)
    events = NodeHistory(tmp_path / "slow").events(node2.host)
    assert [e.event for e in events] == ["straggler"]
    # The per-node series, as the dashboard reads them from Prometheus (every node's, every window). The driver
    # reports its metrics every few seconds: the series can show an earlier window's values for a while.
    run_id = Path(result.gang.log_dir).parent.name

    def as_flagged(flags: list[str]) -> bool:
        return len(flags) == 3 and all(line.endswith((" 1.0", " 1")) == ('node="2"' in line) for line in flags)

    flags = scrape_until(rf'^ray_a4ray_node_straggler\{{.*run="{run_id}"', as_flagged)
    assert as_flagged(flags), flags
    assert any(f'host="{node2.host}"' in line for line in flags)
    assert len(scrape(rf'^ray_a4ray_node_step_time_seconds\{{.*run="{run_id}"')) == 3

    even = _megatron_on_three_nodes(tmp_path / "even", standins, slow_node=None)
    assert even.gang.stragglers == [] and "straggler:" not in capfd.readouterr().out


def test_a_wedged_rank_of_the_megatron_trainer_is_named_from_the_others_records_and_its_stack(local_cluster,
                                                                                               tmp_path, standins):
    """a4ray's Megatron trainer on 2 nodes x 2 ranks; rank 3 (node 1's second) is stopped (SIGSTOP: a rank too
    wedged to answer) after iteration 3, outside any collective (a stop that lands inside one is undone and tried
    again: a rank frozen in a collective it entered is no evidence against it). The others' flight records show the
    collective they wait in; rank 3 answers no record, and its stack shows it stopped outside: the verdict names
    rank 3, its node and host, and the collective's sequence number, and no rank of node 0 nor its partner on
    node 1; the node history records the culprit."""
    save = tmp_path / "save"
    spec = job("command", "cluster.nodes=2", "cluster.gpus_per_node=2", "command.torchrun=true", "command.argv=[x]",
               "observe.watchdog.no_progress_s=5", "observe.watchdog.record_timeout_s=3", workspace=tmp_path)
    spec = spec.set("command.argv", [
        "-m", "a4ray.mcore", "--model", str(standins["qwen3-moe-tiny"]), "--save", str(save), "--data-path",
        str(standins["qwen-datasets"] / "mmap_qwen3_datasets_text_document"), "--seq-length", "32",
        "--global-batch-size", "4", "--train-iters", "1000", "--save-interval", "100000",
        "--distributed-optimizer", "off", "--naming", "local", "--threads", "1"])
    stopped: list[psutil.Process] = []

    def stop_rank_3_after_iteration_3():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            logs = list((tmp_path / "runs").glob("*/logs/rank-0003.log"))
            if logs and re.search(r"iteration\s+3/", logs[0].read_text()):
                break
            time.sleep(0.1)
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(proc.info["cmdline"] or [])
                if str(save) in cmd and "a4ray.runtime.ranks" not in cmd and proc.environ().get("RANK") == "3":
                    for _ in range(50):
                        proc.suspend()
                        text, _error = dump(proc.pid, stopped=True)
                        if not StackDump(rank="3", node=1, pid=proc.pid, where=where(text)).in_collective:
                            break
                        proc.resume()
                        time.sleep(0.05)
                    stopped.append(proc)

    stopper = threading.Thread(target=stop_rank_3_after_iteration_3, daemon=True)
    stopper.start()
    result = run(spec)
    stopper.join(timeout=5)
    assert stopped and not result.ok and result.gang.failure_kind == "hang", result.verdict
    verdict = result.gang.hang_verdict
    node1 = next(n for n in result.gang.nodes if n.gang_rank == 1)
    assert [(c.rank, c.node.node, c.node.host) for c in verdict.culprits] == [(3, 1, node1.host)], verdict
    assert verdict.culprits[0].where.startswith("a stopped process (state T) in ")
    assert verdict.culprits[0].why == "its stack is outside any collective"
    assert verdict.waiting and set(verdict.waiting) <= {0, 1, 2} and verdict.collective.seq > 3, verdict
    assert verdict.evidence == ["flight recorder of rank(s) 0-2", "stacks of rank(s) 3"]
    record = json.loads((Path(result.gang.log_dir) / "flight-recorder" / "rank_0.json").read_text())
    assert any(e["collective_seq_id"] == verdict.collective.seq and not e["retired"] for e in record["entries"])
    assert f"rank 3 on node 1 ({node1.host}" in result.gang.failure  # said whole once; the result line refers to it
    assert "FAIL: the launch hung (rank 3; the verdict above)" in result.verdict
    culprit = [e for e in NodeHistory(tmp_path).events(node1.host) if e.event == "hang-culprit"]
    assert len(culprit) == 1 and f"#{verdict.collective.seq}" in culprit[0].detail


# Two gloo ranks; rank 1 works 0.2 s before each of the kinds of transfer megatron-core makes inside forward
# and backward (a collective, an asynchronous one waited for later, a batch of sends and receives), rank 0 does
# nothing and waits in them; then the gradient reduction (not timed). Prints the window's line.
TIMED_STEPS = """
import time, torch, torch.distributed as dist
from a4ray.programs.compute_time import ComputeTimer
from a4ray.programs.distributed import exit_distributed
dist.init_process_group("gloo")
rank, peer = dist.get_rank(), 1 - dist.get_rank()
timer = ComputeTimer(torch.device("cpu")).exclude_collectives()
finalize = timer.before(lambda: dist.all_reduce(torch.ones(8)))


def work():
    if rank == 1:
        time.sleep(0.2)


for _ in range(3):
    timer.start()
    work()
    dist.all_reduce(torch.ones(4))
    work()
    handle = dist.all_gather_into_tensor(torch.zeros(8), torch.ones(4), async_op=True)
    handle.wait()
    work()
    ops = [dist.P2POp(dist.isend, torch.ones(2), peer), dist.P2POp(dist.irecv, torch.zeros(2), peer)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    finalize()
timer.report(3)
exit_distributed(0)
"""


def test_a_ranks_compute_time_leaves_out_its_waits_in_collectives_async_ops_and_sends(tmp_path):
    """The clock on its own, on real gloo ranks: each kind of transfer counts as waiting, not compute."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", TIMED_STEPS], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": port})
             for r in range(2)]
    out = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], out
    window = json.loads(out[1].split("A4RAY_COMPUTE ", 1)[1])
    (idle, worker), (waited, worker_waited) = window["seconds"], window["waits"]
    assert idle < 0.15 and waited > 0.5 and worker > 0.55 and worker_waited < 0.15, window


def _windows(result) -> list[dict]:
    return [json.loads(line.split("A4RAY_COMPUTE ", 1)[1]) for log in Path(result.gang.log_dir).glob("rank-*.log")
            for line in log.read_text().splitlines() if "A4RAY_COMPUTE" in line]


def test_a_straggler_under_expert_parallelism_across_nodes_is_flagged_and_an_even_gang_flags_none(
        local_cluster, tmp_path, standins, capfd):
    """The A4 shape in miniature: Qwen3-Next-tiny (the qwen3_next rehearsal's model) on 2 nodes x 2 ranks with
    expert parallelism over all 4 (EP=4: every rank's token dispatch waits for both nodes; its partner on the node
    is in its group too). Node 1 is slowed from outside. Timed wall to wall up to the gradient reduction, node 0's
    ranks waited in the dispatch for node 1's and read as slow: nothing was flagged. Their time in the collectives
    is taken off: node 1 is flagged, with how much slower; the same run with no node slowed flags none."""
    # With 2 nodes the gang's median is their mean: a node k times slower than the other reads 2k/(k+1) of it
    # (under 2x). Node 1's ranks are ~6x slower (the old clock read both nodes alike); flagged from 50% over the
    # median (3x the other node).
    shape = dict(nodes=2, ranks_per_node=2, threshold=0.5, model="qwen3-next-tiny",
                 argv=["--ep", "4", "--global-batch-size", "4", "--train-iters", "12"])
    result = _megatron_with_a_slow_node(tmp_path / "slow", standins, 1, 0.17, **shape)
    out = capfd.readouterr().out
    windows = _windows(result)
    assert "ep 4 dp 4" in out and len(windows) == 3, out[-3000:]
    assert [s.node.node for s in result.gang.stragglers] == [1], "\n".join(map(str, windows)) + out[-3000:]
    node1 = next(n for n in result.gang.nodes if n.gang_rank == 1)
    assert result.gang.stragglers[0].node.host == node1.host and result.gang.stragglers[0].slower_pct > 50
    assert re.search(rf"a4ray: straggler: node 1 \({node1.host}, [\d.]+, \S+\) computes \d+% slower than the gang's "
                     r"median \(\S+s vs \S+s per step\) for 2 window\(s\)", out)
    # A slow rank waits least in the collectives: node 0's ranks wait for node 1's in the dispatch.
    last = windows[-1]
    assert min(last["waits"][:2]) > max(last["waits"][2:]) and max(last["seconds"][:2]) < min(last["seconds"][2:])

    even = _megatron_with_a_slow_node(tmp_path / "even", standins, None, 0.17, **shape)
    assert even.gang.stragglers == [] and "straggler:" not in capfd.readouterr().out, _windows(even)
