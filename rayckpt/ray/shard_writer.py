"""The ShardWriter: one actor per node that writes staged shares to storage.

Named ``rayckpt-writer-<node>``, detached, pinned to its node. It runs the
engine's write step (``engine.writer.write_chunks``) on a rank's share read
straight from the node's shared memory (the rank's staging buffer or Ray's
object store), removes its files if writing fails, and reports the outcome to
the MetadataActor.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray

from ..engine.writer import write_chunks
from ..format.shard_file import ChunkSpec
from ..storage.checkpoint_dir import CheckpointDir
from .metadata_actor import NAMESPACE, get_metadata_actor
from .staging import StagedRegion, StaleSweeper, open_region, sweep_stale


@dataclass(frozen=True, slots=True)
class ShardWrite:
    """One rank's share of a save, as its ShardWriter needs it (the bytes travel beside it)."""

    save_id: str
    #: Where the checkpoint goes, as the actors reach it (with ``filesystem``).
    location: str
    filesystem: Any
    rank: int
    block_size: int
    #: Each staged chunk, in the order of the staged arrays.
    chunks: tuple[ChunkSpec, ...]
    #: The save's run and step, for a MetadataActor that does not know the save (it restarted).
    run: str = ""
    step: int | None = None


class ShardWriter:
    """Writes staged shards from this node's object store to storage (a threaded Ray actor)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        #: Removes named staging files of processes that are gone: now, then every minute.
        self.sweeper = StaleSweeper()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def write(
        self, request: ShardWrite, staged: list[Any] | StagedRegion, incarnation: str | None = None
    ) -> dict[str, Any]:
        """Write a rank's staged chunks and report to the MetadataActor (called by the rank).

        ``staged``: the arrays themselves (zero-copy views into the object store)
        or a ``StagedRegion`` of the rank's staging buffer on this node, one array
        per ``request.chunks``. ``incarnation``: the MetadataActor's id when the
        save began, passed on with the report (a restarted actor fails the save at
        once). Returns what was written.
        """
        ckdir = CheckpointDir.resolve(request.location, request.filesystem)
        written_files: list[str] = []
        start = time.perf_counter()
        try:
            with self._views(staged) as arrays:
                chunks = [spec.with_data(a) for spec, a in zip(request.chunks, arrays)]
                shard = write_chunks(ckdir, chunks, request.save_id, request.rank, request.block_size, written_files)
                del chunks
        except Exception as exc:
            for rel in written_files:
                ckdir.delete(rel)
            msg = f"ShardWriter on node {self.node_id[:12]}: {type(exc).__name__}: {exc}"
            where = (request.run, request.step, request.location, request.filesystem)
            try:
                ray.get(get_metadata_actor().report_failed.remote(request.save_id, request.rank, msg, *where))
            except ray.exceptions.RayActorError:
                pass  # the actor is gone: the rank reports the failure it gets from this task
            raise
        seconds = time.perf_counter() - start
        where = (request.run, request.step, request.location, request.filesystem)
        ray.get(
            get_metadata_actor().report_written.remote(
                request.save_id, shard, seconds, self.node_id, incarnation, *where
            )
        )
        return {"node": self.node_id, "files": [f.path for f in shard.files], "bytes": shard.nbytes, "seconds": seconds}

    @contextmanager
    def _views(self, staged: list[Any] | StagedRegion) -> Iterator[list[Any]]:
        if not isinstance(staged, StagedRegion):
            yield staged
            return
        if staged.node_id != self.node_id:
            raise ValueError(f"staging file {staged.path} is on node {staged.node_id[:12]}, not on this writer's node")
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
