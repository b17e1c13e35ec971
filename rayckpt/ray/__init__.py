"""rayckpt on Ray: async saves through shared memory, a ShardWriter per node, the MetadataActor, the memory tier.

The package is laid out by the process a line runs in:

- ``rank/``: the training rank's side: ``save_async``, ``SaveHandle``, the rank's reusable
  shared-memory buffer, the copy into it, and ``load``;
- ``metadata/``: the MetadataActor (one per namespace) and the Ray-free parts it calls;
- ``writer/``: the node's ShardWriter, which writes the ranks' staged shares;
- ``memory/``: the memory tier the ShardWriters hold, its replication to a peer node, and
  ``memory.fs`` (``memory_filesystem``: the tier as a filesystem, for any process);
- ``status/``: what ``rayckpt status`` shows: the snapshots the actors publish and their reader;
- shared by all of them: ``actors`` (names and lookups), ``records`` (``SaveTarget``),
  ``shm`` (the node's staging directory, ``StagedRegion``), ``metrics``, ``joining`` (the cluster
  a driver joins).

The public names below are importable from ``rayckpt.ray``; each is imported on
first use. May import ``engine`` and everything below it, and ``ray``; never
``train`` or ``tools``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import exports

if TYPE_CHECKING:  # what static tools (type checkers, the API docs) see; at run time each is imported on first use
    from ..engine.overlap import guard_optimizer
    from .memory.fs import memory_filesystem
    from .memory.store import MemoryBudgetExceeded, peer_bytes
    from .metadata.actor import MetadataActor, get_metadata_actor
    from .rank.async_save import prepare_staging, release_staging, save_async, wait_inflight
    from .rank.loading import load
    from .rank.save_handle import SaveHandle
    from .rank.staging import StagingBuffer, StagingUnavailable
    from .records import SaveTarget
    from .writer.actor import get_shard_writer

#: Public name -> the module that defines it.
_EXPORTS = {
    "save_async": "rayckpt.ray.rank.async_save",
    "prepare_staging": "rayckpt.ray.rank.async_save",
    "release_staging": "rayckpt.ray.rank.async_save",
    "wait_inflight": "rayckpt.ray.rank.async_save",
    "SaveHandle": "rayckpt.ray.rank.save_handle",
    "guard_optimizer": "rayckpt.engine.overlap",
    "load": "rayckpt.ray.rank.loading",
    "StagingBuffer": "rayckpt.ray.rank.staging",
    "StagingUnavailable": "rayckpt.ray.rank.staging",
    "memory_filesystem": "rayckpt.ray.memory.fs",
    "MemoryBudgetExceeded": "rayckpt.ray.memory.store",
    "peer_bytes": "rayckpt.ray.memory.store",
    "get_metadata_actor": "rayckpt.ray.metadata.actor",
    "MetadataActor": "rayckpt.ray.metadata.actor",
    "SaveTarget": "rayckpt.ray.records",
    "get_shard_writer": "rayckpt.ray.writer.actor",
}

__all__ = [
    "MemoryBudgetExceeded",
    "MetadataActor",
    "SaveHandle",
    "SaveTarget",
    "StagingBuffer",
    "StagingUnavailable",
    "get_metadata_actor",
    "get_shard_writer",
    "guard_optimizer",
    "load",
    "memory_filesystem",
    "peer_bytes",
    "prepare_staging",
    "release_staging",
    "save_async",
    "wait_inflight",
]


__getattr__, __dir__ = exports(__name__, _EXPORTS)
