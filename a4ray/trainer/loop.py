"""The built-in trainer's loop: a Hugging Face causal LM under DDP, one process per GPU (run by torchrun).

NCCL on GPUs (device = LOCAL_RANK), gloo on CPU. AdamW with linear warmup and cosine decay to `min_lr`,
gradient accumulation up to the global batch, gradient clipping. Rank 0 prints a Megatron-style line per
logged iteration (a4ray's progress parser, metrics and hang watchdog read it), saves checkpoints, and ends
with one `A4RAY_RESULT {...}` line. A run whose save directory holds a checkpoint resumes from it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import sys
import time
import warnings
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from a4ray.programs.distributed import exit_distributed, init_distributed
from a4ray.programs.record import report_loop
from a4ray.trainer import checkpoint
from a4ray.trainer.batches import IGNORE, Batches, SFTRecords, TokenWindows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m a4ray.trainer", description=__doc__)
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--mode", choices=("pretrain", "sft"), default="pretrain")
    p.add_argument("--data", required=True, help="pretrain: Megatron dataset prefix (.bin/.idx); sft: JSON file")
    p.add_argument("--save", required=True, help="checkpoint directory")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--global-batch", type=int, required=True, help="a multiple of micro batch x ranks (the spec "
                   "resolves and checks it: RecipeJob.global_batch)")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--save-interval", type=int, default=100)
    p.add_argument("--log-interval", type=int, default=1)
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-layers", type=int, default=0, help="keep only the first N layers (0: all)")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0: CPUs / local ranks)")
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> tuple[torch.device, str]:
    device, backend = init_distributed(args.backend)
    if backend == "gloo":  # CPU ranks of one node share its cores
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(args.threads or int(os.environ.get("OMP_NUM_THREADS", "0"))
                              or max(1, (os.cpu_count() or 1) // local_world))
    return device, backend


def load_model(path: str, num_layers: int, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # unused-weight notices of a truncated model, kernel fallbacks
    hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(path)
    if num_layers and num_layers < config.num_hidden_layers:
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:num_layers]
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
    return model.to(device)


def lr_lambda(args: argparse.Namespace):
    decay = max(1, args.iterations - args.warmup)

    def factor(step: int) -> float:  # of args.lr, at scheduler step `step` (= iterations done)
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / decay)
        floor = args.min_lr / args.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def megatron_line(iteration: int, total: int, *, consumed: int, step_ms: float, lr: float, gbs: int,
                  loss: float, grad_norm: float, tokens_per_s: float) -> str:
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return (f" [{stamp}] iteration {iteration:>8}/{total:>8} | consumed samples: {consumed:>12} | "
            f"elapsed time per iteration (ms): {step_ms:.1f} | learning rate: {lr:.6E} | "
            f"global batch size: {gbs:>5} | lm loss: {loss:.6E} | grad norm: {grad_norm:.3f} | "
            f"tokens per second: {tokens_per_s:.1f} | number of skipped iterations: 0 | "
            f"number of nan iterations: {int(not math.isfinite(loss))} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module="megatron")
    device, backend = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    save = Path(args.save)
    # What a resumed run must share with its checkpoint (the iteration count may grow: training goes on).
    config = {"model": str(Path(args.model).resolve()), "mode": args.mode, "data": str(Path(args.data).resolve()),
              "seq_len": args.seq_len, "micro_batch": args.micro_batch, "global_batch": args.global_batch,
              "lr": args.lr, "min_lr": args.min_lr, "warmup": args.warmup, "num_layers": args.num_layers,
              "weight_decay": args.weight_decay, "seed": args.seed}
    start = checkpoint.latest(save) or 0
    if start:
        differences = checkpoint.check_config(save, config)
        if differences:
            if rank == 0:
                print(f"a4ray.trainer: error: {save} holds a checkpoint (iteration {start}) of another run: "
                      + "; ".join(differences) + ". Train into a new directory (train.output), or remove it.",
                      file=sys.stderr, flush=True)
            return 2

    torch.manual_seed(args.seed)  # the same initial state on every rank (DDP also broadcasts it)
    source = checkpoint.iteration_dir(save, start) / "model" if start else Path(args.model)
    model = load_model(str(source), args.num_layers, device)
    ddp = DDP(model, device_ids=[local_rank] if backend == "nccl" else None)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    if start:
        state = checkpoint.load_state(save, start)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if rank == 0:
            print(f"a4ray.trainer: resuming from checkpoint iteration {start} in {save}", flush=True)

    if args.mode == "pretrain":
        samples = TokenWindows(args.data, args.seq_len)
    else:
        from transformers import AutoTokenizer

        samples = SFTRecords(args.data, AutoTokenizer.from_pretrained(args.model), args.seq_len)
    batches = Batches(samples, seed=args.seed, global_batch=args.global_batch, micro_batch=args.micro_batch,
                      dp_rank=rank, dp_size=world)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
    if rank == 0:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        params = sum(p.numel() for p in model.parameters())
        print(f"a4ray.trainer: {type(model).__name__} ({params / 1e6:.2f}M parameters) from {source} on {world} "
              f"rank(s) ({backend}, {where}{', bf16 autocast' if bf16 else ', fp32'}); {args.mode} on {len(samples)} "
              f"samples of {args.seq_len} tokens; global batch {args.global_batch} = {args.micro_batch} x {world} "
              f"ranks x {batches.accumulation} accumulation; iterations {start + 1}..{args.iterations}", flush=True)

    losses, step_times = [], []
    for iteration in range(start, args.iterations):
        t0 = time.perf_counter()
        micro = batches.micro_batches(iteration)
        total = torch.zeros(2, device=device)  # loss sum over tokens, tokens
        for k, (inputs, labels) in enumerate(micro):
            inputs, labels = inputs.to(device), labels.to(device)
            sync = k == len(micro) - 1
            with (ddp.no_sync() if not sync else contextlib.nullcontext()), \
                    torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = ddp(input_ids=inputs).logits
                loss_sum = torch.nn.functional.cross_entropy(
                    logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE,
                    reduction="sum")
                tokens = (labels != IGNORE).sum()
                (loss_sum / tokens.clamp(min=1) / len(micro)).backward()
            total += torch.stack([loss_sum.detach(), tokens.detach().float()])
        grad_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.grad_clip)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step = time.perf_counter() - t0
        loss = (total[0] / total[1].clamp(min=1)).item()
        losses.append(loss)
        step_times.append(step)
        done = iteration + 1
        if rank == 0 and (done % args.log_interval == 0 or done == args.iterations or done == start + 1):
            print(megatron_line(done, args.iterations, consumed=done * args.global_batch, step_ms=step * 1000, lr=lr,
                                gbs=args.global_batch, loss=loss, grad_norm=float(grad_norm),
                                tokens_per_s=args.global_batch * args.seq_len / step), flush=True)
        if done % args.save_interval == 0 or done == args.iterations:
            if rank == 0:
                print(f"a4ray.trainer: saving checkpoint at iteration {done}", flush=True)  # busy: the watchdog waits
                path = checkpoint.save(save, done, model, optimizer, scheduler, config, Path(args.model), args.keep)
                print(f"a4ray.trainer: saved checkpoint iteration {done} to {path}", flush=True)
            dist.barrier()

    devices = [None] * world
    dist.all_gather_object(devices, f"{socket.gethostname()}:{device}")
    if rank == 0:
        report_loop("torch", world_size=world, backend=backend, devices=devices, iterations=args.iterations,
                    start=start, losses=losses, step_times=step_times, tokens_per_step=args.global_batch * args.seq_len,
                    checkpoint=str(checkpoint.iteration_dir(save, checkpoint.latest(save) or 0)),
                    precision="bf16" if bf16 else "fp32")
    exit_distributed(0)


if __name__ == "__main__":
    sys.exit(main())
