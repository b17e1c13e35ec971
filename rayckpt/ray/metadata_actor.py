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

import asyncio
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import ray

from ..format.manifest import Blocks, Manifest, manifest_values
from ..planning.bulk import BulkPlan, create_dim0_plans
from ..planning.chunk_table import ChunkTable
from ..planning.load_plan import ChunkIndex, LoadPlan, TensorRequest, create_load_plan, is_dim0_layout
from ..storage.catalog import CatalogEntry, entry_order, scan_run
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import SaveSpec, WrittenShard, commit_save, read_manifest, remove_failed_save
from . import metrics

NAMESPACE = "rayckpt"


METADATA_ACTOR_NAME = "rayckpt-metadata"


DEFAULT_COMMIT_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class ReadBundle:
    """What a loading rank needs besides the shard files: its plan and the manifest facts."""

    plan: LoadPlan
    blocks: Blocks
    file_sizes: dict[str, int]
    values: dict[str, Any]
    save_id: str
    plan_seconds: float


@dataclass
class _Save:
    save_id: str
    uri: str = ""
    filesystem: Any = None
    run: str = ""
    step: int | None = None
    #: What every rank agreed on (rank 0's registration brings it).
    spec: SaveSpec | None = None
    started: float = field(default_factory=time.time)
    deadline: float = 0.0
    timeout: float = 0.0
    registered: bool = False
    written: dict[int, WrittenShard] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    #: Node of the ShardWriter that wrote each rank's share.
    writer_nodes: dict[int, str] = field(default_factory=dict)
    status: str = "pending"
    error: str | None = None
    total_bytes: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def entry(self) -> CatalogEntry:
        return CatalogEntry(
            run=self.run,
            step=self.step,
            path=self.uri,
            status=self.status,
            created=self.started,
            world_size=self.spec.world_size if self.spec else 0,
            bytes=self.total_bytes,
            save_id=self.save_id,
            error=self.error,
        )


class MetadataActor:
    """Catalog, commit protocol and reshard planning service (an async Ray actor)."""

    def __init__(self, commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S) -> None:
        self._commit_timeout_s = commit_timeout_s
        self._saves: dict[str, _Save] = {}
        self._catalog: dict[str, dict[str, CatalogEntry]] = {}
        self._roots: dict[str, tuple[str, Any]] = {}
        self._manifests: OrderedDict[str, Manifest] = OrderedDict()
        self._indexes: dict[str, ChunkIndex] = {}
        self._plans: OrderedDict[tuple, LoadPlan] = OrderedDict()
        #: Plans of every rank of an FSDP2 (dim-0) load, per (checkpoint, specs, world size).
        self._bulk: OrderedDict[tuple, BulkPlan] = OrderedDict()
        self._tables: dict[str, ChunkTable] = {}
        self._bulk_lock = threading.Lock()
        self._watchdog: asyncio.Task | None = None
        self._events: dict[str, list[dict[str, Any]]] = {}

    async def ping(self) -> str:
        return "ok"

    # -- catalog ---------------------------------------------------------------

    async def register_run(self, run: str, root: str, filesystem: Any = None) -> list[CatalogEntry]:
        """Make ``root`` (where ``run``'s checkpoint directories live) known; scan it."""
        self._roots[run] = (root, filesystem)
        return await asyncio.to_thread(self._scan, run)

    def _scan(self, run: str) -> list[CatalogEntry]:
        root, fs = self._roots[run]
        found = {e.path: e for e in scan_run(CheckpointDir.resolve(root, fs), run)}
        # In-flight and rolled-back saves are not (or no longer) on storage: keep them.
        for s in self._saves.values():
            if s.run == run and s.status in ("pending", "failed") and s.uri not in found:
                found[s.uri] = s.entry()
        self._catalog[run] = found
        return sorted(found.values(), key=entry_order)

    async def checkpoints(self, run: str) -> list[CatalogEntry]:
        """The run's checkpoints, oldest first, re-read from storage."""
        if run not in self._roots:
            return sorted(self._catalog.get(run, {}).values(), key=entry_order)
        return await asyncio.to_thread(self._scan, run)

    async def latest(self, run: str) -> CatalogEntry | None:
        committed = [e for e in await self.checkpoints(run) if e.status == "committed"]
        return committed[-1] if committed else None

    # -- commit protocol -------------------------------------------------------

    def _save(self, save_id: str) -> _Save:
        s = self._saves.get(save_id)
        if s is None:
            s = self._saves[save_id] = _Save(save_id)
        return s

    async def begin_save(
        self,
        spec: SaveSpec,
        uri: str,
        filesystem: Any,
        run: str,
        step: int | None,
        commit_timeout_s: float | None = None,
    ) -> None:
        """Called by rank 0 once per save. A save not committed within
        ``commit_timeout_s`` (default: the actor's) fails."""
        s = self._save(spec.save_id)
        s.spec, s.uri, s.filesystem, s.run, s.step = spec, uri, filesystem, run, step
        s.timeout = commit_timeout_s or self._commit_timeout_s
        s.deadline = time.time() + s.timeout
        s.registered = True
        self._catalog.setdefault(run, {})[uri] = s.entry()
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._expire_loop())
        await self._maybe_finish(s)

    async def report_written(self, save_id: str, shard: WrittenShard, seconds: float, node: str = "") -> None:
        """Called by a ShardWriter when a rank's shard files are durable."""
        s = self._save(save_id)
        s.writer_nodes[shard.rank] = node
        if s.status == "failed":
            await asyncio.to_thread(_delete_files, s, [f.path for f in shard.files])
            return
        s.written[shard.rank] = shard
        nbytes = shard.nbytes
        metrics.observe("rayckpt_persist_seconds", seconds, run=s.run)
        metrics.inc("rayckpt_bytes_written", nbytes, run=s.run)
        if seconds > 0:
            metrics.observe("rayckpt_write_throughput_bytes_per_second", nbytes / seconds, run=s.run)
        await self._maybe_finish(s)

    async def report_failed(
        self,
        save_id: str,
        rank: int,
        error: str,
        run: str = "",
        step: int | None = None,
        uri: str = "",
        filesystem: Any = None,
    ) -> None:
        """Called by a rank or its writer when its part of the save failed.

        ``run``, ``step``, ``uri``, ``filesystem``: where the save goes, for a failure
        that arrives before rank 0's registration (its event and its cleanup).
        """
        s = self._save(save_id)
        if not s.registered:
            s.run, s.step, s.uri, s.filesystem = run, step, uri, filesystem
        s.failures[rank] = error
        await self._fail(s, f"rank {rank}: {error}")

    async def fail_pending(self, run: str, reason: str) -> list[str]:
        """Fail every in-flight save of ``run`` (e.g. the worker group died)."""
        failed = []
        for s in list(self._saves.values()):
            if s.run == run and s.status == "pending":
                await self._fail(s, reason)
                failed.append(s.save_id)
        return failed

    async def wait_commit(self, save_id: str, timeout: float | None = None) -> CatalogEntry:
        """Block until the save committed or failed; return its catalog entry."""
        s = self._save(save_id)
        try:
            await asyncio.wait_for(s.done.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return s.entry()

    async def _maybe_finish(self, s: _Save) -> None:
        if s.status != "pending" or not s.registered or len(s.written) < s.spec.world_size:
            return
        try:
            manifest = await asyncio.to_thread(self._commit, s)
        except Exception as exc:  # noqa: BLE001 - a failed commit must fail the save, not the actor
            await self._fail(s, f"commit: {type(exc).__name__}: {exc}")
            return
        s.status = "committed"
        s.total_bytes = manifest.total_bytes
        self._catalog.setdefault(s.run, {})[s.uri] = s.entry()
        self._forget_manifest(s.uri)
        metrics.inc("rayckpt_checkpoints_committed", run=s.run)
        await self.record_event(
            s.run, "committed", {"save_id": s.save_id, "step": s.step, "uri": s.uri, "writer_nodes": s.writer_nodes}
        )
        metrics.observe("rayckpt_commit_seconds", time.time() - s.started, run=s.run)
        s.done.set()

    def _commit(self, s: _Save) -> Manifest:
        return commit_save(CheckpointDir.resolve(s.uri, s.filesystem), s.spec, s.written.values())

    async def _fail(self, s: _Save, reason: str) -> None:
        if s.status != "pending":
            return
        s.status = "failed"
        s.error = reason
        paths = [f.path for shard in s.written.values() for f in shard.files]
        await asyncio.to_thread(_delete_files, s, paths)
        if s.uri:
            self._catalog.setdefault(s.run, {})[s.uri] = s.entry()
        metrics.inc("rayckpt_checkpoints_failed", run=s.run)
        await self.record_event(s.run, "failed", {"save_id": s.save_id, "step": s.step, "uri": s.uri, "error": reason})
        s.done.set()

    async def _expire_loop(self) -> None:
        while any(s.status == "pending" for s in self._saves.values()):
            now = time.time()
            for s in list(self._saves.values()):
                if s.status == "pending" and s.registered and now > s.deadline:
                    missing = sorted(set(range(s.spec.world_size)) - set(s.written))
                    await self._fail(s, f"rank(s) {missing} did not report within {s.timeout:g}s")
            await asyncio.sleep(0.5)

    # -- reshard planning ------------------------------------------------------

    def _manifest(self, uri: str, filesystem: Any) -> Manifest:
        m = self._manifests.get(uri)
        if m is None:
            m = read_manifest(CheckpointDir.resolve(uri, filesystem))
            self._manifests[uri] = m
            self._indexes[uri] = ChunkIndex(m)
            while len(self._manifests) > 8:
                old, _ = self._manifests.popitem(last=False)
                self._indexes.pop(old, None)
                self._tables.pop(old, None)
        else:
            self._manifests.move_to_end(uri)
        return m

    def _forget_manifest(self, uri: str) -> None:
        self._manifests.pop(uri, None)
        self._indexes.pop(uri, None)
        self._tables.pop(uri, None)
        for cache in (self._plans, self._bulk):
            for key in [k for k in cache if k[0] == uri]:
                del cache[key]

    async def read_plan(
        self,
        uri: str,
        filesystem: Any,
        requests: tuple[TensorRequest, ...],
        value_keys: tuple[str, ...],
        strict: bool = True,
        run: str = "",
        rank: int | None = None,
        world_size: int | None = None,
    ) -> ReadBundle:
        """A loading rank's read plan for checkpoint ``uri``; cached per (checkpoint, request).

        With ``rank`` and ``world_size``, when the requests are FSDP2's dim-0
        shards, the first rank to ask plans every rank at once (vectorized,
        ``bulk_plan``) and the others get their part of that.
        """
        return await asyncio.to_thread(
            self._read_plan, uri, filesystem, requests, value_keys, strict, run, rank, world_size
        )

    def _read_plan(
        self,
        uri: str,
        filesystem: Any,
        requests: tuple,
        value_keys: tuple,
        strict: bool,
        run: str,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> ReadBundle:
        start = time.perf_counter()
        m = self._manifest(uri, filesystem)
        key = (uri, m.save_id, requests, value_keys, strict)
        plan = self._plans.get(key)
        if plan is None and rank is not None and world_size and is_dim0_layout(requests, rank, world_size):
            plan = self._bulk_plan(uri, m, requests, value_keys, strict, world_size).for_rank(rank)
        if plan is None:
            plan = create_load_plan(m, requests, value_keys, strict, index=self._indexes[uri])
            self._plans[key] = plan
            while len(self._plans) > 1024:
                self._plans.popitem(last=False)
        seconds = time.perf_counter() - start
        metrics.observe("rayckpt_plan_seconds", seconds, run=run)
        sizes = {f.path: f.size for f in m.files}
        return ReadBundle(plan, m.blocks, sizes, manifest_values(m, value_keys), m.save_id, seconds)

    def _bulk_plan(
        self, uri: str, m: Manifest, requests: tuple, value_keys: tuple, strict: bool, world_size: int
    ) -> BulkPlan:
        specs = tuple((r.key, r.dtype, r.shape) for r in requests)
        key = (uri, m.save_id, specs, value_keys, strict, world_size)
        with self._bulk_lock:  # ranks ask at once: plan once, the others wait for it
            bulk = self._bulk.get(key)
            if bulk is None:
                table = self._tables.get(uri)
                if table is None:
                    table = self._tables[uri] = ChunkTable.from_manifest(m)
                bulk = self._bulk[key] = create_dim0_plans(m, specs, world_size, value_keys, strict, table=table)
                while len(self._bulk) > 8:
                    self._bulk.popitem(last=False)
            return bulk

    async def user_metadata(self, uri: str, filesystem: Any = None) -> dict[str, Any]:
        """The ``user_metadata`` of a committed checkpoint (step, run, metrics)."""
        m = await asyncio.to_thread(self._manifest, uri, filesystem)
        return dict(m.user_metadata)

    async def cached_plans(self) -> int:
        """Plans held: per-request plans plus all-ranks (bulk) plans."""
        return len(self._plans) + len(self._bulk)

    # -- events (from the controller callback) -----------------------------------

    async def record_event(self, run: str, kind: str, data: dict[str, Any]) -> None:
        events = self._events.setdefault(run, [])
        events.append({"time": time.time(), "kind": kind, **data})
        del events[:-100]

    async def events(self, run: str) -> list[dict[str, Any]]:
        return list(self._events.get(run, []))


def _delete_files(s: _Save, paths: list[str]) -> None:
    """Remove a failed save's files: the ones reported and any with its save_id prefix."""
    if s.uri:
        remove_failed_save(CheckpointDir.resolve(s.uri, s.filesystem), s.save_id, paths)


def get_metadata_actor(commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S) -> Any:
    """The namespace's MetadataActor, created on first use (detached, 0 CPUs)."""
    return (
        ray.remote(MetadataActor)
        .options(
            name=METADATA_ACTOR_NAME,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=1000,
            max_restarts=-1,
        )
        .remote(commit_timeout_s)
    )
