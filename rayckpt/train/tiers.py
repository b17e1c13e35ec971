"""Which tier a ``Checkpointer`` save goes to, and the memory tier's side of it (``ray.memory_tier``).

Every ``memory_every`` steps a save goes to the nodes' memory; every
``persist_every`` steps to storage, as without a memory tier (a step due for
both goes to both). Memory checkpoints
are named like storage ones, under ``mem/<run>`` on the memory filesystem, and
tracked by the MetadataActor as the run ``<run>@memory``.
"""

from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass
from typing import Any

import ray

from ..engine.coordinator import Coordinator
from ..ray.async_save import local_pieces
from ..ray.memory_fs import memory_filesystem
from ..ray.shard_writer import get_shard_writer
from ..ray.staging import staged_size
from ..storage.catalog import checkpoint_dir_name, checkpoint_step
from ..storage.checkpoint_dir import CheckpointDir

logger = logging.getLogger(__name__)

MEMORY = "memory"
STORAGE = "storage"


def memory_run(run: str) -> str:
    """The name the MetadataActor tracks ``run``'s memory checkpoints under."""
    return f"{run}@memory"


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


class MemoryTier:
    """A run's memory checkpoints, as one worker's ``Checkpointer`` sees them."""

    def __init__(self, run: str, policy: TierPolicy) -> None:
        self.run = memory_run(run)
        self.root = memory_root(run)
        self.policy = policy
        self.filesystem = memory_filesystem()

    def path(self, step: int) -> str:
        return posixpath.join(self.root, checkpoint_dir_name(step))

    def make_room(self, rank: int, coord: Coordinator) -> None:
        """Rank 0 drops all but the newest ``memory_keep - 1`` of the run's memory checkpoints (collective)."""
        if rank == 0:
            run_dir = CheckpointDir(self.filesystem, self.root, self.root)
            names = sorted(run_dir.list_dirs(), key=lambda n: checkpoint_step(n) or -1)
            for name in names[: max(0, len(names) - (self.policy.memory_keep - 1))]:
                self.filesystem.delete_dir(posixpath.join(self.root, name))
        coord.all_gather(None)  # no rank measures its node's room before the drop

    def fits(self, state: dict[str, Any], local_ranks: int, coord: Coordinator) -> tuple[bool, str]:
        """Whether every node's memory tier can hold this save (each rank's share and a peer's replica of
        about its size), asked of each rank's node (collective); and, if not, why (for the WARNING)."""
        need = 2 * staged_size(local_pieces(state)) * max(1, local_ranks)
        room = ray.get(get_shard_writer().mem_room.remote())
        answers = coord.all_gather((room >= need, room, need, ray.get_runtime_context().get_node_id()[:12]))
        short = [a for a in answers if not a[0]]
        if not short:
            return True, ""
        _, room, need, node = short[0]
        return False, f"node {node} has {room} bytes of its memory budget left and needs {need}"

    def drop_all(self) -> None:
        """Free every memory checkpoint of the run (called once it is persisted and done)."""
        self.filesystem.delete_dir(self.root)
