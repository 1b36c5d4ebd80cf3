"""Local checkpoints: every rank's part of the state in node-local storage (a RAM disk), replicated to ranks on other
nodes, so a fault redoes at most one local interval and a spare that takes a lost node's place gets its parts from
their replicas. Megatron-LM's `--non-persistent-ckpt-type local`, through the library it uses for it: NVRx's
`LocalCheckpointManager` (each rank's part a file `<root>/<session>/iter_NNNNNNN_<rank>_local.pt`, written
`.dirty` then renamed; the newest complete iteration found by gathering which parts every rank holds; older ones
removed once a newer is complete) with its `CliqueReplicationStrategy` (ranks n, n + J, ..., n + (F-1)J hold each
other's parts; J = ranks per node puts each replica on another node), and megatron-core's
`MCoreTensorAwareStateDict` (the same sharded state dict the persistent torch_dist save writes, each rank's own
tensors taken out of it).

An async save replicates in the background: NVRx's `save` exchanges the parts before it returns (training blocked
for the whole transfer: 0.41 of a synchronous persistent save in benchmarks/checkpoint.py). Here the rank's forked
writer writes only its own part, and a thread of the rank (`Exchange`) then sends that file to the other ranks of its
clique and writes theirs beside it, over a gloo group of the clique made at the start; the writer ends once those
replicas are in place, so the save's finalization (`find_latest` on every rank) finds them as NVRx's own would be.
Training blocks only for the state's copy. The exchange is a thread, not the writer: a forked child of a rank, whose
other threads may hold glibc's locks at the fork (the resolver's, seen: a writer that connected to the TCPStore hung
in getnameinfo), must not open sockets. A replica counts as held only once renamed into place; a synchronous save
replicates as NVRx does.

On the CPU, NVRx's retrieval (and its synchronous replication) moves tensors through `Tensor.cuda()` and
`device="cuda"` buffers: it runs under `shims.CudaOnCpu`, which keeps them on the CPU (gloo sends CPU tensors). On
GPUs it runs as written.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import parse_group_sequence
from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

from a4ray.mcore import shims
from a4ray.observe.stacks import ranges

ALGO = "atomic"  # every rank writes all its tensors, replicated ones too: no exchange at save or load
CHUNK_BYTES = 64 << 20  # a part's file goes to its replicas this much at a time (bounded memory in the writer)
PERSISTED = "local_iter_{:07d}"  # a local checkpoint kept in the persistent directory at a stop with notice
PERSISTED_GLOB = "local_iter_" + "[0-9]" * 7
REPLICATION_TIMEOUT = datetime.timedelta(minutes=10)  # a clique member that never comes fails the save


class NodeCheckpointManager(LocalCheckpointManager):
    """NVRx's manager with one directory per node (`<root>/<session>`), not per rank: a rank's number changes across
    attempts (a spare joins the gang in topology order, a restart may run on a new gang), and the parts a node holds
    must be found by whichever rank runs there now. A node's ranks hold different parts, so their files never
    collide."""

    def __init__(self, root: str, session_id: str, replication: tuple[int, int] | None):
        """`replication`: (jump, factor) of NVRx's cliques, or None."""
        strategy, self.clique, self.exchange_group = None, None, None
        if replication:
            strategy = CliqueReplicationStrategy.from_replication_params(*replication)  # its groups, every rank at once
            cliques = parse_group_sequence(*replication, dist.get_world_size())
            self.exchange_group, _ = dist.new_subgroups_by_enumeration(cliques, backend="gloo", timeout=REPLICATION_TIMEOUT)
            self.clique = next(ranks for ranks in cliques if dist.get_rank() in ranks)  # this rank's, it among them
        super().__init__(root, session_id=session_id, repl_strategy=strategy)
        self.exchange: Exchange | None = None  # the async save's replication in flight

    @property
    def local_ckpt_dir(self) -> Path:
        return Path(self.root_local_ckpt_dir) / self.session_id

    def _cleanup(self, iteration: int) -> None:
        """NVRx's cleanup of the parts older than `iteration`, by every rank of the node at once: a part another rank
        removed first is gone, not an error."""
        for part in self.local_ckpt_dir.glob(self._filename_from_template("*", "*", "*")):
            if self._filename_to_id(part.name)[0] < iteration:
                part.unlink(missing_ok=True)

    def _cleanup_failed_save(self, iteration: int) -> None:
        for part in self.local_ckpt_dir.glob(self._filename_from_template(iteration, "*", "*")):
            part.unlink(missing_ok=True)

    def save(self, state_dict, iteration: int, is_async: bool = False):
        """NVRx's save; an async one with replication leaves the exchange to `Exchange` (see the module): its writer
        writes this rank's part, then waits for the replicas the exchange writes."""
        if self.exchange is not None:
            self.exchange.join()  # the previous save's (its writer ended once it was done): no thread at the fork
            self.exchange = None
        if not (is_async and self.repl_strategy):
            return super().save(state_dict, iteration, is_async)
        strategy, self.repl_strategy = self.repl_strategy, None  # NVRx's save without its exchange...
        try:
            request = super().save(state_dict, iteration, is_async=True)
        finally:
            self.repl_strategy = strategy  # ...and its finalization's `find_latest` counting replicas again
        self.exchange = Exchange(self, iteration)
        return request._replace(async_fn=functools.partial(_write_then_wait, request.async_fn, self.exchange.kept))


class Exchange(threading.Thread):
    """The replication of one async local save, on a thread of the rank: once the rank's writer has put its part in
    place, send it to the other ranks of the clique and write each of theirs beside it (`.dirty`, then renamed),
    one part at a time from its holder, in chunks; a part of this rank's own node is there already."""

    def __init__(self, manager: NodeCheckpointManager, iteration: int):
        super().__init__(name=f"a4ray-local-replication-{iteration}", daemon=True)
        self.group, self.clique, self.rank = manager.exchange_group, manager.clique, dist.get_rank()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # a node's ranks are consecutive and share its directory
        self.parts = {holder: manager._local_ckpt_path_from_id((iteration, holder, manager.session_id))
                      for holder in self.clique}
        self.kept = [path for holder, path in self.parts.items()
                     if holder != self.rank and holder // per_node != self.rank // per_node]
        for stale in [self.parts[self.rank], *self.kept]:  # an earlier attempt's, of the same iteration
            stale.unlink(missing_ok=True)

    def run(self) -> None:
        if not _appear([self.parts[self.rank]]):  # the writer renames it into place once whole
            return  # the writer failed: its own end fails the save
        root_of = {holder: self.clique.index(holder) for holder in self.clique}
        for holder, part in self.parts.items():
            size = torch.tensor([part.stat().st_size if holder == self.rank else 0], dtype=torch.int64)
            dist.broadcast(size, group_src=root_of[holder], group=self.group)
            keep = part in self.kept
            with contextlib.ExitStack() as files:
                source = files.enter_context(open(part, "rb")) if holder == self.rank else None
                target = files.enter_context(open(part.with_suffix(".dirty.pt"), "wb")) if keep else None
                for start in range(0, int(size), CHUNK_BYTES):
                    chunk = torch.empty(min(CHUNK_BYTES, int(size) - start), dtype=torch.uint8)
                    if source:
                        source.readinto(memoryview(chunk.numpy()))
                    dist.broadcast(chunk, group_src=root_of[holder], group=self.group)
                    if target:
                        target.write(memoryview(chunk.numpy()))
            if keep:
                part.with_suffix(".dirty.pt").rename(part)


def _write_then_wait(write, replicas: list[Path], id_to_state_dict: dict) -> None:
    """The forked writer of an async replicated save: NVRx's write of this rank's part, then the wait for the
    replicas its rank's `Exchange` writes (the writer's end is what the save's finalization waits for)."""
    write(id_to_state_dict)
    if not _appear(replicas):
        raise TimeoutError(f"replicas {', '.join(p.name for p in replicas if not p.exists())} did not come within "
                           f"{REPLICATION_TIMEOUT}")


def _appear(paths: list[Path]) -> bool:
    """Wait up to REPLICATION_TIMEOUT for every one of `paths` to exist; whether they all do."""
    deadline = time.monotonic() + REPLICATION_TIMEOUT.total_seconds()
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


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
        self.persistent_dir = Path(save).resolve()
        self.session = hashlib.sha256(str(self.persistent_dir).encode()).hexdigest()[:12]
        self.root = Path(root)
        self.manager = NodeCheckpointManager(str(self.root), self.session, self.replication)
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
            if self.manager.exchange is not None:
                self.manager.exchange.start()  # after the writer's fork

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

    def part(self, iteration: int) -> Path:
        """This rank's own part of `iteration`, in its node's storage."""
        return self.manager._local_ckpt_path_from_id((iteration, dist.get_rank(), self.session))

    def persist(self, iteration: int) -> Path:
        """Copy every rank's own part of `iteration` (complete: `newest()`) into the run's persistent checkpoint
        directory, `local_iter_NNNNNNN/` (whole or not there: written as a dot-directory, renamed by rank 0 once
        every rank's copy is in); every rank at once. A stop with notice whose full save would not fit its grace
        period keeps this instead."""
        rank, final = dist.get_rank(), self.persistent_dir / PERSISTED.format(iteration)
        tmp = final.with_name(f".{final.name}.tmp")
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        shutil.copyfile(self.part(iteration), tmp / self.part(iteration).name)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        dist.barrier()
        return final

    def adopt_persisted(self, newer_than: int | None) -> int | None:
        """Where the persistent checkpoint directory holds a persisted local checkpoint (`persist`) newer than
        `newer_than` (the newest persistent one), copy this rank's part of it into its node's storage, where
        `newest()` and `load()` find it on whichever nodes the run has now; returns its iteration."""
        found = sorted(self.persistent_dir.glob(PERSISTED_GLOB))
        if not found:
            return None
        iteration = int(found[-1].name.rsplit("_", 1)[1])
        if newer_than is not None and iteration <= newer_than:
            return None
        own = self.part(iteration)
        if not own.exists():
            self.directory.mkdir(parents=True, exist_ok=True)
            staged = own.with_name(own.name + ".adopting")  # not a part until whole
            shutil.copyfile(found[-1] / own.name, staged)
            staged.rename(own)
        return iteration

    def remove(self) -> None:
        """The node's local checkpoints of the run (it ended with a persistent one), and any persisted at a stop
        with notice; every rank at once."""
        dist.barrier()  # no rank of the node still reads them
        shutil.rmtree(self.directory, ignore_errors=True)
        if dist.get_rank() == 0:
            for persisted in self.persistent_dir.glob(PERSISTED_GLOB):
                shutil.rmtree(persisted, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.root.rmdir()  # a4ray-local-checkpoints itself, once no run of the node has any
