"""Which tier a ``Checkpointer`` save goes to, with which options, and the memory tier's side of it
(``ray.memory``): whether a memory save goes ahead (``MemoryTier.go``).

Every ``memory_every`` steps a save goes to the nodes' memory; every
``persist_every`` steps to storage, as without a memory tier (a step due for
both goes to both). Memory checkpoints
are named like storage ones, under ``mem/<run>`` on the memory filesystem, and
tracked by the MetadataActor as the run ``<run>@memory``.
"""

from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass, replace

import ray

from ..engine.coordinator import Coordinator, default_coordinator
from ..engine.save import SaveOptions
from ..engine.state import FlatState
from ..ray import metrics
from ..ray.actors import writers
from ..ray.memory.fs import memory_filesystem
from ..ray.rank.options import RayOptions
from ..ray.rank.staging import local_pieces, staged_size
from ..ray.records import MEMORY_TIER, STORAGE_TIER, tracked_run
from ..ray.writer.actor import get_shard_writer
from ..storage.catalog import checkpoint_dir_name

logger = logging.getLogger(__name__)

MEMORY = MEMORY_TIER
STORAGE = STORAGE_TIER


def memory_run(run: str) -> str:
    """The name the MetadataActor tracks ``run``'s memory checkpoints under."""
    return tracked_run(run, MEMORY)


def memory_root(run: str) -> str:
    """Where ``run``'s memory checkpoints are on the memory filesystem."""
    return posixpath.join("mem", run)


@dataclass(frozen=True)
class TierPolicy:
    """``memory_every`` (0: no memory tier), ``persist_every`` and ``memory_keep``, checked."""

    memory_every: int = 0
    persist_every: int = 1
    memory_keep: int = 2

    def __post_init__(self) -> None:
        for name, low in (("memory_every", 0), ("persist_every", 1), ("memory_keep", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Checkpointer({name}={value!r}): expected a whole number >= {low}")

    def tiers(self, step: int, persist: bool | None = None) -> tuple[str, ...]:
        """Where the save of ``step`` goes, memory first: storage when it is due (or ``persist``), memory
        when it is due (or ``persist=False``), both when both are, ``()`` when neither."""
        memory = bool(self.memory_every) and (persist is False or step % self.memory_every == 0)
        storage = bool(persist) or (persist is None and step % self.persist_every == 0)
        return (MEMORY,) * memory + (STORAGE,) * storage


def memory_need(flat: FlatState, local_ranks: int) -> int:
    """What a memory save of ``flat`` needs on this rank's node: its share and a peer's replica of
    about its size, for each rank of the node."""
    return 2 * staged_size(local_pieces(flat)) * max(1, local_ranks)


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveSettings:
    """How a ``Checkpointer``'s saves write and run on Ray, built once from its arguments."""

    write: SaveOptions
    on_ray: RayOptions
    #: Report each storage save to Ray Train once committed.
    report: bool = True

    def for_tier(self, tier: str) -> tuple[SaveOptions, RayOptions]:
        """The records of a save to ``tier``: a memory save is never incremental, its local path
        (the memory filesystem) is every node's, and it has its own lane."""
        if tier != MEMORY:
            return self.write, self.on_ray
        write = replace(self.write, incremental=False, full_every=0)
        return write, replace(self.on_ray, local_is_shared=True, lane=MEMORY)


class MemoryTier:
    """A run's memory checkpoints, as one worker's ``Checkpointer`` sees them."""

    def __init__(self, run: str, policy: TierPolicy) -> None:
        self.run = memory_run(run)
        self.root = memory_root(run)
        self.policy = policy
        self.filesystem = memory_filesystem()
        #: The shortage that sends memory saves to storage (``decide``: the node and what bounds it), "": none.
        self.short = ""

    def path(self, step: int) -> str:
        return posixpath.join(self.root, checkpoint_dir_name(step))

    def room_here(self, rank: int) -> tuple[int, str, str]:
        """Room in this rank's node's memory tier, what bounds it (``MemoryStore.room``) and the node, once the
        run's checkpoints there older than the newest ``memory_keep - 1`` committed ones are dropped
        (``MemoryStore.drop_old``). Rank 0 has every live node drop the same, not waited for: a node with no
        rank holds manifests and replicas too."""
        keep = self.policy.memory_keep - 1
        room, bound = ray.get(get_shard_writer().mem_room.remote(self.root, keep))
        here = ray.get_runtime_context().get_node_id()[:12]
        if rank == 0:
            for node, handle in writers().items():
                if node != here:  # this node's writer has just dropped them
                    handle.mem_room.remote(self.root, keep)
        return room, bound, here

    @staticmethod
    def decide(busy: bool, room: tuple[int, str], need: int, node: str, coord: Coordinator) -> tuple[bool, str, str]:
        """One collective before a memory save: every rank says whether its last memory save is unwritten
        (``busy``), its ``node``'s ``room`` and what bounds it (``MemoryStore.room``) and what it ``need``s
        there (its share and a peer's replica of about its size).

        Returns:
            (skip: some rank is busy; why it does not fit: "" when every node holds it; the shortage itself,
            the node and what bounds it, the same from step to step while it lasts: "" when none).
        """
        answers = coord.all_gather((busy, room[0] >= need, room[0], need, node, room[1]))
        if any(a[0] for a in answers):
            return True, "", ""
        short = [a for a in answers if not a[1]]
        if not short:
            return False, "", ""
        _, _, left, need, node, bound = short[0]
        return False, f"node {node} has {left} bytes {bound} and needs {need}", f"{node} {bound}"

    def tell(self, run: str, step: int, short: str, why: str, rank: int) -> None:
        """Record ``decide``'s shortage for ``step``; rank 0 warns once per shortage (a node and what bounds it),
        not per step, and says when memory saves go ahead again."""
        if short != self.short and rank == 0:
            if short:
                logger.warning(
                    "rayckpt: run %s: step %s goes to storage, not memory: %s (so do the memory saves after it "
                    "until it has room; said once)",
                    run,
                    step,
                    why,
                )
            else:
                logger.info("rayckpt: run %s: step %s goes to memory again: every node has room", run, step)
        self.short = short

    def go(self, step: int, busy: bool, need: int, rank: int, run: str) -> str | None:
        """Whether a memory save goes ahead (``MEMORY``), goes to storage instead (``STORAGE``: some node's
        memory tier has no room for it) or is skipped (``None``: the memory save before it is not yet
        written on some rank, ``busy`` here; a storage save being written does not count). One collective:
        every rank decides the same. ``need``: this rank's bytes there (``memory_need``); ``run``: the
        run's name (its metrics). Rank 0 warns once per shortage (``tell``)."""
        room, bound, node = self.room_here(rank)
        skip, why, short = self.decide(busy, (room, bound), need, node, default_coordinator())
        if skip:
            if rank == 0:
                metrics.send("rayckpt_memory_saves_skipped", 1, run=run, reason="busy")
            return None
        if short and rank == 0:
            metrics.send("rayckpt_memory_saves_skipped", 1, run=run, reason="no_room")
        self.tell(run, step, short, why, rank)
        return STORAGE if short else MEMORY

    def drop_all(self) -> None:
        """Free every memory checkpoint of the run (called once it is persisted and done)."""
        self.filesystem.delete_dir(self.root)
