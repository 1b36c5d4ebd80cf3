"""What a checkpoint costs training: synchronous torch_dist, async torch_dist and local (replicated) saves of
a4ray's Megatron trainer, in one run each of the same model on 2 "nodes", and what a restore costs from each.

    python benchmarks/checkpoint.py [--layers 8 --hidden 1024 --experts 8 --moe-ffn 1024] [--iters 12] [--every 4]

The model: a random Qwen3-MoE of the given shape (the stand-in's tokenizer and corpus; no conversion: random
init), expert parallel over 2 ranks, each rank a torchrun "node" on 127.0.0.1 (benchmarks/bare.py), gloo on the
CPU, NCCL where GPUs are visible. Every figure comes from the trainer's own lines:
  blocking    "saved checkpoint iteration N to ... in X s" (sync), "... to host memory in X s" (async), "done:
              saving local checkpoint iteration N: training blocked X s" (local, NVRx's LocalCheckpointManager,
              each rank's part replicated on the other node)
  background  "checkpoint iteration N complete: written in the background in Y s"
  step        the median gap between consecutive iteration lines (Megatron-LM's timestamps), saves included,
              against a run that saves only at its end
  restore     "done: loading the checkpoint in X s" after "busy: loading (local) checkpoint", resuming from a persistent
              checkpoint and from a local one (the local run is killed mid-way, as a fault would, so its local
              checkpoints stay)
Goals (issue 48): async and local block <= 0.1 of the sync save; local saves every 10 steps cost <= 2% of step time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from datetime import datetime
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bare import env  # noqa: E402

from a4ray.core.ports import free_port  # noqa: E402
from a4ray.runtime.node_local import NODE_LOCAL_ENV  # noqa: E402

STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/")
SYNC = re.compile(r"saved checkpoint iteration (\d+) to \S+ in ([0-9.]+)s")
ASYNC = re.compile(r"saved checkpoint iteration (\d+) to host memory in ([0-9.]+)s")
LOCAL = re.compile(r"done: saving local checkpoint iteration (\d+): training blocked ([0-9.]+)s")
BACKGROUND = re.compile(r"(local )?checkpoint iteration (\d+) complete: written in the background in ([0-9.]+)s")


def model_dir(work: Path, args) -> Path:
    """A Qwen3-MoE config of the benchmark's shape with the stand-in's tokenizer (random init: no weights)."""
    from a4ray.staging.standins import make_all

    standin = make_all(work / "standins")["qwen3-moe-tiny"]
    model = work / "model"
    shutil.copytree(standin, model, ignore=shutil.ignore_patterns("*.safetensors*"), dirs_exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    config.update(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=args.hidden // 16, num_experts=args.experts,
                  moe_intermediate_size=args.moe_ffn, intermediate_size=args.moe_ffn * 2)
    (model / "config.json").write_text(json.dumps(config))
    return model


def trainer(work: Path, model: Path, save: Path, iters: int, *extra: str) -> list[str]:
    data = work / "standins" / "qwen-datasets" / "mmap_qwen3_datasets_text_document"
    return ["-m", "a4ray.mcore", "--model", str(model), "--data-path", str(data), "--save", str(save),
            "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", str(iters),
            "--lr", "1e-4", "--ep", "2", "--naming", "local", "--log-interval", "1", *extra]


def launch(program: list[str], work: Path, kill_at: int | None = None) -> str:
    """The program under 2 torchrun "nodes" (one rank each), each with a RAM disk of its own for its local
    checkpoints (as a simulated node has: runtime/node_local.py); with `kill_at`, SIGKILLed once iteration
    `kill_at`'s line is out (a fault: what it left on the nodes stays). Returns every line."""
    port, procs, lines = free_port(), [], []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", *program]
        tmp = work / f"node{node}-tmp"  # torchrun's log directories and multiprocessing's go with the work directory
        tmp.mkdir(exist_ok=True)
        node_env = env(OMP_NUM_THREADS="1", TMPDIR=str(tmp), **{NODE_LOCAL_ENV: str(work / f"node{node}-shm")})
        procs.append(subprocess.Popen(cmd, env=node_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, cwd=work, start_new_session=True))
    def read(proc: subprocess.Popen) -> None:  # both nodes at once: the iteration lines come from the last rank
        for line in proc.stdout:
            lines.append(line)
            if kill_at is not None and f" iteration {kill_at:8d}/" in line:
                for p in procs:  # torchrun and its workers (which run in sessions of their own)
                    for victim in [*psutil.Process(p.pid).children(recursive=True), psutil.Process(p.pid)]:
                        with contextlib.suppress(psutil.Error):
                            victim.kill()

    readers = [threading.Thread(target=read, args=(proc,)) for proc in procs]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    for proc in procs:
        proc.wait()
    out = "".join(lines)
    if kill_at is None and any(p.returncode for p in procs):
        first = "\n".join(line for line in out.splitlines() if line.startswith("[rank0]"))[-3000:]
        raise SystemExit(f"a run failed: {' '.join(program)}\nrank 0:\n{first}\n...\n{out[-3000:]}")
    return out


def step_gap(out: str, every: int, skip: int = 2) -> float:
    """The mean gap between iteration lines over whole save intervals after the first `skip` iterations, the saves
    in them included (the last iteration's save, at the run's end, is not between two lines)."""
    stamps = {int(n): datetime.fromisoformat(t).timestamp() for t, n in STAMP.findall(out)}
    first = skip + (-skip) % every  # an interval's start: the iteration of a save
    last = first + every * ((max(stamps) - 1 - first) // every)
    return (stamps[last] - stamps[first]) / (last - first)


def load_time(out: str, kind: str) -> float:
    """The trainer's own timing of a resume's load ("done: loading the checkpoint in X s"), of `kind`."""
    said = "busy: loading local checkpoint" if kind == "local" else "busy: loading checkpoint iteration"
    assert said in out, f"the {kind} restore did not load a {kind} checkpoint:\n{out[-3000:]}"
    return float(re.search(r"done: loading the checkpoint in ([0-9.]+)s", out.split(said, 1)[1]).group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--moe-ffn", type=int, default=1024)
    p.add_argument("--iters", type=int, default=16)
    p.add_argument("--every", type=int, default=4, help="iterations between saves in the saving runs")
    p.add_argument("--dir", help="work directory (default: a temporary one, removed)")
    args = p.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="a4ray-ckpt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        run(args, work)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


def run(args, work: Path) -> None:
    model = model_dir(work, args)
    n, every = args.iters, args.every
    local = ["--non-persistent-save-interval", str(every), "--replication", "--replication-jump", "1"]
    outs = {
        "none": launch(trainer(work, model, work / "none", n, "--save-interval", str(10 * n)), work),
        "sync": launch(trainer(work, model, work / "sync", n, "--save-interval", str(every)), work),
        "async": launch(trainer(work, model, work / "async", n, "--save-interval", str(every), "--async-save"), work),
        "local": launch(trainer(work, model, work / "local-run", n, "--save-interval", str(10 * n), "--async-save",
                                *local), work, kill_at=n - 3),
        "local-alone": launch(trainer(work, model, work / "alone", n, "--save-interval", str(10 * n), "--async-save",
                                      *local[:2]), work),
    }
    # restores: the async run's last (persistent) checkpoint, and the killed local run's newest local one
    outs["restore-persistent"] = launch(trainer(work, model, work / "async", n + 1), work)
    outs["restore-local"] = launch(trainer(work, model, work / "local-run", n, "--save-interval", str(10 * n),
                                           *local), work)
    for name, out in outs.items():
        (work / f"{name}.log").write_text(out)
    report(args, outs)


def report(args, outs: dict[str, str]) -> None:
    def steady(found: list[tuple[str, str]]) -> tuple[float, float]:
        """(the first save's blocking time, the median of the later ones': the first also builds what later
        saves reuse); the run's last, synchronous save left out."""
        times = [float(s) for i, s in found if int(i) < args.iters]
        return times[0], statistics.median(times[1:] or times)

    firsts, blocked = {}, {}
    for run_, pattern in (("sync", SYNC), ("async", ASYNC), ("local", LOCAL), ("local-alone", LOCAL)):
        firsts[run_], blocked[run_] = steady(pattern.findall(outs[run_]))
    names = {"sync": "sync torch_dist", "async": "async torch_dist", "local": "local, replicated",
             "local-alone": "local, not replicated"}
    background = [float(s) for local_, _, s in BACKGROUND.findall(outs["async"]) if not local_]
    none_step = step_gap(outs["none"], args.every)
    print(f"model: Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts (moe ffn "
          f"{args.moe_ffn}), ep 2 over 2 torchrun nodes; {args.iters} iterations, saves every {args.every}")
    print(f"{'save':<22} {'first (s)':>9} {'blocks (s)':>10} {'/ sync':>7} {'step, saves every ' + str(args.every):>26} "
          f"{'every 10 (reckoned)':>20}")
    print(f"{'none':<22} {'':>9} {'':>10} {'':>7} {none_step:>21.3f}s      {'':>20}")
    for run_, name in names.items():
        gap = step_gap(outs[run_], args.every)
        print(f"{name:<22} {firsts[run_]:>9.3f} {blocked[run_]:>10.3f} {blocked[run_] / blocked['sync']:>7.3f} "
              f"{gap:>21.3f}s {(gap / none_step - 1) * 100:>+4.0f}% {blocked[run_] / 10 / none_step * 100:>19.1f}%")
    print(f"async: written in the background in {statistics.median(background):.2f}s (median), training going on")
    print(f"restore: persistent {load_time(outs['restore-persistent'], 'persistent'):.2f}s, local "
          f"{load_time(outs['restore-local'], 'local'):.2f}s")


if __name__ == "__main__":
    main()
