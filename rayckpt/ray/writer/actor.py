"""The ShardWriter: one actor per node that writes staged shares to storage.

Named ``rayckpt-writer-<node>``, detached, pinned to its node. It runs the
engine's write step (``engine.writer.write_chunks``) on a rank's share read
straight from the node's shared memory (the rank's staging buffer or Ray's
object store), removes its files if writing fails, and reports the outcome to
the MetadataActor: each rank's chunk layout only the first time
(``metadata.layout_cache.ShardReport``), then only what changes per save. It keeps a
record of its last writes (``debug_stats``): which rank's share of which save,
on which node, staged in which directory.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ...bounded import BoundedMap
from ...engine.increments import FULL, Increment
from ...engine.writer import ShareSpec, write_rank_share
from ...format.shard_file import ChunkSpec
from ...storage.checkpoint_dir import CheckpointDir
from ...storage.commit import WrittenFiles, WrittenShard
from ..actors import NAMESPACE, named, writer_name
from ..memory.host import MemoryHost
from ..metadata.actor import get_metadata_actor
from ..metadata.layout_cache import LAYOUT_WANTED, split_shard
from ..records import SaveTarget
from ..shm import StagedRegion, created_in, staging_dir
from .regions import StaleSweeper, open_region, sweep_stale

#: How many writes a ShardWriter remembers for ``debug_stats``.
RECORDS_KEPT = 256
#: How many chunk layouts a ShardWriter remembers sending (16 bytes each): its ranks' recent ones.
SENT_LAYOUTS_KEPT = 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardWrite:
    """One rank's share of a save, as its ShardWriter needs it (the bytes travel beside it)."""

    #: The save and the rank; its location is where the checkpoint goes, as the actors reach it.
    target: SaveTarget
    block_size: int
    #: Each staged chunk, in the order of the staged arrays.
    chunks: tuple[ChunkSpec, ...]
    #: How many files of one type the share may be written as at once (``engine.writer.parts_here``).
    max_parts: int = 1
    #: Whether the save is incremental, and its base (``engine.increments``).
    increment: Increment = FULL


class ShardWriter(MemoryHost):
    """Writes staged shards from this node's shared memory to storage (a threaded Ray actor).

    It also holds the node's share of the memory tier (``MemoryHost``: the ``mem_*`` calls).
    """

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        #: This node's staging directory (``RAYCKPT_SHM_DIR`` as the node's raylet passed it on).
        self.staging_dir = staging_dir()
        #: Removes named staging files of processes that are gone: now, then every minute.
        self.sweeper = StaleSweeper(self.staging_dir)
        #: The last ``RECORDS_KEPT`` writes, oldest first (see ``debug_stats``).
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECORDS_KEPT)
        #: Digests of the chunk layouts it sent the MetadataActor, most recent last.
        self.sent_layouts: BoundedMap[bytes, None] = BoundedMap(SENT_LAYOUTS_KEPT)
        self._sent_lock = threading.Lock()
        super().__init__(node_id, self.staging_dir)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def __repr__(self) -> str:
        """What the Ray dashboard's Actors page shows (its Repr column) and prefixes the actor's log lines with:
        Ray takes it once, when the actor starts; what it holds later is in ``rayckpt status``."""
        budget = self.memory.budget / 2**30
        return f"ShardWriter(node={self.node_id[:12]}, memory_budget={budget:.1f}GiB)"

    def debug_stats(self) -> dict[str, Any]:
        """Where this writer runs and what it wrote (called by tests and operators).

        ``node``: the node its process runs on (asked of Ray, not the name it was given);
        ``staging_dir``: the directory it sweeps; ``writes``: one record per rank's share
        it wrote, oldest first: ``save_id``, ``run``, ``step``, ``rank``, ``node`` (the
        node when it wrote), ``staging`` ("shm" or "object_store"), ``staged_node`` (the
        node the rank staged on) and ``staged_dir`` (the directory the staging file was
        created in, read from the open file itself), both ``None`` for the object store;
        ``bytes``, ``files``, ``max_parts`` (the files of one type it could write at once);
        ``replicas_received``: the memory tier's replicas peers sent it
        over the replica link (``files``, ``bytes``); ``replicas_through_ray``: those they sent through
        Ray's object store instead (the link unreachable).
        """
        return {
            "node": self.node(),
            "pid": os.getpid(),
            "staging_dir": self.staging_dir,
            "writes": list(self.records),
            "replicas_received": dict(self.replicas.received),
            "replicas_through_ray": dict(self.replicas_through_ray),
        }

    def write(
        self, request: ShardWrite, staged: list[Any] | StagedRegion, incarnation: str | None = None
    ) -> dict[str, Any]:
        """Write a rank's staged chunks and report to the MetadataActor (called by the rank).

        Args:
            request: the rank's share: where it goes and its chunks.
            staged: the arrays themselves (zero-copy views into the object store) or a
                ``StagedRegion`` of the rank's staging buffer on this node, one array per
                ``request.chunks``.
            incarnation: the MetadataActor's id when the save began (the rank passes the
                reference; Ray resolves it), passed on with the report: a restarted actor
                fails the save at once.

        Returns:
            What was written: ``node``, ``files``, ``bytes``, ``seconds``.

        Raises:
            Whatever writing raised, after removing the files written and reporting the
            failure to the MetadataActor.
        """
        target = request.target
        ckdir = CheckpointDir.resolve(target.location, target.filesystem)
        files = WrittenFiles(ckdir, target.save_id)  # removed if writing fails
        start = time.perf_counter()
        record = {
            "save_id": target.save_id,
            "run": target.run,
            "step": target.step,
            "rank": target.rank,
            "max_parts": request.max_parts,
        }
        try:
            with files, self._views(staged, record) as arrays:
                chunks = [spec.with_data(a) for spec, a in zip(request.chunks, arrays)]
                share = ShareSpec(
                    rank=target.rank,
                    block_size=request.block_size,
                    max_parts=request.max_parts,
                    increment=request.increment,
                )
                shard = write_rank_share(files, chunks, share)
                del chunks
        except Exception as exc:
            msg = f"ShardWriter on node {self.node_id[:12]}: {type(exc).__name__}: {exc}"
            try:
                ray.get(get_metadata_actor().report_failed.remote(target, msg))
            except ray.exceptions.RayActorError:
                pass  # the actor is gone: the rank reports the failure it gets from this task
            raise
        seconds = time.perf_counter() - start
        files = [f.path for f in shard.files]
        self.records.append({**record, "node": self.node(), "bytes": shard.nbytes, "files": files})
        self._report_written(request, shard, seconds, incarnation)
        return {"node": self.node_id, "files": files, "bytes": shard.nbytes, "seconds": seconds}

    def _report_written(
        self, request: ShardWrite, shard: WrittenShard, seconds: float, incarnation: str | None
    ) -> None:
        """Report the rank's durable files: its chunk layout only if not sent before, or if the actor wants it."""
        report = split_shard(shard)
        with self._sent_lock:
            sent = report.layout in self.sent_layouts
        target = replace(request.target, incarnation=incarnation)
        actor = get_metadata_actor()
        first = report.without_layout() if sent else report
        answer = ray.get(actor.report_written.remote(target, first, seconds, self.node_id))
        if answer == LAYOUT_WANTED:  # the actor restarted, or dropped it
            ray.get(actor.report_written.remote(target, report, seconds, self.node_id))
        with self._sent_lock:
            self.sent_layouts.put(report.layout, None)

    @contextmanager
    def _views(self, staged: list[Any] | StagedRegion, record: dict[str, Any]) -> Iterator[list[Any]]:
        """The staged arrays; what they were staged in goes into ``record``."""
        if not isinstance(staged, StagedRegion):
            record.update(staging="object_store", staged_node=None, staged_dir=None)  # Ray's to place
            yield staged
            return
        if staged.node_id != self.node_id:
            raise ValueError(f"staging file {staged.path} is on node {staged.node_id[:12]}, not on this writer's node")
        sweep_stale(self.staging_dir)
        with open_region(staged) as views:
            try:  # the file is mapped now: the rank leaves it alone while this write is in flight
                where = created_in(staged.path)
            except OSError:  # the rank exited since: the mapping still reads, only the record lacks it
                where = None
            record.update(staging="shm", staged_node=staged.node_id, staged_dir=where)
            yield views


def get_shard_writer(node_id: str | None = None) -> Any:
    """The ShardWriter of ``node_id`` (default: this process's node), created on first use.

    Named ``rayckpt-writer-<node>``, detached, pinned to its node with node affinity.
    A rank calls its ``write`` (``save_async``); operators and tests its ``debug_stats()``
    (``ShardWriter.debug_stats``: what it wrote, from which staging directory); the
    memory tier its ``mem_*`` calls.

    Args:
        node_id: The node (default: this process's).

    Returns:
        Its handle (``actors.named``: Ray's cached handle while the writer lives).
    """
    node_id = node_id or ray.get_runtime_context().get_node_id()
    return named(writer_name(node_id), functools.partial(_create_shard_writer, node_id))


@functools.cache
def _remote_class() -> Any:
    return ray.remote(ShardWriter)


def _create_shard_writer(node_id: str) -> Any:
    return (
        _remote_class()
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
