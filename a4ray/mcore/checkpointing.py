"""Checkpoints in Megatron-LM's own layout and format (torch_dist, through megatron.core.dist_checkpointing),
so Megatron-LM's `load_checkpoint` and a4ray read each other's:

    <save>/latest_checkpointed_iteration.txt   "20": the newest complete iteration, written last
    <save>/iter_0000020/metadata.json          torch_dist backend marker (mcore writes it last)
    <save>/iter_0000020/common.pt              args, checkpoint_version 3.0, iteration, opt_param_scheduler,
                                               num_floating_point_operations_so_far, content_metadata
    <save>/iter_0000020/.metadata, __*_*.distcp   model, optimizer and rng_state (DCP, every rank writes)

The state dict is the one Megatron-LM's `generate_state_dict` builds for torch_dist: 'args',
'checkpoint_version', 'iteration', 'model' (the model's sharded state dict), 'optimizer' (the optimizer's,
sharded against the model's), 'opt_param_scheduler', 'rng_state' (a ShardedObject per (pp, tp[, dp])
rank), 'num_floating_point_operations_so_far'; content metadata as Megatron-LM's
`_build_sharded_state_dict_metadata`.

An iteration is saved into `<save>/.iter_NNNNNNN.tmp` and renamed into place once every rank has written
its part, then the tracker names it: a crash mid-save leaves the previous checkpoint the latest, and no
half-written `iter_*` directory.

Async saves (`AsyncSaves`, Megatron-LM's --async-save): megatron-core copies each rank's tensors out (training
blocks for that copy only) and a forked writer per rank writes them; once every rank's writer has ended, the
finalization (DCP's .metadata, mcore's metadata.json, then the rename and the tracker, last) runs on every rank at
a later iteration. A save still in flight when its rank dies leaves only its `.iter_*.tmp`: never the newest.

Loading: `checkpoint_dirs.newest_complete(save)` (the trainer's own checkpoints: model, optimizer, scheduler, iteration,
RNG) wins over `initial` (a converted checkpoint, e.g. the native converter's `release`: model weights
only, tensors checked against the model first by `check_shapes`).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from a4ray.mcore.architecture import Architecture, Naming
from a4ray.mcore.checkpoint_dirs import iteration_dir
from a4ray.mcore.names import CHECKPOINT_VERSION, TRACKER, sharded_renames


class CheckpointMismatch(ValueError):
    """A checkpoint's tensors do not fit the model the config describes."""


# ---------------------------------------------------------------------------------- state dicts


def _content_metadata(use_distributed_optimizer: bool) -> dict:
    """Megatron-LM's `_build_sharded_state_dict_metadata` for torch_dist."""
    from megatron.core import parallel_state

    metadata = {}
    if use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return metadata


def _rng_state():
    """Megatron-LM's `get_rng_state` for torch_dist: a ShardedObject of this rank's RNG states."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = [{
        "random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        # no CUDA generator on a CPU-only torch (Megatron-LM resumes such a checkpoint with --no-load-rng)
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }]
    pp, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    pp_size, tp_size = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    if ps.get_expert_model_parallel_world_size() > 1:
        dp, dp_size = ps.get_data_parallel_rank(with_context_parallel=True), \
            ps.get_data_parallel_world_size(with_context_parallel=True)
        return ShardedObject("rng_state", state, (pp_size, tp_size, dp_size), (pp, tp, dp), replica_id=0)
    return ShardedObject("rng_state", state, (pp_size, tp_size), (pp, tp),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _set_rng_state(states) -> None:
    from megatron.core import tensor_parallel

    state = states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    saved_on_gpu = state.get("cuda_rng_state") is not None
    if saved_on_gpu != torch.cuda.is_available():
        # The model-parallel RNG tracker's states are CUDA generator states on GPUs and CPU ones on the CPU: a
        # checkpoint of the other kind starts them afresh from the seed (Megatron-LM's --no-load-rng).
        print(f"a4ray.mcore: RNG tracker states saved on {'a GPU' if saved_on_gpu else 'the CPU'} are not "
              "restored here; seeded afresh", flush=True)
        return
    if saved_on_gpu:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if state.get("rng_tracker_states"):
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def state_dict(model, optimizer, scheduler, *, args: argparse.Namespace | None, iteration: int | None,
               use_distributed_optimizer: bool, is_loading: bool = False) -> dict:
    """Megatron-LM's `generate_state_dict` (torch_dist) for one model chunk. `model` is unwrapped (the
    GPTModel, not DDP / Float16Module)."""
    metadata = _content_metadata(use_distributed_optimizer)
    sd = {"args": args, "checkpoint_version": CHECKPOINT_VERSION}
    if iteration is not None:
        sd["iteration"] = iteration
    sd["model"] = model.sharded_state_dict(metadata=metadata)
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=metadata)
    if scheduler is not None:
        sd["opt_param_scheduler"] = scheduler.state_dict()
    sd["rng_state"] = _rng_state()
    sd["num_floating_point_operations_so_far"] = 0
    return sd


# ------------------------------------------------------------------------------------------ save


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class AsyncSaves:
    """Async persistent saves through megatron-core's `AsyncCallsQueue`: one forked writer per rank and save. Its
    writers hand their results back through a Manager's queue (mcore's own carrier), started here by fork rather
    than at the first save by spawn (a fresh interpreter that imports the trainer again: seconds of the first
    save's blocking time on the CPU)."""

    def __init__(self) -> None:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.calls = AsyncCallsQueue(persistent=False)
        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()
        self.in_flight: dict[int, tuple[int, float, str]] = {}  # call -> (iteration, its writers' start, kind)

    def start(self, request, iteration: int, kind: str = "persistent") -> None:
        self.in_flight[self.calls.schedule_async_request(request)] = (iteration, time.perf_counter(), kind)

    def finish(self, blocking: bool) -> list[tuple[int, float, str]]:
        """Finalize the saves whose writers have ended on every rank (all of them, waiting, if `blocking`); every
        rank calls it at the same point. Returns (iteration, seconds from its writers' start, kind: persistent or
        local) of each finalized."""
        if not self.in_flight:
            return []
        done = []
        for call in self.calls.maybe_finalize_async_calls(blocking=blocking):
            iteration, started, kind = self.in_flight.pop(call)
            done.append((iteration, time.perf_counter() - started, kind))
        return done


def save(save_dir: Path, iteration: int, model, optimizer, scheduler, args: argparse.Namespace,
         use_distributed_optimizer: bool, keep: int = 0, saves: AsyncSaves | None = None) -> Path:
    """Save `iteration` (every rank calls it); returns the iteration directory. `keep` > 0: only the newest `keep`
    iterations stay. With `saves`, the save is async: this returns once the state is copied out, and the directory
    is complete (and the tracker names it) only once `saves.finish` has finalized it."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    save_dir = Path(save_dir)
    final = iteration_dir(save_dir, iteration)
    tmp = save_dir / f".{final.name}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that died
        tmp.mkdir()
    dist.barrier()
    sd = state_dict(model, optimizer, scheduler, args=args, iteration=iteration,
                    use_distributed_optimizer=use_distributed_optimizer)
    content = _clean_metadata_for_serialization(_content_metadata(use_distributed_optimizer))

    def publish() -> None:  # every rank's part is durable: the directory goes into place, then the tracker names it
        if rank == 0:
            if final.exists():  # an iteration saved before, by a run that went back to an older checkpoint
                shutil.rmtree(final)
            os.replace(tmp, final)
            _atomic_write(save_dir / TRACKER, str(iteration))
            if keep > 0:
                kept = sorted(save_dir.glob("iter_*"), key=lambda p: p.name)
                for old in kept[:-keep]:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    if saves is None:
        dist_checkpointing.save(sd, str(tmp), content_metadata=content)  # ends with a barrier
        publish()
    else:
        request = dist_checkpointing.save(sd, str(tmp), content_metadata=content, async_sharded_save=True)
        request.add_finalize_fn(publish)
        saves.start(request, iteration)
    return final


# ------------------------------------------------------------------------------------------ load


def checkpoint_naming(directory: Path) -> str | None:
    """The parameter naming a checkpoint was written in ("te" / "local"), from its args
    (`transformer_impl`, which a4ray's converter and Megatron-LM record); None if it does not say."""
    from megatron.core import dist_checkpointing

    args = dist_checkpointing.load_common_state_dict(str(directory)).get("args")
    return {"transformer_engine": "te", "local": "local"}.get(getattr(args, "transformer_impl", None))


def _model_request(model, rename: dict[str, str]) -> dict:
    """The model's sharded state dict, its keys named as the checkpoint names them."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    request = model.sharded_state_dict(metadata=_content_metadata(False))
    for item in nested_values(request):
        if hasattr(item, "key"):
            item.key = rename.get(item.key, item.key)
    return request


def check_shapes(model, directory: Path, rename: dict[str, str] | None = None) -> None:
    """Refuse a checkpoint whose tensors do not fit `model`: every tensor the model asks for must be in
    the checkpoint with the model's global shape. The error names each tensor and both shapes."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    stored = dist_checkpointing.load_tensors_metadata(str(directory))
    request = _model_request(model, rename or {})
    apply_factories(request)  # e.g. SwiGLU's fc1 is a factory of two ShardedTensors
    problems, seen = [], set()
    for item in nested_values(request):
        if not isinstance(item, ShardedTensor) or item.key in seen:
            continue
        seen.add(item.key)
        theirs = stored.get(item.key)
        if theirs is None:
            problems.append(f"{item.key}: not in the checkpoint (model shape {tuple(item.global_shape)})")
        elif tuple(theirs.global_shape) != tuple(item.global_shape):
            problems.append(f"{item.key}: checkpoint shape {tuple(theirs.global_shape)}, "
                            f"model shape {tuple(item.global_shape)}")
    if problems:
        raise CheckpointMismatch(f"{directory} does not fit the model the config describes: "
                                 + "; ".join(problems))


def load_weights(model, directory: Path, arch: Architecture, naming: Naming) -> Naming | None:
    """Model weights only (a converted checkpoint: no optimizer, no RNG state), after `check_shapes`;
    returns the checkpoint's naming (None: not recorded). A checkpoint of the other naming than the model's
    (the converter's "te" for a local-spec model, or the reverse) loads too: its keys are mapped by
    `a4ray.mcore.names`."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    theirs = checkpoint_naming(directory)
    rename = sharded_renames(arch, naming, theirs) if theirs else {}
    check_shapes(model, directory, rename)
    loaded = dist_checkpointing.load({"model": _model_request(model, rename)}, str(directory),
                                     strict=StrictHandling.RAISE_UNEXPECTED)
    model.load_state_dict(loaded["model"])
    return theirs


def load_resume(directory: Path, model, optimizer, scheduler, use_distributed_optimizer: bool) -> dict:
    """Model, optimizer, scheduler and RNG state of one of the trainer's own checkpoints; returns the
    loaded common state ('iteration', 'args', ...)."""
    from megatron.core import dist_checkpointing

    check_shapes(model, directory)
    sd = state_dict(model, optimizer, scheduler, args=None, iteration=None,
                    use_distributed_optimizer=use_distributed_optimizer, is_loading=True)
    sd.pop("args")
    return apply_loaded(dist_checkpointing.load(sd, str(directory)), model, optimizer, scheduler)


def apply_loaded(loaded: dict, model, optimizer, scheduler) -> dict:
    """Put a loaded state (a persistent checkpoint's, or a local one's) into the model, optimizer, scheduler and
    RNG; returns it."""
    model.load_state_dict(loaded["model"])
    with torch.no_grad():  # fp32 + distributed optimizer: its main params are views of the model's params
        optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    _set_rng_state(loaded["rng_state"])
    return loaded


# ------------------------------------------------------------------------------------------- args


def model_args(arch: Architecture, dtype: torch.dtype, naming: Naming, fmt: str) -> argparse.Namespace:
    """The `args` Megatron-LM keeps in a checkpoint, as its own argument parser would name them for this
    model: `check_checkpoint_args` compares num_layers / hidden_size / num_attention_heads with the
    trainer's, and `load_checkpoint` reads the parallel sizes to decide what to restore. Plain values only,
    so `torch.load(weights_only=True)` with mcore's safe globals reads it. Qwen3-Next adds the
    TransformerConfig fields its hybrid GPTModel is built from (Megatron-LM's argument names)."""
    hybrid = dict(arch.hybrid_settings(), apply_layernorm_1p=True, rotary_percent=arch.rotary_fraction) \
        if arch.hybrid else {}
    return argparse.Namespace(**hybrid,
        num_layers=arch.layers, hidden_size=arch.hidden, ffn_hidden_size=arch.ffn or arch.moe_ffn,
        num_attention_heads=arch.heads, num_query_groups=arch.groups, group_query_attention=arch.groups != arch.heads,
        kv_channels=arch.head_dim, max_position_embeddings=arch.max_positions, padded_vocab_size=arch.vocab,
        position_embedding_type="rope", add_position_embedding=True, rotary_base=int(arch.rope_theta),
        normalization="RMSNorm", norm_epsilon=arch.norm_eps, swiglu=True, qk_layernorm=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=not arch.tied,
        num_experts=arch.experts or None, moe_ffn_hidden_size=arch.moe_ffn or None,
        moe_router_topk=arch.topk or None, moe_grouped_gemm=bool(arch.moe and naming == "te"),
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
        world_size=1, data_parallel_size=1, ckpt_format="torch_dist" if fmt == "torch_dist" else "torch",
        transformer_impl="transformer_engine" if naming == "te" else "local",
        iteration=0, consumed_train_samples=0, consumed_valid_samples=0, no_save_optim=True, no_save_rng=True,
    )



def megatron_args(arch, *, naming: str, dtype: torch.dtype, parallel, world_size: int, dp: int,
                  train_iters: int, global_batch: int, micro_batch: int, seq_len: int, lr: float, min_lr: float,
                  warmup_iters: int, decay_style: str, iteration: int, use_distributed_optimizer: bool,
                  data_path: str, seed: int) -> argparse.Namespace:
    """The `args` Megatron-LM keeps in a checkpoint (its own argument names; plain values only, so
    `torch.load(weights_only=True)` with mcore's safe globals reads common.pt): the model's, as the native
    converter writes them, plus the run's parallelism and schedule."""
    args = model_args(arch, dtype, naming, "torch_dist")
    args.__dict__.update(
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp, expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp or parallel.tp, sequence_parallel=parallel.sequence_parallel,
        world_size=world_size, data_parallel_size=dp, use_dist_ckpt=True, ckpt_format="torch_dist",
        use_distributed_optimizer=use_distributed_optimizer, no_save_optim=False, no_save_rng=False,
        train_iters=train_iters, global_batch_size=global_batch, micro_batch_size=micro_batch,
        seq_length=seq_len, lr=lr, min_lr=min_lr, lr_warmup_iters=warmup_iters, lr_decay_style=decay_style,
        iteration=iteration, consumed_train_samples=iteration * global_batch, skipped_train_samples=0,
        consumed_valid_samples=0, data_path=[data_path], seed=seed,
        moe_router_load_balancing_type="aux_loss" if arch.moe else None,
    )
    return args
