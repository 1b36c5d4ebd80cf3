"""Local checkpoints: every rank's part of the state in node-local storage (a RAM disk), replicated to ranks on other
nodes, so a fault redoes at most one local interval and a spare that takes a lost node's place gets its parts from
their replicas. Megatron-LM's `--non-persistent-ckpt-type local`, through the library it uses for it: NVRx's
`LocalCheckpointManager` (each rank's part a file `<root>/<session>/iter_NNNNNNN_<rank>_local.pt`, written
`.dirty` then renamed; the newest complete iteration found by gathering which parts every rank holds; older ones
removed once a newer is complete) with its `CliqueReplicationStrategy` (ranks n, n + J, ..., n + (F-1)J hold each
other's parts; J = ranks per node puts each replica on another node), and megatron-core's
`MCoreTensorAwareStateDict` (the same sharded state dict the persistent torch_dist save writes, each rank's own
tensors taken out of it).

On the CPU, NVRx's replication moves tensors through `Tensor.cuda()` and `device="cuda"` buffers: it runs under
`shims.CudaOnCpu`, which keeps them on the CPU (gloo sends CPU tensors). On GPUs it runs as written.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
from pathlib import Path

import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

from a4ray.mcore import shims
from a4ray.observe.stacks import ranges

ALGO = "atomic"  # every rank writes all its tensors, replicated ones too: no exchange at save or load


class NodeCheckpointManager(LocalCheckpointManager):
    """NVRx's manager with one directory per node (`<root>/<session>`), not per rank: a rank's number changes across
    attempts (a spare joins the gang in topology order, a restart may run on a new gang), and the parts a node holds
    must be found by whichever rank runs there now. A node's ranks hold different parts, so their files never
    collide."""

    @property
    def local_ckpt_dir(self) -> Path:
        return Path(self.root_local_ckpt_dir) / self.session_id


def _device_literals():
    return shims.CudaOnCpu() if shims.needed() else contextlib.nullcontext()


class LocalCheckpoints:
    """This rank's local checkpoints of the run whose persistent checkpoints are in `save` (its session)."""

    def __init__(self, root: Path, save: Path, replication_jump: int, replication_factor: int):
        world = dist.get_world_size()
        if replication_factor > 1 and world % (replication_jump * replication_factor):
            raise ValueError(f"--replication-jump {replication_jump} x --replication-factor {replication_factor} must "
                             f"divide the world size {world} (NVRx's CliqueReplicationStrategy)")
        self.replication = (replication_jump, replication_factor) if replication_factor > 1 else None
        strategy = CliqueReplicationStrategy.from_replication_params(replication_jump, replication_factor) \
            if self.replication else None
        self.session = hashlib.sha256(str(Path(save).resolve()).encode()).hexdigest()[:12]
        self.root = Path(root)
        self.manager = NodeCheckpointManager(str(self.root), session_id=self.session, repl_strategy=strategy)
        # A save that died (a rank killed while writing) left its `.dirty` file: the next attempt reaching the same
        # iteration would find it in its way (NVRx creates it exclusively). Nothing of the node writes yet.
        for stale in self.directory.glob("*.dirty.pt"):
            stale.unlink(missing_ok=True)

    @property
    def directory(self) -> Path:
        """This node's directory of the run (its ranks' parts and the replicas they hold)."""
        return Path(self.manager.local_ckpt_dir)

    def describe(self) -> str:
        where = str(self.directory)
        if self.replication is None:
            return f"{where}, not replicated"
        jump, factor = self.replication
        return f"{where}, each rank's part also held by {factor - 1} rank(s) {jump} apart (another node)"

    def save(self, iteration: int, state: dict, saves) -> None:
        """Save `state` (the trainer's sharded state dict) as `iteration` (every rank at once): replicated now, written
        in the background when `saves` (the trainer's `AsyncSaves`) is given."""
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

        aware, _ = MCoreTensorAwareStateDict.from_state_dict(state, algo=ALGO)
        with _device_literals():
            request = self.manager.save(aware, iteration, is_async=saves is not None)
        if request is not None:
            saves.start(request, iteration, kind="local")

    def newest(self) -> int | None:
        """The newest iteration whose every part is held somewhere in the gang (every rank calls it)."""
        with _device_literals():
            newest = self.manager.find_latest()
        return None if newest < 0 else newest

    def load(self, template: dict) -> dict:
        """The state of `newest()` (after it, every rank at once): this rank's part from its own storage, or from a
        rank that holds a replica of it (a spare in a lost node's place)."""
        with _device_literals():
            aware, _ = self.manager.load()
            return aware.to_state_dict(template, algo=ALGO)

    def sources(self) -> str:
        """Where each rank's part of `newest()` comes from, in one line (the same on every rank)."""
        held = self.manager.globally_available_ids  # what each rank holds, as `newest()` gathered it
        iteration = self.manager.latest_iteration
        fetched = {rank: [r for r, ids in enumerate(held) if (iteration, rank, self.session) in ids]
                   for rank in range(len(held)) if (iteration, rank, self.session) not in held[rank]}
        if not fetched:
            return "every rank's part from its own node's storage"
        return "; ".join(f"rank {rank}'s part from the replica on rank(s) {ranges(holders)}"
                         for rank, holders in fetched.items()) + " (their own storage has none); the others' from their own"

    def remove(self) -> None:
        """The node's local checkpoints of the run (it ended with a persistent one); every rank at once."""
        dist.barrier()  # no rank of the node still reads them
        shutil.rmtree(self.directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.root.rmdir()  # a4ray-local-checkpoints itself, once no run of the node has any
