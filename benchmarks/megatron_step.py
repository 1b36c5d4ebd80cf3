"""Megatron step time through a4ray's gang against the same trainer under bare torchrun, interleaved.

    python benchmarks/megatron_step.py [--nodes 2 --gpus-per-node 1] [--rounds 3] [--iters 30] [--size small]
                                       [--family next]

Both sides run the same rank program (`python -m a4ray.mcore`, a4ray's Megatron trainer) with the same
arguments, from the same converted checkpoint and data, on the same devices:
  gang      the train step of the recipe (jobs/qwen3_local.yaml) through `a4ray.run` on one embedded cluster of
            N simulated nodes (each with its own GPUs where the machine has enough), started once and kept for
            every round: the gang places the nodes, a4ray's rank launcher starts the ranks, the supervisor
            streams every line
  torchrun  the trainer's own command (the plan's) under N plain torchrun "nodes" on 127.0.0.1, node i
            seeing the GPUs simulated node i sees, no Ray
The trainer times its own iterations; each side reports the median step time of a run (its first
iteration left out) and tokens/s. Rounds alternate gang, torchrun, gang, ... and the figures are the
medians over rounds; the ratio is gang / torchrun (goal <= 1.01), with its spread. Setup (once): the cluster
started, the stand-ins made, the model staged and converted natively by the same pipeline, unverified (what
is measured is the step); a round is then two training runs and nothing else.

--size tiny: the rehearsal's 2-layer Qwen3-MoE stand-in (CPU); small: a random Qwen3-MoE of 8 layers,
hidden 1024, 8 experts top-2 (GPU). --family next: Qwen3-Next instead (`python -m a4ray.qwen3_next`,
jobs/qwen3_next_local.yaml): tiny, the rehearsal's 4-layer Qwen3-Next-tiny; small, 8 layers (6 gated
DeltaNet, 2 gated attention), hidden 1024, 64 experts top-4 and a shared expert. On CPUs the ranks talk gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


from a4ray.api import load, run  # noqa: E402
from embedded import embedded_cluster  # noqa: E402
from a4ray.runtime.simulated import physical_gpu_ids  # noqa: E402
from bare import torchrun_as_nodes  # noqa: E402
from a4ray.trainers import trainer_for  # noqa: E402

# family -> (recipe, its local profile, the stand-in whose tokenizer the small model takes)
FAMILIES = {"moe": ("qwen3", REPO / "jobs" / "qwen3_local.yaml", "qwen3-moe-tiny"),
            "next": ("qwen3_next", REPO / "jobs" / "qwen3_next_local.yaml", "qwen3-next-tiny")}
SMALL = dict(layers=8, hidden=1024, heads=16, kv_heads=4, head_dim=64, ffn=2048, experts=8, topk=2, moe_ffn=512,
             vocab=512, shard_size="200MB")
SMALL_NEXT = dict(num_hidden_layers=8, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                  intermediate_size=2048, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
                  linear_value_head_dim=64, num_experts=64, num_experts_per_tok=4, moe_intermediate_size=256,
                  shared_expert_intermediate_size=512, vocab_size=512)


def overrides(args, ws: Path) -> list[str]:
    """What both sides run: the profile with this shape, model and batch."""
    out = [f"cluster.nodes={args.nodes}", f"cluster.gpus_per_node={args.gpus_per_node}",
           f"storage.local_workspace={ws}", f"train.megatron.parallel.ep={args.ep}", f"train.seq_len={args.seq}",
           f"train.micro_batch_size={args.micro}",
           f"train.global_batch_size={args.micro * args.nodes * args.gpus_per_node}",
           "train.save_interval=100000", "train.log_interval=5"]
    return out + ([f"artifacts[0].source={args.model}"] if args.model else [])


def pipeline(args, ws: Path, *sets: str) -> dict:
    """The recipe's pipeline on the benchmark's cluster (this process is its driver); its typed result as JSON.
    What the driver prints goes to the run's logs only: the figures are what this prints."""
    recipe, profile, _ = FAMILIES[args.family]
    spec = load(profile, *overrides(args, ws), *sets)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        result = run(spec)
    if not result.ok:
        print(said.getvalue()[-4000:], file=sys.stderr)
        raise SystemExit(f"the pipeline failed: {result.verdict}")
    return result.model_dump(mode="json")


def gang(args, ws: Path, i: int) -> dict:
    done = pipeline(args, ws, "pipeline.skip=[stage,convert,preflight]", f"train.output=logs/bench-gang-{i}",
                    f"train.iterations={args.iters}", "train.warmup_iterations=1")
    return done["steps"][3]["result"]


def torchrun(args, ws: Path, i: int, gpus: list[str]) -> dict:
    """The plan's command of the trainer, under N plain torchrun processes as N nodes."""
    spec = load(FAMILIES[args.family][1], *overrides(args, ws), f"train.output=logs/bench-torchrun-{i}",
                f"train.iterations={args.iters}", "train.warmup_iterations=1")
    trainer_args = trainer_for(spec, str(ws)).trainer_args()
    outputs = torchrun_as_nodes(args.nodes, args.gpus_per_node, gpus, 29531, ["-m", "a4ray.mcore", *trainer_args],
                                cwd=args.dir)
    records = [json.loads(line.split("A4RAY_RESULT ", 1)[1]) for out in outputs for line in out.splitlines()
               if "A4RAY_RESULT " in line]
    if not records:
        print(outputs[-1][-4000:], file=sys.stderr)
        raise SystemExit("the torchrun run reported no result")
    return records[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--size", choices=("tiny", "small"), help="default: small with GPUs, tiny without")
    p.add_argument("--family", choices=tuple(FAMILIES), default="moe", help="Qwen3-MoE (moe) or Qwen3-Next (next)")
    p.add_argument("--seq", type=int, help="tokens per sample (default: 64 tiny, 1024 small)")
    p.add_argument("--micro", type=int, default=4, help="micro batch per rank")
    p.add_argument("--dir", help="work directory (default: a temporary one)")
    args = p.parse_args()
    gpus = physical_gpu_ids()
    gpus = gpus if len(gpus) >= args.nodes * args.gpus_per_node else []
    args.size = args.size or ("small" if gpus else "tiny")
    args.seq = args.seq or (1024 if args.size == "small" else 64)
    world = args.nodes * args.gpus_per_node
    args.ep = max(e for e in (1, 2, 4, 8) if world % e == 0)
    args.dir = args.dir or tempfile.mkdtemp(prefix="a4ray-megatron-bench-")
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    ws = Path(args.dir) / "ws"
    args.model = None
    if args.size == "small":  # a bigger model of the stand-in's family and tokenizer
        from a4ray.staging.tiny import write_tiny, write_tiny_next
        from a4ray.staging.standins import make_all

        standin = make_all(Path(args.dir) / ".a4ray" / "standins")[FAMILIES[args.family][2]]
        model = (write_tiny(Path(args.dir) / "qwen3-moe-small", **SMALL) if args.family == "moe" else
                 write_tiny_next(Path(args.dir) / "qwen3-next-small", shard_size="200MB", **SMALL_NEXT))
        for f in standin.iterdir():
            if f.name.startswith(("tokenizer", "vocab", "merges", "special")):
                shutil.copy2(f, model / f.name)
        args.model = str(model)
    shape = f"{args.nodes} node(s) x {args.gpus_per_node} {'GPU(s)' if gpus else 'CPU rank(s) (gloo)'}"
    print(f"Megatron trainer ({args.size} Qwen3-{args.family.replace('moe', 'MoE').replace('next', 'Next')}, ep {args.ep}, seq {args.seq}, micro batch {args.micro}), "
          f"{shape}, {args.iters} iterations a run, {args.rounds} rounds; work dir {args.dir}", flush=True)
    with embedded_cluster(args.nodes, args.gpus_per_node):
        # Setup: staged and converted once (the conversion's verification is not what this measures).
        pipeline(args, ws, "pipeline.skip=[preflight]", "train.iterations=2", "train.warmup_iterations=1",
                 "train.output=logs/bench-setup", "convert.verify.enabled=false")
        runs: dict[str, list[dict]] = {"gang": [], "torchrun": []}
        ratios: list[float] = []
        for i in range(args.rounds):
            runs["gang"].append(gang(args, ws, i))
            runs["torchrun"].append(torchrun(args, ws, i, gpus))
            gang_ms, torchrun_ms = runs["gang"][-1]["step_time_ms"], runs["torchrun"][-1]["step_time_ms"]
            ratios.append(gang_ms / torchrun_ms)
            print(f"  round {i + 1}: gang {gang_ms:.2f} ms/step, torchrun {torchrun_ms:.2f} ms/step "
                  f"({ratios[-1]:.3f})", flush=True)
            (Path(args.dir) / "results.json").write_text(json.dumps({"runs": runs}, indent=1))  # kept if cut short
    step = {k: statistics.median(r["step_time_ms"] for r in v) for k, v in runs.items()}
    tokens = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    for name in ("gang", "torchrun"):
        print(f"  {name:<9s} median step {step[name]:8.2f} ms   {tokens[name]:12,.0f} tokens/s   "
              f"({runs[name][0]['backend']}, {runs[name][0]['world_size']} ranks)")
    ratio = statistics.median(ratios)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratio, ratio, ratio]
    print(f"  ratio gang / torchrun (step time), median of {len(ratios)} rounds: {ratio:.3f} (goal <= 1.01); "
          f"quartiles {quartiles[0]:.3f} .. {quartiles[2]:.3f}, range {min(ratios):.3f} .. {max(ratios):.3f}")
    (Path(args.dir) / "results.json").write_text(json.dumps({"runs": runs, "step_ms": step, "tokens_per_s": tokens,
                                                             "ratios": ratios, "ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
