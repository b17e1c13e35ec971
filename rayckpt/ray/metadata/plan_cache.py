"""The MetadataActor's plan cache: manifests, their chunk indexes and the load plans made from them.

Ray-free and thread-safe. The actor plans in worker threads, so that one slow
manifest read does not hold up every other rank, and each thread goes through
``PlanCache.plan``. One lock guards every cache structure; the slow work
(reading and decoding a manifest, building an index or a chunk table, computing
a plan) runs outside it and once per key: the first thread to miss a key
computes the value, and the threads that ask for it meanwhile wait for that
result (a *flight*). So when every rank of a load asks for the same all-ranks
plan at once, it is computed once. A checkpoint's manifest and its chunk index
are one cache entry: a thread holding the entry can always plan from it, even
after another thread evicted it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from ...bounded import BoundedMap
from ...format.manifest import Blocks, Manifest, manifest_values
from ...planning.bulk import BulkPlan, create_dim0_plans
from ...planning.chunk_table import ChunkTable
from ...planning.load_plan import ChunkIndex, LoadPlan, TensorRequest, create_load_plan, is_dim0_layout
from ...storage.checkpoint_dir import CheckpointDir
from ...storage.commit import read_manifest

#: Checkpoints whose manifest (with index and chunk table) is kept.
MANIFESTS_CACHED = 8
#: Per-request load plans kept (one per loading rank and checkpoint, for non-FSDP2 layouts).
PLANS_CACHED = 1024
#: All-ranks (FSDP2 dim-0) plans kept, each serving every rank of one load.
BULK_PLANS_CACHED = 8

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadAsk:
    """A loading rank's question to the planner (the MetadataActor's ``read_plan``)."""

    #: The tensors the rank asks for (``engine.load.tensor_requests``).
    requests: tuple[TensorRequest, ...]
    #: The plain values it asks for.
    value_keys: tuple[str, ...] = ()
    #: Whether a key the checkpoint lacks is an error.
    strict: bool = True
    #: The asking rank; with ``world_size``, FSDP2's dim-0 requests are served from one plan of
    #: every rank at once (``BulkPlan``), made for the first to ask.
    rank: int | None = None
    #: The ranks loading.
    world_size: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadBundle:
    """What a loading rank needs besides the shard files: its plan and the manifest facts."""

    plan: LoadPlan
    blocks: Blocks
    #: Size of every shard file, by its path in the checkpoint.
    file_sizes: dict[str, int]
    #: The plain values the rank asked for, in their stored form.
    values: dict[str, Any]
    save_id: str
    #: Time spent producing the bundle, reading the manifest included.
    plan_seconds: float


@dataclass(frozen=True, eq=False)
class CachedCheckpoint:
    """A committed checkpoint's manifest and its chunk index: cached, and evicted, together."""

    manifest: Manifest
    #: Shared by every plan made from ``manifest``; it fills itself lazily, key by
    #: key, and only ever adds entries, so threads may use it at once.
    index: ChunkIndex


class _Store:
    """One LRU cache of a ``PlanCache``; touched only while that cache's lock is held.

    Keys are tuples that start with the checkpoint's location, so that
    ``drop`` can forget one checkpoint.
    """

    def __init__(self, limit: int) -> None:
        self.entries: BoundedMap[tuple, Any] = BoundedMap(limit)
        #: Keys being computed by some thread, with the future the others wait on.
        self.flights: dict[tuple, Future] = {}

    def get(self, key: tuple) -> Any | None:
        return self.entries.get(key)

    def put(self, key: tuple, value: Any) -> None:
        self.entries.put(key, value)

    def drop(self, location: str) -> None:
        for key in [k for k in self.entries if k[0] == location]:
            self.entries.pop(key)
        for key in [k for k in self.flights if k[0] == location]:
            del self.flights[key]


def _read(location: str, filesystem: Any) -> Manifest:
    return read_manifest(CheckpointDir.resolve(location, filesystem))


class PlanCache:
    """Manifests and load plans, cached per checkpoint location (``location``) for the MetadataActor."""

    def __init__(self, read: Callable[[str, Any], Manifest] = _read) -> None:
        """``read(location, filesystem)``: a checkpoint's committed manifest (default: from storage)."""
        self._read = read
        self._lock = threading.Lock()
        self._checkpoints = _Store(MANIFESTS_CACHED)  # (location,) -> CachedCheckpoint
        # (location, CachedCheckpoint) -> its ChunkTable, made on the first all-ranks plan: keyed by the
        # entry itself (hashed by identity), as a table serves only the manifest object it was built from.
        self._tables = _Store(MANIFESTS_CACHED)
        self._plans = _Store(PLANS_CACHED)  # (location, save_id, requests, value_keys, strict) -> LoadPlan
        self._bulk = _Store(BULK_PLANS_CACHED)  # (location, save_id, specs, value_keys, strict, world) -> BulkPlan

    def checkpoint(self, location: str, filesystem: Any = None) -> CachedCheckpoint:
        """The checkpoint at ``location`` with its index, read from storage on a miss."""

        def create() -> CachedCheckpoint:
            manifest = self._read(location, filesystem)
            return CachedCheckpoint(manifest, ChunkIndex(manifest))

        return self._get_or_create(self._checkpoints, (location,), create)

    def manifest(self, location: str, filesystem: Any = None) -> Manifest:
        """The committed manifest at ``location`` (the actor's ``user_metadata``)."""
        return self.checkpoint(location, filesystem).manifest

    def plan(self, location: str, filesystem: Any, ask: ReadAsk) -> LoadBundle:
        """A loading rank's bundle for checkpoint ``location`` (the actor's ``read_plan``, in a worker thread).

        With ``ask.rank`` and ``ask.world_size``, when the requests are FSDP2's dim-0
        shards, the first rank to ask plans every rank at once (``BulkPlan``)
        and each rank gets its part of that; otherwise the plan is this
        request's alone, cached per (checkpoint, request).
        """
        requests, value_keys, strict = ask.requests, ask.value_keys, ask.strict
        rank, world_size = ask.rank, ask.world_size
        start = time.perf_counter()
        ckpt = self.checkpoint(location, filesystem)
        m = ckpt.manifest
        if rank is not None and world_size and is_dim0_layout(requests, rank, world_size):
            key = (location, m.save_id, tuple((r.key, r.dtype, r.shape) for r in requests), value_keys, strict)
            plan = self._bulk_plan(key, ckpt, world_size).for_rank(rank)
        else:
            plan = self._get_or_create(
                self._plans,
                (location, m.save_id, requests, value_keys, strict),
                lambda: create_load_plan(m, requests, value_keys, strict, index=ckpt.index),
            )
        sizes = {f.path: f.size for f in m.files}
        values = manifest_values(m, value_keys)
        return LoadBundle(
            plan=plan,
            blocks=m.blocks,
            file_sizes=sizes,
            values=values,
            save_id=m.save_id,
            plan_seconds=time.perf_counter() - start,
        )

    def _bulk_plan(self, key: tuple, ckpt: CachedCheckpoint, world_size: int) -> BulkPlan:
        """Every rank's plan at once, for the dim-0 request ``key``: (location, save id, tensor specs,
        value keys, strict)."""
        m = ckpt.manifest
        location, _, specs, value_keys, strict = key

        def create() -> BulkPlan:
            table = self._get_or_create(self._tables, (location, ckpt), lambda: ChunkTable.from_manifest(m))
            return create_dim0_plans(m, specs, world_size, value_keys, strict, table=table)

        return self._get_or_create(self._bulk, (*key, world_size), create)

    def forget(self, location: str) -> None:
        """Drop everything cached for ``location`` (the actor, once a new save there committed).

        Values being computed for ``location`` are still handed to the threads that
        wait for them, but not cached.
        """
        with self._lock:
            for store in (self._checkpoints, self._tables, self._plans, self._bulk):
                store.drop(location)

    def counts(self) -> dict[str, int]:
        """Entries held by each cache, each bounded (the actor's ``debug_stats``)."""
        with self._lock:
            return {
                "cached_manifests": len(self._checkpoints.entries),
                "cached_chunk_tables": len(self._tables.entries),
                "cached_rank_plans": len(self._plans.entries),
                "cached_bulk_plans": len(self._bulk.entries),
            }

    def cached_plans(self) -> int:
        """Plans held: per-request plans plus all-ranks (bulk) plans."""
        with self._lock:
            return len(self._plans.entries) + len(self._bulk.entries)

    def _get_or_create(self, store: _Store, key: tuple[Hashable, ...], create: Callable[[], T]) -> T:
        """``store[key]``, made by ``create()`` on a miss: by this thread, or by the one already at it."""
        with self._lock:
            value = store.get(key)
            if value is not None:
                return value
            flight = store.flights.get(key)
            owner = flight is None
            if owner:
                flight = store.flights[key] = Future()
        if not owner:
            return flight.result()
        try:
            value = create()
        except BaseException as exc:
            with self._lock:
                if store.flights.get(key) is flight:
                    del store.flights[key]
            flight.set_exception(exc)  # the waiters raise it too; the next caller tries again
            raise
        with self._lock:
            # Cached only while still wanted: ``forget`` during the computation drops the flight.
            if store.flights.get(key) is flight:
                del store.flights[key]
                store.put(key, value)
        flight.set_result(value)
        return value
