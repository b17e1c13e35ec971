"""The MetadataActor: one per Ray namespace, the coordinator of saves and loads through the actors.

Named ``rayckpt-metadata``, detached, async. A thin Ray shell over Ray-free
parts, which it calls from worker threads (they do the storage I/O):

- ``commit_tracker.CommitTracker``: each save's state; commits the manifest once
  every rank's files are durable, fails and cleans up a save that any rank
  reports failed, that its run gave up on or that times out.
- ``plan_cache.PlanCache``: manifests and the load plans made from them.
- ``storage.catalog``: the checkpoints of each registered run, re-read from
  storage, which stays the truth; the tracker adds the saves in flight.

The shell adds what needs Ray or the event loop: waiting for a save's outcome
(``wait_commit``), the watchdog that expires late saves, metrics and the event
log the Ray Train callback and tests read.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from ..planning.load_plan import TensorRequest
from ..storage.catalog import CatalogEntry, entry_order, latest_committed, scan_run
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import SaveSpec, WrittenShard
from . import metrics
from .commit_tracker import COMMITTED, FAILED, PENDING, CommitTracker, SaveOutcome
from .plan_cache import LoadBundle, PlanCache

NAMESPACE = "rayckpt"
METADATA_ACTOR_NAME = "rayckpt-metadata"
DEFAULT_COMMIT_TIMEOUT_S = 600.0

#: How often the watchdog looks for saves past their deadline.
_EXPIRE_EVERY_S = 0.5
#: Events kept per run.
_EVENTS_KEPT = 100


class MetadataActor:
    """Catalog, commit protocol and reshard planning service (an async Ray actor)."""

    def __init__(self, commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S) -> None:
        self._tracker = CommitTracker(commit_timeout_s)
        self._plans = PlanCache()
        #: run -> (root directory of its checkpoints, filesystem), from ``register_run``.
        self._roots: dict[str, tuple[str, Any]] = {}
        #: save_id -> set once the save settled (its files removed, if it failed).
        self._settled: dict[str, asyncio.Event] = {}
        self._watchdog: asyncio.Task | None = None
        self._events: dict[str, list[dict[str, Any]]] = {}

    async def ping(self) -> str:
        return "ok"

    # -- catalog ---------------------------------------------------------------

    async def register_run(self, run: str, run_root: str, filesystem: Any = None) -> list[CatalogEntry]:
        """Make ``run_root`` (where ``run``'s checkpoint directories live) known; scan it (the Checkpointer)."""
        self._roots[run] = (run_root, filesystem)
        return await asyncio.to_thread(self._scan, run)

    def _scan(self, run: str) -> list[CatalogEntry]:
        run_root, fs = self._roots[run]
        found = {e.path: e for e in scan_run(CheckpointDir.resolve(run_root, fs), run)}
        # In-flight and rolled-back saves are not (or no longer) on storage: keep them.
        for e in self._tracker.catalog(run):
            if e.status in (PENDING, FAILED) and e.path not in found:
                found[e.path] = e
        return sorted(found.values(), key=entry_order)

    async def checkpoints(self, run: str) -> list[CatalogEntry]:
        """The run's checkpoints, oldest first, re-read from storage when the run is registered."""
        if run not in self._roots:
            return self._tracker.catalog(run)
        return await asyncio.to_thread(self._scan, run)

    async def latest(self, run: str) -> CatalogEntry | None:
        """The run's newest committed checkpoint; a corrupt or incomplete one is passed over."""
        return latest_committed(await self.checkpoints(run))

    # -- commit protocol -------------------------------------------------------

    async def begin_save(
        self,
        spec: SaveSpec,
        location: str,
        filesystem: Any,
        run: str,
        step: int | None,
        commit_timeout_s: float | None = None,
    ) -> None:
        """Called by rank 0 once per save. A save not committed within
        ``commit_timeout_s`` (default: the actor's) fails."""
        track = self._tracker.begin_save
        settled = await asyncio.to_thread(track, spec, location, filesystem, run, step, commit_timeout_s)
        # Started once the save is registered, so that its first look sees the save pending.
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._expire_loop())
        await self._settle(settled)

    async def report_written(self, save_id: str, shard: WrittenShard, seconds: float, node: str = "") -> None:
        """Called by a ShardWriter when a rank's shard files are durable."""
        known = self._tracker.entry(save_id)
        if known.status != FAILED:  # a failed save's files are removed: not counted as written
            nbytes = shard.nbytes
            metrics.observe("rayckpt_persist_seconds", seconds, run=known.run)
            metrics.inc("rayckpt_bytes_written", nbytes, run=known.run)
            if seconds > 0:
                metrics.observe("rayckpt_write_throughput_bytes_per_second", nbytes / seconds, run=known.run)
        await self._settle(await asyncio.to_thread(self._tracker.report_written, save_id, shard, node))

    async def report_failed(
        self,
        save_id: str,
        rank: int,
        error: str,
        run: str = "",
        step: int | None = None,
        location: str = "",
        filesystem: Any = None,
    ) -> None:
        """Called by a rank or its writer when its part of the save failed.

        ``run``, ``step``, ``location``, ``filesystem``: where the save goes, for a failure
        that arrives before rank 0's registration (its event and its cleanup).
        """
        track = self._tracker.report_failed
        settled = await asyncio.to_thread(track, save_id, rank, error, run, step, location, filesystem)
        await self._settle(settled)

    async def fail_pending(self, run: str, reason: str) -> list[str]:
        """Fail every in-flight save of ``run`` (the Ray Train callback, when the worker group died)."""
        settled = await asyncio.to_thread(self._tracker.fail_pending, run, reason)
        await self._settle(settled)
        return [o.entry.save_id for o in settled]

    async def wait_commit(self, save_id: str, timeout: float | None = None) -> CatalogEntry:
        """Block until the save committed or failed; return its catalog entry (any rank)."""
        try:
            await asyncio.wait_for(self._settled_event(save_id).wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self._tracker.entry(save_id)

    def _settled_event(self, save_id: str) -> asyncio.Event:
        return self._settled.setdefault(save_id, asyncio.Event())

    async def _settle(self, outcomes: list[SaveOutcome]) -> None:
        """Announce saves that settled: cached plans, metrics, events, then wake their waiters."""
        for o in outcomes:
            e = o.entry
            if e.status == COMMITTED:
                self._plans.forget(e.path)  # a new checkpoint replaced whatever was cached there
                metrics.inc("rayckpt_checkpoints_committed", run=e.run)
                data = {"save_id": e.save_id, "step": e.step, "location": e.path, "writer_nodes": o.writer_nodes}
                await self.record_event(e.run, "committed", data)
                metrics.observe("rayckpt_commit_seconds", o.seconds, run=e.run)
            else:
                metrics.inc("rayckpt_checkpoints_failed", run=e.run)
                data = {"save_id": e.save_id, "step": e.step, "location": e.path, "error": e.error}
                await self.record_event(e.run, "failed", data)
            self._settled_event(e.save_id).set()

    async def _expire_loop(self) -> None:
        while self._tracker.has_pending():
            await self._settle(await asyncio.to_thread(self._tracker.expire))
            await asyncio.sleep(_EXPIRE_EVERY_S)

    # -- reshard planning ------------------------------------------------------

    async def read_plan(
        self,
        location: str,
        filesystem: Any,
        requests: tuple[TensorRequest, ...],
        value_keys: tuple[str, ...],
        strict: bool = True,
        run: str = "",
        rank: int | None = None,
        world_size: int | None = None,
    ) -> LoadBundle:
        """A loading rank's read plan for checkpoint ``location``; cached per (checkpoint, request).

        With ``rank`` and ``world_size``, when the requests are FSDP2's dim-0
        shards, the first rank to ask plans every rank at once (vectorized,
        ``BulkPlan``) and the others get their part of that.
        """
        bundle = await asyncio.to_thread(
            self._plans.plan, location, filesystem, requests, value_keys, strict, rank, world_size
        )
        metrics.observe("rayckpt_plan_seconds", bundle.plan_seconds, run=run)
        return bundle

    async def user_metadata(self, location: str, filesystem: Any = None) -> dict[str, Any]:
        """The ``user_metadata`` of a committed checkpoint (step, run, metrics)."""
        m = await asyncio.to_thread(self._plans.manifest, location, filesystem)
        return dict(m.user_metadata)

    async def cached_plans(self) -> int:
        """Plans held: per-request plans plus all-ranks (bulk) plans."""
        return self._plans.cached_plans()

    # -- events (the actor's own, and the controller callback's) -------------------

    async def record_event(self, run: str, kind: str, data: dict[str, Any]) -> None:
        events = self._events.setdefault(run, [])
        events.append({"time": time.time(), "kind": kind, **data})
        del events[:-_EVENTS_KEPT]

    async def events(self, run: str) -> list[dict[str, Any]]:
        return list(self._events.get(run, []))


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
