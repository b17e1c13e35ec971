"""Ray actors: the MetadataActor (catalog, commit, read plans) and ShardWriters.

Both are thin shells around the engine's pure planning and its file I/O.

- ``MetadataActor``: one per Ray namespace, named ``rayckpt-metadata``, detached.
  Collects every rank's written chunks for a save and commits the manifest once
  all are durable; fails and cleans up a save that any rank reports failed (or
  that times out); serves cached read plans; keeps a catalog of checkpoints per
  run that it rebuilds from the manifests in storage, which stay the truth.
- ``ShardWriter``: one per node, named ``rayckpt-writer-<node>``, pinned there.
  Writes a rank's staged chunks from the node's shared-memory object store into
  Arrow shard files and reports them to the MetadataActor.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

from ..engine.writer import write_chunks
from ..format.shard_file import ChunkData
from ..storage.checkpoint_dir import CheckpointDir
from .metadata_actor import NAMESPACE, get_metadata_actor
from .staging import StagedRegion, open_region, sweep_stale


class ShardWriter:
    """Writes staged shards from this node's object store to storage (a threaded Ray actor)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        sweep_stale()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def write(
        self,
        save_id: str,
        uri: str,
        filesystem: Any,
        rank: int,
        items: list[tuple[str, str, Any]],
        block_size: int,
        staged: list[Any] | StagedRegion,
    ) -> dict[str, Any]:
        """Write the staged chunks and report to the MetadataActor.

        ``staged``: the arrays themselves (zero-copy views into the object store)
        or a ``StagedRegion`` of a rank's staging buffer on this node. ``items``
        are (key, dtype, box) for each chunk. Returns what was written.
        """
        meta = get_metadata_actor()
        ckdir = CheckpointDir.resolve(uri, filesystem)
        written_files: list[str] = []
        start = time.perf_counter()
        try:
            with self._views(staged) as arrays:
                chunks = [ChunkData(k, d, b, a) for (k, d, b), a in zip(items, arrays)]
                written, files = write_chunks(ckdir, chunks, save_id, rank, block_size, written_files)
                del chunks
        except Exception as exc:
            for rel in written_files:
                ckdir.delete(rel)
            msg = f"ShardWriter on node {self.node_id[:12]}: {type(exc).__name__}: {exc}"
            ray.get(meta.report_failed.remote(save_id, rank, msg))
            raise
        seconds = time.perf_counter() - start
        ray.get(meta.report_written.remote(save_id, rank, written, files, seconds, self.node_id))
        return {
            "node": self.node_id,
            "files": [f.path for f in files],
            "bytes": sum(f.size for f in files),
            "seconds": seconds,
        }

    @contextmanager
    def _views(self, staged: list[Any] | StagedRegion) -> Iterator[list[Any]]:
        if not isinstance(staged, StagedRegion):
            yield staged
            return
        if staged.node_id != self.node_id:
            raise ValueError(
                f"staging file {staged.path} is on node {staged.node_id[:12]}, not on this writer's node"
            )
        sweep_stale()
        with open_region(staged) as views:
            yield views


def writer_name(node_id: str) -> str:
    return f"rayckpt-writer-{node_id[:12]}"


def get_shard_writer(node_id: str | None = None) -> Any:
    """The ShardWriter of ``node_id`` (default: this process's node), pinned to that node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = node_id or ray.get_runtime_context().get_node_id()
    return (
        ray.remote(ShardWriter)
        .options(
            name=writer_name(node_id),
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=16,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(node_id)
    )
