"""megatron-core (0.16) on a CPU-only torch, without Transformer Engine or apex: every patch a4ray makes.

megatron-core is written for CUDA: even with every tensor on the CPU, some code paths reach for CUDA.
`apply()` answers each of them, and does nothing where CUDA is available. Every patch a4ray makes to
megatron-core lives here; each has its reason next to it:

* `torch.cuda.current_device()` answers "cpu": RoPE, the attention scratch buffer, the MoE router,
  DDP's gradient buffers and the distributed optimizer's buffers allocate on it.
* `torch.cuda.synchronize()` does nothing: dist_checkpointing's torch_dist writer synchronises the
  device before it copies tensors out (a CPU-only torch raises there).
* `moe_utils.te_general_gemm = None`: mcore 0.16 names it in the router's forward without importing it
  when Transformer Engine is absent (NameError).
* `torch.compile` off: megatron-core wraps its small fused functions (`megatron.core.jit.jit_fuser`: the gated
  DeltaNet's gated norm, SwiGLU, ...) in `torch.compile`. On the CPU inductor then builds C++ kernels in every
  process at the first forward: 14 s of the rehearsal's first iteration per rank (of 0.2 s for a later one), and
  again in the conversion's verifier. Uncompiled, the same functions run eagerly: the same math. `torch.compile`
  returns the function itself (`_eager_compile`) from before megatron-core is imported: its decorators then do
  not import dynamo and inductor either (1 s of CPU in every process that imports megatron-core: 1.8 -> 0.8 s),
  and `torch._dynamo.config.disable` covers a module imported before. On GPUs they stay compiled, as
  megatron-core means them.
* RNG tracker: dropout and expert init fork the CUDA RNG state (`get_cuda_rng_tracker().fork()`); on the
  CPU the fork does nothing (the tracker still records the seeds it was given, so a checkpoint carries
  non-empty `rng_tracker_states`, which Megatron-LM's loader insists on).
* `device="cuda"` literals: the schedules (token count; also mcore's default causal mask, built during
  the forward), the grad norm and clipping buffers, the FP32 optimizer's loss scale and the mixed-precision
  / distributed optimizer's overflow buffer are created on "cuda" by name, and clipping and the
  distributed optimizer check `tensor.type()` for `torch.cuda.*Tensor`: those entry points
  (`_CUDA_LITERALS`) run under `CudaOnCpu`, a torch-function mode that puts them on the CPU and answers
  `type()` with the CUDA name. It costs ~1.5 ms per micro-batch of the tiny model's forward/backward
  (Python dispatch; 6.4 -> 8 ms), nothing that grows with the model.

Without Transformer Engine or apex, mcore's optimizers run torch's AdamW, whose per-parameter state
holds a `step` tensor; mcore 0.16's distributed optimizer mishandles it (`_fix_torch_adam_steps`, applied
wherever neither TE nor apex is installed, i.e. on the CPU):

* `DistributedOptimizer.load_state_dict` restores the step from the checkpoint's param groups into one
  tensor shared by every parameter (torch's AdamW then increments it once per parameter per step), and
  then overwrites it with the step the optimizer held when the load request was built (dp_reshardable
  keeps 'step' as a LocalNonpersistentObject): a resumed run restarted Adam's bias correction at step 0.
  After the load every parameter gets its own step tensor with the checkpoint's value.
* `DistributedOptimizer.state_dict()` asserts that the state holds exactly one step value, but torch's
  AdamW creates its state at the first step: a checkpoint cannot be loaded into a fresh optimizer.
  Before such a state_dict, the state is created as a fresh AdamW would (zero moments, step 0).

Wherever it runs (`_sync_save_results`): a4ray's trainer saves checkpoints synchronously, so the torch_dist
writer's results are put and taken in the rank's own process. megatron-core's default carrier is a queue of a
multiprocessing Manager started with "spawn" at the first save (its async saves hand results across processes):
a fresh interpreter per rank that imports the trainer again, 1.5-4 s of the first save on the CPU (0.2-0.4 s for
a later one), and one more descendant of the rank. A plain `queue.Queue` carries them instead.

Where FLA (flash-linear-attention) cannot run, on CPUs or on a GPU without it, Qwen3-Next's
`GatedDeltaNet` runs megatron-core's own torch reference of the gated delta rule (`deterministic_mode`:
`torch_chunk_gated_delta_rule` and a plain conv1d; `a4ray.mcore.hybrid.delta_rule_path`), yet still takes
two things from FLA (`_without_fla`, applied wherever FLA is not installed or no GPU is visible):

* where FLA is installed but no GPU is visible (the conversion's verifier on a GPU node runs with CUDA
  hidden), FLA imports and then fails at its first Triton kernel ("0 active drivers"), and transformers'
  Qwen3-Next would call it too: FLA is hidden from imports (`sys.modules["fla"] = None`) before either
  imports it, so both take their torch paths;

* its constructor refuses to build without FLA (`HAVE_FLA`), though the reference path needs none of it;
* `l2norm` of the queries and keys, imported from `fla.modules.l2norm`: answered with the same function in
  torch (x / sqrt(sum(x^2) + 1e-6) in fp32, FLA's definition and transformers' torch fallback for Qwen3-Next).

What the model must be told rather than patched (`model_overrides()`): the allgather MoE token dispatcher
(alltoall creates a CUDA stream), no fused kernels, CPU initialisation, fp32. What the caller must pass:
an explicit causal mask (`causal_mask`, or the dataset's own attention mask); mcore's default mask is
built on "cuda".
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys

import torch
from torch.overrides import TorchFunctionMode

_applied = False


def needed() -> bool:
    return not torch.cuda.is_available()


# ------------------------------------------------------------------------------------- the shims


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaOnCpu(TorchFunctionMode):
    """Runs code that names "cuda" on the CPU: factory functions' `device=`, `Tensor.cuda()`,
    `Tensor.to("cuda")`; `Tensor.type()` answers with the CUDA type name (mcore asserts it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def on_cpu(fn):
    """`fn` run under `CudaOnCpu`."""
    if getattr(fn, "_a4ray_on_cpu", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with CudaOnCpu():
            return fn(*args, **kwargs)

    wrapper._a4ray_on_cpu = True
    return wrapper


# (module, attribute) run under CudaOnCpu, and why. A function is patched in every module that
# imported it by name, so each binding is listed.
_CUDA_LITERALS = [
    # total_num_tokens = torch.zeros([], device="cuda") in every schedule
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining"),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_without_interleaving"),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_with_interleaving"),
    # the grad-norm buffers (and the local multi-tensor l2-norm it calls), torch.zeros(1, device='cuda')
    ("megatron.core.optimizer.optimizer", "get_grad_norm_fp32"),
    # clipping: the same buffers, and assert grad.type() == 'torch.cuda.FloatTensor'
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
    # the FP32 optimizer's constant loss scale, torch.tensor([1.0], device='cuda')
    ("megatron.core.optimizer.optimizer.FP32Optimizer", "__init__"),
    # the mixed-precision optimizers' found_inf / overflow buffers
    ("megatron.core.optimizer.optimizer.MixedPrecisionOptimizer", "__init__"),
    # the distributed optimizer accepts only params whose type() is torch.cuda.*Tensor
    ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer", "_build_model_and_main_param_groups"),
]


class CpuRNGStatesTracker:
    """A stand-in for mcore's CUDA RNG tracker: records the seeds it is given (as CPU generator states),
    and forks nothing."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_, self.seeds_ = {}, set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name, seed):
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    def fork(self, name=None):
        return contextlib.nullcontext()


def _fix_torch_adam_steps() -> None:
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    cls = distrib_optimizer.DistributedOptimizer
    if getattr(cls.load_state_dict, "_a4ray_fixed", False):
        return
    load_state_dict, state_dict = cls.load_state_dict, cls.state_dict

    @functools.wraps(load_state_dict)
    def load_with_own_steps(self, sd):
        steps = {g["step"] for g in sd.get("optimizer", {}).get("param_groups", []) if g.get("step") is not None}
        load_state_dict(self, sd)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = (torch.tensor(float(next(iter(steps))), dtype=torch.float32) if len(steps) == 1
                                 else state["step"].clone())

    @functools.wraps(state_dict)
    def state_dict_of_fresh(self):
        if not self.optimizer.state and self.init_state_fn is not None:
            self.init_state_fn(self.optimizer, self.config)
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    self.optimizer.state[param]["step"] = torch.tensor(0.0)
        return state_dict(self)

    load_with_own_steps._a4ray_fixed = True
    cls.load_state_dict, cls.state_dict = load_with_own_steps, state_dict_of_fresh


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """FLA's `l2norm` in torch: x / sqrt(sum(x^2) + eps), computed in fp32."""
    y = x.float()
    return (y * torch.rsqrt((y * y).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def _without_fla() -> None:
    gpu = torch.cuda.is_available()
    if gpu and importlib.util.find_spec("fla") is not None:
        return
    if not gpu and "fla" not in sys.modules:
        sys.modules["fla"] = None  # FLA's kernels are Triton GPU kernels: hidden where no GPU is visible
    # Where GatedDeltaNet reads them: mcore 0.16's module ssm/gated_delta_net.py, 0.19's package's common.py.
    try:
        owner = importlib.import_module("megatron.core.ssm.gated_delta_net.common")
    except ImportError:
        owner = importlib.import_module("megatron.core.ssm.gated_delta_net")
    owner.HAVE_FLA = True  # the reference path (deterministic_mode) uses nothing else of FLA's
    owner.l2norm = l2norm


def _sync_save_results() -> None:
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _resolve(path: str):
    module, _, attr = path.rpartition(".")
    try:
        return importlib.import_module(path)
    except ImportError:
        return getattr(importlib.import_module(module), attr)


def _eager_compile(model=None, **options):
    """`torch.compile` where nothing is compiled: the function itself, as a decorator with or without options."""
    return model if model is not None else (lambda fn: fn)


def apply() -> bool:
    """Patch megatron-core for the CPU (once per process); False where CUDA is available."""
    global _applied
    if needed():
        torch.compile = _eager_compile  # first: megatron-core's imports below decorate with it
    _fix_torch_adam_steps()
    _sync_save_results()
    _without_fla()
    if not needed():
        return False
    if _applied:
        return True
    import warnings

    # megatron-core warns at import that TE and apex are missing, which is what this module is for.
    warnings.filterwarnings("ignore", module=r"megatron\.")
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None  # dist_checkpointing's writer syncs before copying
    if "torch._dynamo" in sys.modules:  # something compiled before apply(): it runs eagerly too
        sys.modules["torch._dynamo"].config.disable = True

    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    for path, attr in _CUDA_LITERALS:
        owner = _resolve(path)
        raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        if isinstance(raw, (classmethod, staticmethod)):
            setattr(owner, attr, type(raw)(on_cpu(raw.__func__)))
        else:
            setattr(owner, attr, on_cpu(raw))
    _applied = True
    return True


# ----------------------------------------------------------------------- what callers must do


def model_overrides() -> dict:
    """TransformerConfig settings a CPU run needs (empty where CUDA is available); its fp32 is the model
    builder's choice of dtype."""
    if not needed():
        return {}
    return dict(
        use_cpu_initialization=True,
        # fused kernels are CUDA (or TE / apex) kernels
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False,
        moe_permute_fusion=False,
    )


def moe_dispatcher() -> str:
    """alltoall creates a CUDA stream; allgather works on gloo."""
    return "allgather" if needed() else "alltoall"


def causal_mask(seq_len: int) -> torch.Tensor:
    """mcore's attention mask convention: True where attention is not allowed."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), diagonal=1)
