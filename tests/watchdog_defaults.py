"""Two runs with nothing configured (the watchdog's defaults), started in the background when the suite starts
(`conftest.pytest_configure`) and judged by tests/test_watchdog_defaults.py, usually near the suite's end: each
needs minutes of wall time by its nature (the defaults' windows are 30 s to look, 120 s to suspect), and idles
while it waits, so the rest of the suite runs meanwhile instead of waiting on it.

Each is a real `a4ray run --address` of 2 nodes x 2 gloo ranks, side by side on one embedded cluster of 4 nodes:
  * hung: rank 3 stops joining the all-reduces (sleeps outside any collective) while ranks 0-2 wait in the
    all-reduce (rank 1 beside a forked data-loader worker waiting in its dataset) and print the same warnings every
    second (Python's logging; and torch's TCPStore warning line as
    ProcessGroupNCCL prints it on GPUs, C++ frames and all: gloo has no such thread, so the test prints its text);
  * quiet: every rank computes for 4 minutes without a line, then all-reduces and ends with exit 0.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

QUIET_S = 240
HUNG = """
import logging, os, sys, threading, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()


class Prefetched(torch.utils.data.Dataset):  # rank 1's data-loader worker waits here the whole run
    def __len__(self):
        return 1

    def __getitem__(self, i):
        time.sleep(3600)


if rank == 1:  # a forked worker inherits RANK: its stack must not be read as rank 1's
    worker = iter(torch.utils.data.DataLoader(Prefetched(), num_workers=1))

def nag():  # what a blocked rank prints every second: the same lines, no news
    while True:
        logging.warning("the same warning, every second")
        print(f"[W1128 {time.strftime('%H:%M:%S')}.{int(time.time() * 1e6) % 1000000:06d} {os.getpid()} "
              "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1730] [PG ID 0 PG GUID 0(default_pg) Rank "
              f"{rank}] Failed to check the \\"should dump\\" flag on TCPStore, (maybe TCPStore server has shut down "
              "too early), with error: Broken pipe", file=sys.stderr, flush=True)
        print("frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f in libc10.so)",
              file=sys.stderr, flush=True)
        time.sleep(1)

for it in range(1, 1000):
    if rank == 3 and it == 4:
        print(f"rank 3 stops joining at {time.time():.3f}", flush=True)
        time.sleep(3600)
    if rank != 3 and it == 4:
        threading.Thread(target=nag, daemon=True).start()
    dist.all_reduce(torch.ones(4))
    time.sleep(0.2)
"""
QUIET = f"""
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
end = time.time() + {QUIET_S}
while time.time() < end:  # computing, without a line (lightly: the rest of the suite runs beside it)
    sum(i * i for i in range(2000))
    time.sleep(0.05)
dist.all_reduce(torch.ones(4))
print("computed", flush=True)
"""
RUNS = {"hung": HUNG, "quiet": QUIET}


def start(root: Path, env: dict[str, str]) -> None:
    """Start both runs under `root` in the background (`main`, detached: `rc` is written in each run's directory when
    it ends), once the suite's own clusters are up."""
    root.mkdir(parents=True, exist_ok=True)
    ray_tmp = Path(f"/tmp/rwd{os.getpid()}")  # short: Ray's socket paths have a limit
    subprocess.Popen(["bash", "-c", f"sleep 90; exec {sys.executable} {Path(__file__).resolve()} {root}"],
                     env={**env, "RAY_TMPDIR": str(ray_tmp)}, start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=open(root / "cluster.log", "w"), stderr=subprocess.STDOUT)


def main(root: Path) -> None:
    """One embedded cluster of 4 simulated nodes for both runs (one cluster's start, not two, on a loaded machine),
    each run an `a4ray run --address` of 2 nodes, side by side. Ray gives a node 30 s to register (fixed in
    ray/_private/node.py): on two loaded cores that can pass, which is the machine, not the watchdog under test, so
    the cluster's start is tried up to 3 times."""
    from a4ray.runtime.simulated import SimulatedCluster  # noqa: PLC0415 - only the background process needs Ray

    for attempt in range(3):
        cluster = SimulatedCluster(4, 2)
        try:
            cluster.start()
            break
        except Exception as e:  # noqa: BLE001 - said, and tried again
            print(f"cluster start {attempt + 1} failed: {e}", flush=True)
            cluster.shutdown()
            time.sleep(20)
    else:
        for name in RUNS:
            (root / name).mkdir(parents=True, exist_ok=True)
            (root / name / "out.log").write_text("the background cluster did not start (cluster.log)")
            (root / name / "rc").write_text("-2")
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)
        return
    runs = {}
    for name, program in RUNS.items():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "program.py").write_text(program)
        (d / "spec.yaml").write_text(
            f"kind: command\nname: defaults-{name}\ncommand: {{argv: [{d / 'program.py'}], torchrun: true}}\n"
            f"cluster: {{nodes: 2, gpus_per_node: 2}}\nstorage: {{local_workspace: {d / 'ws'}}}\n")
        runs[name] = subprocess.Popen(
            [sys.executable, "-m", "a4ray.cli", "run", "-f", str(d / "spec.yaml"), "--address", cluster.address,
             "--result", str(d / "result.json")], stdout=open(d / "out.log", "w"), stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
    try:
        for name, proc in runs.items():
            (root / name / "rc").write_text(str(proc.wait()))
    finally:
        cluster.shutdown()
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)  # start()'s, outside the suite's tmp_path


def wait(root: Path, name: str, timeout_s: float) -> tuple[int, str]:
    """(exit code, output) of run `name` once it has ended."""
    rc = root / name / "rc"
    deadline = time.monotonic() + timeout_s
    while not (rc.is_file() and rc.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(2)
    out = (root / name / "out.log").read_text() if (root / name / "out.log").is_file() else ""
    return (int(rc.read_text()) if rc.is_file() and rc.read_text().strip() else -1), out


if __name__ == "__main__":
    main(Path(sys.argv[1]))
