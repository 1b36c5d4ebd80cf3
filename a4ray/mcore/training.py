"""a4ray's Megatron-core trainer: the rank program `python -m a4ray.mcore` that torchrun (or a4ray's own
launcher, with torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) starts on every rank.

config (`parse_args`) -> build (`setup`, `build`) -> `train`:

* process group: NCCL on GPUs, gloo on the CPU (`a4ray.programs.distributed`), then megatron-core's
  `parallel_state.initialize_model_parallel` with the run's TP / PP / CP / EP / ETP.
* model: `model.gpt_model` from the HF config.json (Qwen3 / Qwen3-MoE), in mcore's
  `DistributedDataParallel`; `get_megatron_optimizer` (Adam, the distributed optimizer where the backend
  allows it) and `OptimizerParamScheduler` (linear warmup, then cosine / linear decay to --min-lr).
* weights: the trainer's own newest complete checkpoint in --save (model, optimizer, scheduler,
  iteration, RNG) if there is one, else the converted checkpoint in --load (weights only, refused if
  its tensor shapes do not fit the model), else random init.
* step: `get_forward_backward_func()` over this data-parallel rank's micro-batches of the iteration
  (`dataset.Batches`), loss = masked LM loss (+ the routers' load-balancing loss, which mcore adds to the
  backward pass itself), `optimizer.step()`, scheduler step by the global batch.
* log: Megatron-LM's `training_log` iteration line, printed by the last rank, and every rank's own compute
  time per step over the interval (`programs/compute_time.py`: forward and backward, up to the gradient
  reduction, less the time in their collectives) for the gang's straggler check, and the TensorBoard
  scalars (`scalars.Scalars`, in --tensorboard-dir); checkpoints every
  --save-interval iterations and at the end (`checkpointing.save`, Megatron-LM's torch_dist layout); at
  the end one `A4RAY_RESULT {...}` record (trainer "megatron") from the last rank.
* notice (--exit-signal-handler): on --exit-signal every rank saves at the iteration it reached and ends
  (`Notice`; a4ray's stop with notice, runtime/notice.py); where that save would not finish within
  --notice-grace-s, the newest local checkpoint is copied to --save instead (`persist_local_instead`), and a
  rerun resumes from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import signal
import socket
import sys
import time
from datetime import datetime
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from a4ray.mcore import checkpoint_dirs, checkpointing, dataset, shims
from a4ray.mcore.architecture import Architecture
from a4ray.mcore.hybrid import delta_rule_path
from a4ray.mcore.local_checkpoints import LocalCheckpoints
from a4ray.mcore.model import Parallel, default_naming, gpt_model, wrap_float16
from a4ray.mcore.scalars import Scalars
from a4ray.programs.compute_time import ComputeTimer
from a4ray.programs.distributed import exit_distributed, init_distributed
from a4ray.observe.checkpoint_policy import PUBLISHED_RATE, Interval, resume_from
from a4ray.programs.record import report_loop
from a4ray.runtime.node_local import local_checkpoints_root
from a4ray.runtime.notice import NOTICE_EXIT_CODE

PREFIX = "a4ray.mcore:"


# ---------------------------------------------------------------------------------------- config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m a4ray.mcore", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory: config.json and tokenizer files")
    p.add_argument("--load", help="converted Megatron checkpoint (its tracker names the directory, e.g. release)")
    p.add_argument("--save", required=True, help="checkpoint directory of this run (resumed from when it holds one)")
    p.add_argument("--data-path", required=True, help="Megatron indexed dataset prefix (<prefix>.bin/.idx)")
    p.add_argument("--data-cache-path", help="GPTDataset index caches (default: <save>/data_cache)")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, required=True,
                   help="a multiple of micro batch x data-parallel size (the spec resolves and checks it)")
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--lr-warmup-iters", type=int, default=0)
    p.add_argument("--lr-decay-iters", type=int, default=0, help="default: --train-iters")
    p.add_argument("--lr-decay-style", choices=("cosine", "linear", "constant"), default="cosine")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--adam-beta1", type=float, default=0.9)
    p.add_argument("--adam-beta2", type=float, default=0.95)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--aux-loss-coeff", type=float, help="router load-balancing loss (default: HF router_aux_loss_coef)")
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int, default=1)
    p.add_argument("--context-parallel-size", "--cp", dest="cp", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", "--ep", dest="ep", type=int, default=1)
    p.add_argument("--expert-tensor-parallel-size", "--etp", dest="etp", type=int, default=None)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--distributed-optimizer", choices=("auto", "on", "off"), default="auto",
                   help="auto: on where the backend has reduce-scatter / all-gather-into-tensor")
    p.add_argument("--naming", choices=("auto", "local", "te"), default="auto",
                   help="layer spec (and so checkpoint naming): te where Transformer Engine imports")
    p.add_argument("--save-interval", type=interval, default=100,
                   help="iterations between checkpoints, or auto: the interval Meta's ETTR model finds best for the "
                        "save's measured blocking time, the nodes and their failure rate (observe/checkpoint_policy.py)")
    p.add_argument("--keep", type=int, default=0, help="keep only the newest N checkpoints (0: all)")
    p.add_argument("--async-save", action="store_true",
                   help="interval saves block training only for the copy of the state; the write goes on in the "
                        "background and the checkpoint counts (the tracker names it) once every rank's part is written "
                        "(Megatron-LM's --async-save; --check-save checks the synchronous ones: the last, on notice)")
    p.add_argument("--non-persistent-save-interval", type=interval, default=0,
                   help="save a local checkpoint every N iterations (0: none): each rank's part in node-local storage, "
                        "replicated on other nodes with --replication (Megatron-LM's names; a4ray.mcore.local_checkpoints)")
    p.add_argument("--non-persistent-ckpt-type", choices=("local",), default="local")
    p.add_argument("--non-persistent-local-ckpt-dir", help="node-local storage (default: the node's RAM disk, /dev/shm/a4ray-local-checkpoints)")
    p.add_argument("--replication", action="store_true", help="replicate each rank's local checkpoint on other ranks")
    p.add_argument("--replication-jump", type=int, default=0,
                   help="ranks between a part's holders (default: the ranks per node: each replica on another node)")
    p.add_argument("--replication-factor", type=int, default=2, help="holders of each part, its own rank included")
    p.add_argument("--failures-per-1000-node-days", type=float, default=PUBLISHED_RATE,
                   help="each node's failure rate, for auto intervals (default: Meta's published RSC-1 rate)")
    p.add_argument("--failure-rate-source", default="Meta's published RSC-1 rate",
                   help="where --failures-per-1000-node-days comes from, as the run says it")
    p.add_argument("--log-interval", type=int, default=1)
    p.add_argument("--tensorboard-dir", help="TensorBoard scalars (default: <save>/../tensorboard)")
    p.add_argument("--exit-interval", type=int, default=0,
                   help="save and stop after an iteration divisible by this (Megatron-LM's --exit-interval)")
    p.add_argument("--notice-grace-s", type=float, default=0,
                   help="the time a notice gives (0: unknown): where a full save would not finish in what is left of "
                        "it, the newest local checkpoint is copied to --save instead")
    p.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal every rank finishes its iteration, saves a checkpoint at it and ends "
                        "(Megatron-LM's --exit-signal-handler): a stop with notice loses no iteration")
    p.add_argument("--exit-signal", choices=("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"), default="SIGTERM",
                   help="the signal --exit-signal-handler acts on (a4ray sends SIGUSR1: its fault stops send SIGTERM, "
                        "which must end a rank blocked on a dead peer at once)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="parameters' dtype: auto = bf16 on GPUs, fp32 on the CPU (the CPU is fp32 whatever is asked)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0: CPUs / local ranks)")
    p.add_argument("--check-save", action="store_true",
                   help="after each save, load it back through megatron-core and compare with what was saved")
    return p.parse_args(argv)


def interval(text: str) -> int | None:
    """An interval argument: a number of iterations >= 0, or auto (None)."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of iterations or auto") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of iterations >= 0 or auto")
    return value


def say(message: str, *, rank0: bool = True) -> None:
    if not rank0 or dist.get_rank() == 0:
        print(f"{PREFIX} {message}", flush=True)


def is_last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


# ----------------------------------------------------------------------------------------- build


def setup(args: argparse.Namespace) -> tuple[torch.device, str, Parallel]:
    """Process group, CPU shims, megatron-core's parallel state and RNG seeds."""
    device, backend = init_distributed(args.backend)
    if shims.apply():
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(args.threads or int(os.environ.get("OMP_NUM_THREADS", "0"))
                              or max(1, (os.cpu_count() or 1) // local_world))
    from megatron.core import parallel_state, tensor_parallel

    parallel = Parallel(tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, etp=args.etp,
                        sequence_parallel=args.sequence_parallel)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        context_parallel_size=args.cp, expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    return device, backend, parallel


def distributed_optimizer_supported() -> tuple[bool, str]:
    """Does the data-parallel backend do what mcore's distributed optimizer needs (reduce-scatter of the
    grad buckets, all-gather-into-tensor of the updated params)? Probed, the same way on every rank."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    n = dist.get_world_size(group)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dist.reduce_scatter_tensor(torch.zeros(1, device=device), torch.ones(n, device=device), group=group)
        dist.all_gather_into_tensor(torch.zeros(n, device=device), torch.ones(1, device=device), group=group)
    except (RuntimeError, NotImplementedError, ValueError) as error:
        return False, f"{dist.get_backend(group)}: {str(error).splitlines()[0]}"
    return True, f"{dist.get_backend(group)} has reduce_scatter_tensor and all_gather_into_tensor"


def build(args: argparse.Namespace, arch, parallel: Parallel, naming: str, use_dist_opt: bool):
    """The model (in mcore's DDP), its optimizer and LR scheduler."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    dtype = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}[args.precision]
    module = gpt_model(arch, training=True, parallel=parallel, naming=naming, dtype=dtype,
                       aux_loss_coeff=args.aux_loss_coeff)
    config = module.config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_dist_opt)
    model = DistributedDataParallel(config, ddp_config, wrap_float16(module, config))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
                        bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype,
                        use_distributed_optimizer=use_dist_opt),
        [model])
    # What Megatron-LM's setup does: the schedule scales the loss and finishes the DP gradient reduction.
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    G = args.global_batch_size
    decay_iters = args.lr_decay_iters or args.train_iters
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters * G,
        lr_decay_steps=decay_iters * G, lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters * G, wd_incr_style="constant",
        # a resumed run may train longer than the checkpoint's: its own schedule (iterations done kept)
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    return module, model, optimizer, scheduler


def load_weights(args: argparse.Namespace, arch, naming: str, module, optimizer, scheduler,
                 use_dist_opt: bool, local: LocalCheckpoints | None) -> tuple[int, str]:
    """Resume from the newest of --save's and the local checkpoints, else start from --load; returns (iteration
    done, where from)."""
    save = Path(args.save).resolve()
    resume = checkpoint_dirs.newest_complete(save)
    for skipped, why in checkpoint_dirs.incomplete_after(save, resume):
        say(f"not loading checkpoint iteration {skipped}: {why}; "
            + (f"the newest complete one is iteration {resume}" if resume is not None else "no complete one"))
    newest_local = None
    if local is not None:
        if (kept := local.adopt_persisted(newer_than=resume)) is not None:
            say(f"local checkpoint iteration {kept}: persisted at a stop with notice; each rank's part copied to its "
                f"node's storage")
        newest_local = local.newest()
    if resume_from(resume, newest_local)[0] == "local":
        say(f"busy: loading local checkpoint iteration {newest_local}")
        t0 = time.perf_counter()
        template = checkpointing.state_dict(module, optimizer, scheduler, args=None, iteration=None,
                                            use_distributed_optimizer=use_dist_opt, is_loading=True)
        say(f"local checkpoint iteration {newest_local}: {local.sources()}")
        loaded = checkpointing.apply_loaded(local.load(template), module, optimizer, scheduler)
        say(f"done: loading the checkpoint in {time.perf_counter() - t0:.2f}s")
        iteration = int(loaded["iteration"])
        newer = f"newer than the persistent checkpoint iteration {resume}" if resume is not None else \
            "no persistent checkpoint yet"
        say(f"resuming from local checkpoint iteration {iteration} ({newer}) in {local.describe()}: model, "
            f"optimizer, scheduler, RNG (learning rate {scheduler.get_lr(optimizer.param_groups[0]):.6E})")
        return iteration, f"local checkpoint iteration {iteration}"
    if resume is not None:
        directory = checkpoint_dirs.iteration_dir(save, resume)
        say(f"busy: loading checkpoint iteration {resume}")  # the hang watchdog's pace and quiet windows wait
        t0 = time.perf_counter()
        loaded = checkpointing.load_resume(directory, module, optimizer, scheduler, use_dist_opt)
        say(f"done: loading the checkpoint in {time.perf_counter() - t0:.2f}s")
        iteration = int(loaded["iteration"])
        older = "" if newest_local is None else f"; the newest local one, iteration {newest_local}, is not newer"
        say(f"resuming from checkpoint iteration {iteration} in {save}: model, optimizer, scheduler, RNG "
            f"(learning rate {scheduler.get_lr(optimizer.param_groups[0]):.6E}){older}")
        return iteration, str(directory)
    if args.load:
        directory = checkpoint_dirs.converted_dir(Path(args.load))
        say(f"busy: loading the converted checkpoint {directory}")
        theirs = checkpointing.load_weights(module, directory, arch, naming)  # CheckpointMismatch before training
        say("done: loading the checkpoint")
        optimizer.reload_model_params()  # bf16: the optimizer's fp32 main params were copied at construction
        say(f"loaded model weights from {directory} (converted checkpoint, {theirs or 'unknown'} naming, into the "
            f"{naming} spec; optimizer starts fresh)")
        return 0, str(directory)
    say("no checkpoint in --save and no --load: random initialisation")
    return 0, "random"


# ------------------------------------------------------------------------------------------ step


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Megatron-LM's pretrain_gpt loss: the masked token loss sum, its token count, and the report."""
    losses = output.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().clone().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.view(1).float()])}


def forward_step(data_iterator, model):
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = next(data_iterator)
    device = next(model.parameters()).device
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if parallel_state.get_context_parallel_world_size() > 1:  # this context-parallel rank's share of the sequence
        # megatron-core 0.19 added a required `is_hybrid_cp` (0.16 has none): this is plain (not hybrid) CP.
        hybrid = {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters \
            else {}
        batch = get_batch_on_this_cp_rank(batch, **hybrid)
    # The dataset's causal mask when it makes one (CPU / local attention); else the attention's own.
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def train_step(model, optimizer, scheduler, micro_batches: list[dict], seq_len: int, micro_batch: int,
               global_batch: int) -> tuple[dict[str, float], float | None, bool]:
    """One iteration: forward/backward over the micro-batches, optimizer step, LR step.
    Returns (reduced losses, grad norm, update successful)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
        num_microbatches=len(micro_batches), seq_length=seq_len, micro_batch_size=micro_batch,
        forward_only=False)
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step(increment=global_batch)
    reduced = {}
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for key in losses[0]:
            val = torch.vstack([x[key].view(-1) for x in losses]).sum(dim=0)
            dist.all_reduce(val, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            reduced[key] = (val[0] / val[1]).item()
    return reduced, grad_norm, update_successful


def moe_losses(config, num_microbatches: int) -> dict[str, float]:
    """The routers' aux losses of the iteration, as Megatron-LM's training_log tracks them (averaged over
    MoE layers and micro-batches, before the aux-loss coefficient)."""
    if config.num_moe_experts is None:
        return {}
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    names = ["load_balancing_loss"] if "aux_loss" in config.moe_router_load_balancing_type else []
    totals: dict[str, torch.Tensor] = {}
    track_moe_metrics(loss_scale=1 / num_microbatches, iteration=0, total_loss_dict=totals, force_initialize=True,
                      track_names=names, num_layers=config.num_layers, moe_layer_freq=config.moe_layer_freq)
    return {k: float(v) for k, v in totals.items()}


def training_log(iteration: int, train_iters: int, *, consumed: int, step_ms: float, lr: float, gbs: int,
                 losses: dict[str, float], loss_scale: float, grad_norm: float | None, skipped: int, nan: int) -> str:
    """Megatron-LM's iteration line (megatron/training/training.py, training_log), field for field."""
    line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    line += f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed:12d} |"
    line += f" elapsed time per iteration (ms): {step_ms:.1f} |"
    line += f" learning rate: {lr:.6E} |"
    line += f" global batch size: {gbs:5d} |"
    for key, value in losses.items():
        if value > 0.0:
            line += f" {key}: {value:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += f" number of skipped iterations: {skipped:3d} |"
    line += f" number of nan iterations: {nan:3d} |"
    return line


# ----------------------------------------------------------------------------------------- train


class Notice:
    """--exit-signal-handler: the signal only sets a flag; at the end of each iteration the ranks agree on it (a
    max-all-reduce of one integer, so a rank the signal has not reached yet saves with the others), then save at
    that iteration and end."""

    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.received_at: float | None = None  # time.monotonic() when it came
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        signal.signal(getattr(signal, name), self._on_signal)

    @property
    def received(self) -> bool:
        return self.received_at is not None

    def _on_signal(self, _signum, _frame) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()

    def time_left(self, grace_s: float, full_save_s: float) -> tuple[float, float]:
        """(seconds of the grace period left, the full save's estimate), the same on every rank: from the rank the
        notice reached first, and the slowest rank's last save."""
        elapsed = time.monotonic() - self.received_at if self.received_at is not None else 0.0
        costs = torch.tensor([elapsed, full_save_s], dtype=torch.float64, device=self.flag.device)
        dist.all_reduce(costs, op=dist.ReduceOp.MAX)
        return grace_s - costs[0].item(), costs[1].item()

    def agreed(self) -> bool:
        self.flag.fill_(int(self.received))
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX)
        return bool(self.flag.item())



def train(args: argparse.Namespace, *, module, model, optimizer, scheduler, batches: dataset.Batches, start: int,
          ckpt_args, local: LocalCheckpoints | None) -> dict:
    """Iterations start+1 .. train_iters; returns what the result record reports."""
    config = module.config
    G, S = args.global_batch_size, args.seq_length
    losses, step_times = [], []
    totals: dict[str, float] = {}
    interval = {"time": 0.0, "iters": 0, "skipped": 0, "nan": 0}
    saved = None
    # each rank's own compute, for the straggler check: waiting in the collectives inside forward and backward
    # (EP's token dispatch, TP, PP) is not its own
    compute = ComputeTimer(next(module.parameters()).device).exclude_collectives()
    config.finalize_model_grads_func = compute.before(config.finalize_model_grads_func)
    scalars = Scalars.for_this_rank(tensorboard_dir(args), last_rank=is_last_rank())
    notice = Notice(args.exit_signal, next(module.parameters()).device) if args.exit_signal_handler else None
    nodes = dist.get_world_size() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rate = dict(nodes=nodes, failures_per_1000_node_days=args.failures_per_1000_node_days,
                rate_source=args.failure_rate_source, start=start)
    persistent = Interval("checkpoint", args.save_interval, **rate)
    local_interval = Interval("local checkpoint", args.non_persistent_save_interval or None, **rate) \
        if local is not None else None
    saves = checkpointing.AsyncSaves() if args.async_save else None
    noticed = False
    full_save = SaveCost()
    for iteration in range(start, args.train_iters):
        t0 = time.perf_counter()
        compute.start()
        micro = batches.micro_batches(iteration)
        reduced, grad_norm, ok = train_step(model, optimizer, scheduler, micro, S, args.micro_batch_size, G)
        reduced.update(moe_losses(config, len(micro)))
        step = time.perf_counter() - t0
        done = iteration + 1
        scalars.node_step(done, step)
        loss = reduced.get("lm loss", float("nan"))
        losses.append(loss)
        step_times.append(step)
        interval["time"] += step
        interval["iters"] += 1
        interval["skipped"] += int(not ok)
        interval["nan"] += int(not math.isfinite(loss))
        for key, value in reduced.items():
            totals[key] = totals.get(key, 0.0) + value
        if done % args.log_interval == 0 or done == start + 1:
            if is_last_rank():  # Megatron-LM prints on the last rank (print_rank_last)
                iters, n = interval["iters"], max(1, interval["iters"] - interval["skipped"])
                lr = next(g["lr"] for g in optimizer.param_groups if g.get("default_config", True))
                print(training_log(
                    done, args.train_iters, consumed=done * G, step_ms=interval["time"] * 1000 / iters, lr=lr, gbs=G,
                    losses={k: v / n for k, v in totals.items()}, loss_scale=float(optimizer.get_loss_scale()),
                    grad_norm=grad_norm, skipped=interval["skipped"], nan=interval["nan"]), flush=True)
                scalars.training(done, losses={k: v / n for k, v in totals.items()}, lr=lr, grad_norm=grad_norm,
                                 step_s=interval["time"] / iters, batch_size=G, tokens_per_step=G * S,
                                 loss_scale=float(optimizer.get_loss_scale()))
            totals.clear()
            interval.update(time=0.0, iters=0, skipped=0, nan=0)
        if done % args.log_interval == 0:  # a window of the straggler check: every rank reports at once
            compute.report(done)
        stop = bool(args.exit_interval) and done % args.exit_interval == 0 and done < args.train_iters
        noticed = notice is not None and notice.agreed() and done < args.train_iters
        if saves is not None:
            full_save.finished(report_finished(saves, blocking=False))
        pace = sorted(step_times[-20:])[len(step_times[-20:]) // 2]  # the median step of late
        # A local save is made where one is due even beside a persistent one, which may not complete: a fault then
        # redoes at most one local interval. None where the run ends here: the persistent save is its last word.
        ends = done == args.train_iters or stop or noticed
        ckpt_args.iteration, ckpt_args.consumed_train_samples = done, done * G  # what a save this iteration records
        if local_interval is not None and local_interval.due(done) and not ends:
            blocked = save_local(done, local, module=module, optimizer=optimizer, scheduler=scheduler,
                                 ckpt_args=ckpt_args, use_dist_opt=model.ddp_config.use_distributed_optimizer,
                                 saves=saves)
            if chosen := local_interval.saved(done, blocked, pace):
                say(chosen)
        kept_local = noticed and persist_local_instead(args, notice, local, saves, full_save)
        if (persistent.due(done) or ends) and not kept_local:
            # the run goes on after an interval's save only: the others are synchronous
            saved, blocked = save_checkpoint(
                args, done, module=module, optimizer=optimizer, scheduler=scheduler, ckpt_args=ckpt_args,
                use_dist_opt=model.ddp_config.use_distributed_optimizer, saves=saves, background=not ends,
                noticed=noticed)
            full_save.saved(blocked, background=not ends and saves is not None)
            if (chosen := persistent.saved(done, blocked, pace)) and not ends:
                say(chosen)
        if noticed:
            say(f"exiting after iteration {done}: {args.exit_signal} received (--exit-signal-handler)")
            break
        if stop:
            say(f"exiting after iteration {done} (--exit-interval {args.exit_interval})")
            break
    scalars.close()
    return {"losses": losses, "step_times": step_times, "checkpoint": str(saved) if saved else None,
            "noticed": noticed}


class SaveCost:
    """What a full (persistent) save of this run takes, as last measured: a synchronous one's blocking time, an
    async one's blocking and background time together. None before the first."""

    def __init__(self) -> None:
        self.seconds: float | None = None
        self._blocked = 0.0  # the async save in flight blocked this long

    def saved(self, blocked: float, background: bool) -> None:
        if background:
            self._blocked = blocked
        else:
            self.seconds = blocked

    def finished(self, done: list[tuple[int, float, str]]) -> None:
        for _, written, kind in done:
            if kind == "persistent":
                self.seconds = self._blocked + written


def persist_local_instead(args: argparse.Namespace, notice: Notice, local: LocalCheckpoints | None,
                          saves: checkpointing.AsyncSaves | None, full_save: SaveCost) -> bool:
    """On notice, where a full save would not finish within what is left of the grace period (--notice-grace-s,
    against the last measured save): copy the newest local checkpoint to --save instead, if it is newer than the
    newest persistent one (every rank at once). Returns whether it did; False: the full save is made."""
    if local is None or not args.notice_grace_s or full_save.seconds is None:
        return False
    if saves is not None:
        full_save.finished(report_finished(saves, blocking=True))  # a local save in flight may be the newest
    left, estimate = notice.time_left(args.notice_grace_s, full_save.seconds)
    if estimate <= left:
        return False
    newest, persistent = local.newest(), checkpoint_dirs.newest_complete(Path(args.save).resolve())
    why = (f"a full save takes ~{estimate:.1f}s (the last one) and {max(left, 0):.1f}s of the {args.notice_grace_s:g}s "
           f"grace period are left")
    if newest is None or (persistent is not None and newest <= persistent):
        say(f"{why}, but no local checkpoint is newer than the persistent one: saving in full all the same")
        return False
    t0 = time.perf_counter()
    where = local.persist(newest)
    say(f"persisted local checkpoint iteration {newest} on notice ({notice.name}) to {where} in "
        f"{time.perf_counter() - t0:.2f}s: {why}")
    return True


def save_checkpoint(args: argparse.Namespace, done: int, *, module, optimizer, scheduler, ckpt_args, use_dist_opt: bool,
                    saves: checkpointing.AsyncSaves | None, background: bool, noticed: bool) -> tuple[Path, float]:
    """Save iteration `done`: in the background (`saves`) if `background`, else synchronously; a save still in
    flight is finished first (one at a time, as Megatron-LM's). Returns the directory and how long training was
    blocked."""
    if saves is not None:
        report_finished(saves, blocking=True)
    background = background and saves is not None
    save = Path(args.save).resolve()
    t0 = time.perf_counter()
    # Megatron-LM's words: the hang watchdog allows a save its upper bound, not the run's pace
    say(f"saving checkpoint at iteration {done:7d} to {save} in torch_dist format")
    saved = checkpointing.save(save, done, module, optimizer, scheduler, ckpt_args, use_dist_opt, keep=args.keep,
                               saves=saves if background else None)
    blocked = time.perf_counter() - t0
    if background:  # "saved checkpoint iteration" ends the busy spell (observe/goodput.py, observe/hang.py)
        say(f"saved checkpoint iteration {done} to host memory in {blocked:.2f}s; writing {saved} in the background "
            "(async save)")
    elif noticed:  # runtime.notice.SAVED_ON_NOTICE
        say(f"saved checkpoint iteration {done} on notice ({args.exit_signal}) to {saved} in {blocked:.2f}s")
    else:
        say(f"saved checkpoint iteration {done} to {saved} in {blocked:.2f}s")
    if args.check_save and not background:
        check_saved(saved, module, optimizer, use_dist_opt)
    return saved, blocked


def save_local(done: int, local: LocalCheckpoints, *, module, optimizer, scheduler, ckpt_args, use_dist_opt: bool,
               saves: checkpointing.AsyncSaves | None) -> float:
    """A local checkpoint of iteration `done` (every rank at once), after any save in flight; returns how long
    training was blocked."""
    if saves is not None:
        report_finished(saves, blocking=True)
    t0 = time.perf_counter()
    say(f"busy: saving local checkpoint iteration {done}")
    state = checkpointing.state_dict(module, optimizer, scheduler, args=ckpt_args, iteration=done,
                                     use_distributed_optimizer=use_dist_opt)
    local.save(done, state, saves)
    blocked = time.perf_counter() - t0
    say(f"done: saving local checkpoint iteration {done}: training blocked {blocked:.2f}s"
        + ("; written in the background" if saves is not None else ""))
    return blocked


def report_finished(saves: checkpointing.AsyncSaves, blocking: bool) -> list[tuple[int, float, str]]:
    """Finalize the async saves whose writers have ended on every rank (every rank calls it at the same point);
    returns them, as `AsyncSaves.finish`."""
    done = saves.finish(blocking)
    for iteration, seconds, kind in done:
        say(f"{'local ' if kind == 'local' else ''}checkpoint iteration {iteration} complete: written in the "
            f"background in {seconds:.2f}s; the newest to resume from")
    return done


def tensorboard_dir(args: argparse.Namespace) -> Path:
    return Path(args.tensorboard_dir or Path(args.save).resolve().parent / "tensorboard").resolve()


def check_saved(directory: Path, module, optimizer, use_dist_opt: bool) -> None:
    """Load `directory` back through megatron-core into NaN-filled tensors and compare every model tensor
    and optimizer state tensor with what this rank holds (= what it saved)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    model_before = {k: v.detach().clone() for k, v in module.state_dict().items() if torch.is_tensor(v)}
    optim_before = [t.detach().clone() for t in _optimizer_tensors(optimizer)]
    request = checkpointing.state_dict(module, optimizer, None, args=None, iteration=None,
                                    use_distributed_optimizer=use_dist_opt, is_loading=True)
    request = {"model": request["model"], "optimizer": request["optimizer"]}
    for item in nested_values(request):  # nothing is taken from memory: every value must come from disk
        if torch.is_tensor(getattr(item, "data", None)):
            item.data = torch.empty_like(item.data).fill_(float("nan") if item.data.is_floating_point() else -1)
    loaded = dist_checkpointing.load(request, str(directory))
    model_equal = sum(torch.equal(loaded["model"][k], v) for k, v in model_before.items() if k in loaded["model"])
    with torch.no_grad():  # equal state back in, or the count below says so
        optimizer.load_state_dict(loaded["optimizer"])
    optim_after = list(_optimizer_tensors(optimizer))
    optim_equal = sum(torch.equal(a, b) for a, b in zip(optim_before, optim_after))
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"  # NCCL reduces GPU tensors only
    counts = torch.tensor([model_equal, len(model_before), optim_equal, len(optim_before)], dtype=torch.long,
                          device=device)
    dist.all_reduce(counts)
    say(f"check-save {directory.name}: loaded back through megatron-core: model tensors equal "
        f"{counts[0]}/{counts[1]}, optimizer state tensors equal {counts[2]}/{counts[3]} (summed over ranks)")


def _optimizer_tensors(optimizer):
    """Every tensor of the optimizer's state (moments, step; the distributed optimizer's main-param
    shards are its params), in a fixed order."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                yield param
                for key in sorted(inner.state.get(param, {})):
                    value = inner.state[param][key]
                    if torch.is_tensor(value):
                        yield value


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, backend, parallel = setup(args)
    from megatron.core import parallel_state

    world = dist.get_world_size()
    dp = parallel_state.get_data_parallel_world_size()
    save = Path(args.save).resolve()
    hf = json.loads((Path(args.model) / "config.json").read_text())
    arch = Architecture.from_config(hf, str(Path(args.model) / "config.json"))
    if args.aux_loss_coeff is None:
        args.aux_loss_coeff = float(hf.get("router_aux_loss_coef", 1e-3))
    naming = default_naming() if args.naming == "auto" else args.naming
    say(f"model: {arch.describe()}; {'Transformer Engine' if naming == 'te' else 'megatron-core local'} layers")
    if arch.hybrid:
        say(delta_rule_path(training=True).describe())
    if arch.moe and args.tp > 1 and not parallel.sequence_parallel:
        # mcore refuses MoE training with TP but without sequence parallelism (Megatron-LM's args too) ...
        from megatron.core.models.gpt.gpt_layer_specs import HAVE_APEX

        if naming == "local" and not HAVE_APEX:  # ... which the local spec's torch norms do not support
            say("error: MoE with tensor parallelism needs sequence parallelism, which the local spec supports "
                "only with apex's norms (or the te spec): use expert parallelism (--ep) instead of --tp here")
            exit_distributed(2)
        parallel = dataclasses.replace(parallel, sequence_parallel=True)
        say("sequence parallelism: on (MoE with tensor parallelism needs it)")

    if args.distributed_optimizer == "off":
        use_dist_opt, why = False, "off by --distributed-optimizer off"
    else:
        use_dist_opt, why = distributed_optimizer_supported()
    if args.distributed_optimizer == "on" and not use_dist_opt:
        say(f"error: --distributed-optimizer on, but {why}")
        exit_distributed(2)
    say(f"distributed optimizer: {'on' if use_dist_opt else 'off (plain optimizer)'} ({why})")

    module, model, optimizer, scheduler = build(args, arch, parallel, naming, use_dist_opt)
    local = None
    if args.non_persistent_save_interval != 0:  # a number, or None: auto
        jump = args.replication_jump or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        local = LocalCheckpoints(local_checkpoints_root(args.non_persistent_local_ckpt_dir), save, jump,
                                 args.replication_factor if args.replication else 1)
        every = args.non_persistent_save_interval
        say(f"local checkpoints {'auto' if every is None else f'every {every} iteration(s)'}: {local.describe()}")
    try:
        start, source = load_weights(args, arch, naming, module, optimizer, scheduler, use_dist_opt, local)
    except checkpointing.CheckpointMismatch as error:
        say(f"error: {error}")
        exit_distributed(2)

    data_cache = Path(args.data_cache_path or save / "data_cache")
    # Global rank 0 first, as the index caches below: it keeps what the dataset reads of the tokenizer, and the
    # other ranks (where they share the cache) read that rather than import transformers.
    tok = dataset.tokenizer(args.model, data_cache) if dist.get_rank() == 0 else None
    dist.barrier()
    samples = dataset.gpt_dataset(
        args.data_path, seq_len=args.seq_length, num_samples=args.train_iters * args.global_batch_size, seed=args.seed,
        tok=tok if tok is not None else dataset.tokenizer(args.model, data_cache), cache_dir=data_cache,
        explicit_mask=naming == "local" or shims.needed())  # TE's attention builds its causal mask itself
    batches = dataset.Batches(samples, global_batch=args.global_batch_size, micro_batch=args.micro_batch_size,
                           dp_rank=parallel_state.get_data_parallel_rank(), dp_size=dp)
    params = sum(p.numel() for p in module.parameters())  # this rank's: its experts, its TP shards
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    experts = f", {arch.experts} experts top-{arch.topk}" if arch.moe else ""
    dtype = str(module.config.params_dtype).removeprefix("torch.")
    say(f"{arch.family} ({arch.layers} layers, hidden {arch.hidden}{experts}), {naming} spec, {dtype}, "
        f"{params / 1e6:.3f}M parameters on rank 0; "
        f"{world} rank(s) ({backend}, {where}): tp {args.tp} pp {args.pp} cp {args.cp} ep {args.ep} dp {dp}; "
        f"global batch {args.global_batch_size} = micro {args.micro_batch_size} x dp {dp} x {batches.num_microbatches} "
        f"micro-batches, seq {args.seq_length}; {len(samples)} samples; iterations {start + 1}..{args.train_iters} "
        f"(weights: {source})")
    say(f"TensorBoard scalars (lm loss, learning-rate, grad-norm, tokens-per-sec, node-step-time): "
        f"tensorboard --logdir {tensorboard_dir(args)}")
    ckpt_args = checkpointing.megatron_args(
        arch, naming=naming, dtype=module.config.params_dtype, parallel=parallel, world_size=world, dp=dp,
        train_iters=args.train_iters, global_batch=args.global_batch_size, micro_batch=args.micro_batch_size,
        seq_len=args.seq_length, lr=args.lr, min_lr=args.min_lr, warmup_iters=args.lr_warmup_iters,
        decay_style=args.lr_decay_style, iteration=start, use_distributed_optimizer=use_dist_opt,
        data_path=args.data_path, seed=args.seed)

    result = train(args, module=module, model=model, optimizer=optimizer, scheduler=scheduler, batches=batches,
                   start=start, ckpt_args=ckpt_args, local=local)
    if local is not None and not result["noticed"] and result["checkpoint"]:  # the run ended with a persistent one
        local.remove()

    if result["noticed"]:  # stopped on notice: the run is not over, and its record is the rerun's
        exit_distributed(NOTICE_EXIT_CODE)
    devices = [None] * world
    dist.all_gather_object(devices, f"{socket.gethostname()}:{device}")
    if is_last_rank():
        report_loop("megatron", world_size=world, backend=backend, devices=devices, iterations=args.train_iters,
                    start=start, losses=result["losses"], step_times=result["step_times"],
                    tokens_per_step=args.global_batch_size * args.seq_length,
                    checkpoint=result["checkpoint"] or str(checkpoint_dirs.iteration_dir(save, start)),
                    precision=dtype, parallel={"tp": args.tp, "pp": args.pp, "cp": args.cp, "ep": args.ep, "dp": dp},
                    distributed_optimizer=use_dist_opt)
    exit_distributed(0)


if __name__ == "__main__":
    sys.exit(main())
