"""rayckpt on Ray: async saves through shared memory, a ShardWriter per node, the MetadataActor, the memory tier.

The package is laid out by the process a line runs in:

- here, the training rank's side: ``async_save`` (``save_async``), ``save_handle``
  (``SaveHandle``), ``staging`` (the rank's reusable shared-memory buffer), ``copier``
  (the copy into it, before the call returns or beside the next step), ``loading``
  (``load``), and ``memory_fs`` (``memory_filesystem``: the memory tier as a filesystem, for any process);
- ``metadata/``: the MetadataActor (one per namespace) and the Ray-free parts it calls;
- ``writer/``: the node's ShardWriter, which writes the ranks' staged shares;
- ``memory/``: the memory tier the ShardWriters hold and its replication to a peer node;
- shared by all of them: ``actors`` (names and lookups), ``records`` (``SaveTarget``),
  ``shm`` (the node's staging directory, ``StagedRegion``), ``metrics``.

The public names below are importable from ``rayckpt.ray``; each is imported on
first use. May import ``engine`` and everything below it, and ``ray``; never
``train`` or ``tools``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import exports

if TYPE_CHECKING:  # what static tools (type checkers, the API docs) see; at run time each is imported on first use
    from ..engine.overlap import guard_optimizer
    from .async_save import prepare_staging, release_staging, save_async, wait_inflight
    from .loading import load
    from .memory.store import MemoryBudgetExceeded, peer_bytes
    from .memory_fs import memory_filesystem
    from .metadata.actor import MetadataActor, get_metadata_actor
    from .records import SaveTarget
    from .save_handle import SaveHandle
    from .staging import StagingBuffer, StagingUnavailable
    from .writer.actor import get_shard_writer

#: Public name -> the module that defines it.
_EXPORTS = {
    "save_async": "rayckpt.ray.async_save",
    "prepare_staging": "rayckpt.ray.async_save",
    "release_staging": "rayckpt.ray.async_save",
    "wait_inflight": "rayckpt.ray.async_save",
    "SaveHandle": "rayckpt.ray.save_handle",
    "guard_optimizer": "rayckpt.engine.overlap",
    "load": "rayckpt.ray.loading",
    "StagingBuffer": "rayckpt.ray.staging",
    "StagingUnavailable": "rayckpt.ray.staging",
    "memory_filesystem": "rayckpt.ray.memory_fs",
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
