"""The ShardWriter: one actor per node that writes staged shares to storage.

Named ``rayckpt-writer-<node>``, detached, pinned to its node. It runs the
engine's write step (``engine.writer.write_chunks``) on a rank's share read
straight from the node's shared memory (the rank's staging buffer or Ray's
object store), removes its files if writing fails, and reports the outcome to
the MetadataActor: each rank's chunk layout only the first time
(``layout_cache.ShardReport``), then only what changes per save. It keeps a
record of its last writes (``debug_stats``): which rank's share of which save,
on which node, staged in which directory.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray

from ..engine.writer import write_chunks
from ..format.shard_file import ChunkSpec
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import WrittenShard
from .layout_cache import LAYOUT_WANTED, split_shard
from .memory_tier import MemoryStore, hold_here
from .metadata_actor import NAMESPACE, get_metadata_actor
from .replica_link import ReplicaServer
from .staging import StagedRegion, StaleSweeper, created_in, open_region, staging_dir, sweep_stale

#: How many writes a ShardWriter remembers for ``debug_stats``.
RECORDS_KEPT = 256
#: How many chunk layouts a ShardWriter remembers sending (16 bytes each): its ranks' recent ones.
SENT_LAYOUTS_KEPT = 4096


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
    #: How many files of one type the share may be written as at once (``engine.writer.parts_here``).
    max_parts: int = 1


class ShardWriter:
    """Writes staged shards from this node's object store to storage (a threaded Ray actor)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        #: This node's staging directory (``RAYCKPT_SHM_DIR`` as the node's raylet passed it on).
        self.staging_dir = staging_dir()
        #: Removes named staging files of processes that are gone: now, then every minute.
        self.sweeper = StaleSweeper(self.staging_dir)
        #: The last ``RECORDS_KEPT`` writes, oldest first (see ``debug_stats``).
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECORDS_KEPT)
        #: Digests of the chunk layouts it sent the MetadataActor, most recent last.
        self.sent_layouts: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._sent_lock = threading.Lock()
        #: The node's share of the memory tier (``memory_tier``): freed with this process.
        self.memory = MemoryStore(node_id, self.staging_dir)
        hold_here(self.memory)
        #: Where peers send this node its replicas (``replica_link``).
        self.replicas = ReplicaServer(self.memory, ray.util.get_node_ip_address())

    # The memory tier's file operations (``memory_tier.MemoryFileSystem`` calls them on every live writer).
    def mem_put(self, path: str, data: Any) -> int:
        return self.memory.put(path, data)

    def mem_endpoint(self) -> tuple[str, int, bytes]:
        """(host, port, token) of this node's replica listener (``replica_link``)."""
        return self.replicas.endpoint

    def mem_stat(self, paths: list[str]) -> dict[str, int]:
        return self.memory.stat(paths)

    def mem_listing(self, base: str, recursive: bool) -> dict[str, int]:
        return self.memory.listing(base, recursive)

    def mem_delete(self, path: str, tree: bool) -> int:
        return self.memory.delete(path, tree)

    def mem_where(self, path: str) -> tuple[int, int, int, int] | None:
        return self.memory.where(path)

    def mem_read(self, path: str, offset: int, length: int) -> bytes:
        return self.memory.read(path, offset, length)

    def mem_room(self, root: str | None = None, keep: int = 0) -> int:
        """Bytes the node's memory tier may still take (its budget less what it holds); with ``root``, after
        dropping the checkpoints under it older than its newest ``keep`` committed ones (``MemoryStore.drop_old``)."""
        return self.memory.room(root, keep)

    def mem_budget(self, nbytes: int | None = None) -> int:
        """The node's memory-tier budget in bytes; ``nbytes`` sets it (held files stay)."""
        if nbytes is not None:
            self.memory.budget = nbytes
        return self.memory.budget

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

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
        over the replica link (``files``, ``bytes``).
        """
        return {
            "node": self.node(),
            "pid": os.getpid(),
            "staging_dir": self.staging_dir,
            "writes": list(self.records),
            "replicas_received": dict(self.replicas.received),
        }

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
        record = {
            "save_id": request.save_id,
            "run": request.run,
            "step": request.step,
            "rank": request.rank,
            "max_parts": request.max_parts,
        }
        try:
            with self._views(staged, record) as arrays:
                chunks = [spec.with_data(a) for spec, a in zip(request.chunks, arrays)]
                shard = write_chunks(
                    ckdir, chunks, request.save_id, request.rank, request.block_size, written_files, request.max_parts
                )
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
        files = [f.path for f in shard.files]
        self.records.append({**record, "node": self.node(), "bytes": shard.nbytes, "files": files})
        self._report_written(request, shard, seconds, incarnation)
        return {"node": self.node_id, "files": files, "bytes": shard.nbytes, "seconds": seconds}

    def _report_written(self, request: ShardWrite, shard: WrittenShard, seconds: float, incarnation: Any) -> None:
        """Report the rank's durable files: its chunk layout only if not sent before, or if the actor wants it."""
        report = split_shard(shard)
        with self._sent_lock:
            sent = report.layout in self.sent_layouts
        where = (seconds, self.node_id, incarnation, request.run, request.step, request.location, request.filesystem)
        actor = get_metadata_actor()
        first = report.without_layout() if sent else report
        answer = ray.get(actor.report_written.remote(request.save_id, first, *where))
        if answer == LAYOUT_WANTED:  # the actor restarted, or dropped it
            ray.get(actor.report_written.remote(request.save_id, report, *where))
        with self._sent_lock:
            self.sent_layouts[report.layout] = None
            self.sent_layouts.move_to_end(report.layout)
            while len(self.sent_layouts) > SENT_LAYOUTS_KEPT:
                self.sent_layouts.popitem(last=False)

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


def writer_name(node_id: str) -> str:
    return f"rayckpt-writer-{node_id[:12]}"


def get_shard_writer(node_id: str | None = None) -> Any:
    """The ShardWriter of ``node_id`` (default: this process's node): ``rayckpt-writer-<node>``, pinned to that node.

    Pinned with node affinity. Its ``debug_stats()`` returns its ``node`` (asked of
    Ray), ``pid``, ``staging_dir`` and ``writes``: its last 256 writes, one record per
    rank's share: ``save_id``, ``run``, ``step``, ``rank``, ``node``, ``staging``
    (``"shm"`` / ``"object_store"``), ``staged_node`` (where the rank staged) and
    ``staged_dir`` (the directory the staging file was created in, read from the
    open file itself), both ``None`` for the object store; ``bytes``, ``files``, ``max_parts``.
    """
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
