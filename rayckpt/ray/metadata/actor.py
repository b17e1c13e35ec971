"""The MetadataActor: one per Ray namespace, the coordinator of saves and loads through the actors.

Named ``rayckpt-metadata``, detached, async, on the head node: a thin Ray shell over
the Ray-free parts of ``metadata`` (the commit tracker, the plan and layout caches;
the catalog, ``storage.catalog``, re-read from storage, which stays the truth), called
from worker threads (they do the storage I/O). The shell adds what needs Ray or the
event loop: ``wait_commit``, the watchdog that expires late saves, metrics, events.
Ray restarts it when it dies, with an empty state and a new incarnation id
(docs/internals.md, "When the MetadataActor restarts mid-save").
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from typing import Any

import ray

from ...bounded import BoundedMap
from ...format.file_paths import written_bytes
from ...redaction import redact
from ...storage.catalog import CatalogEntry, entry_order, latest_committed, scan_run
from ...storage.checkpoint_dir import CheckpointDir
from ...storage.commit import SaveSpec, WrittenShard
from .. import metrics
from ..actors import HEAD_NODE_RESOURCE, METADATA_ACTOR_NAME, NAMESPACE, named
from ..records import CommitAnswer, SaveTarget, run_and_tier
from ..status import published
from .attempts import AttemptCounter
from .commit_tracker import COMMITTED, FAILED, PENDING, CommitTracker, SaveOutcome
from .grafana import install_dashboard_soon
from .layout_cache import LAYOUT_WANTED, LayoutRef, SaveLayouts, ShardReport, SpecLayout, join_shard, join_spec
from .plan_cache import LoadBundle, PlanCache, ReadAsk
from .run_gauges import REFRESH_S, RunGauges, start_counters
from .save_history import RUNS_KEPT
from .save_log import SaveLog
from .views import OperatorViews, show_commits_in_log

logger = logging.getLogger(__name__)

DEFAULT_COMMIT_TIMEOUT_S = 600.0

#: How often the watchdog looks for saves past their deadline.
_EXPIRE_EVERY_S = 0.5
#: How often the runs' gauges are set again (``run_gauges``).
_GAUGE_REFRESH_S = REFRESH_S


class MetadataActor(OperatorViews):
    """Catalog, commit protocol and reshard planning service (an async Ray actor).

    Callers, in a save's order: every rank's ``incarnation()`` and rank 0's ``begin_save``;
    each rank's ShardWriter's ``report_written`` (``report_failed``: the writer's or the
    rank's); every rank's ``wait_commit``. Loads: every rank's ``read_plan``. The
    ``Checkpointer``: ``register_run``, ``begin_attempt``, ``user_metadata``, ``data_position``. The
    ``RayckptCallback``: ``fail_pending``, ``record_event``. Every rank's events for the metrics:
    ``record_metrics``. Operators: ``checkpoints``, ``latest``,
    ``events``, ``status``, ``timeline``, ``debug_stats`` (docs/internals.md, "The MetadataActor's interface").

    Args:
        commit_timeout_s: How long a save may take to commit unless its registration says.
    """

    def __init__(self, commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S) -> None:
        show_commits_in_log()
        #: This incarnation's id: a restart starts a new one, which knows none of the earlier one's saves.
        self._incarnation = uuid.uuid4().hex[:12]
        self._tracker = CommitTracker(commit_timeout_s)
        self._plans = PlanCache()
        self._layouts = SaveLayouts()
        #: run -> (root directory of its checkpoints, filesystem), from ``register_run``.
        self._roots: dict[str, tuple[str, Any]] = {}
        #: save_id -> an event per ``wait_commit`` waiting for it, set once the save settled.
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._watchdog: asyncio.Task | None = None
        #: run -> its last ``views.EVENTS_KEPT`` events; the ``RUNS_KEPT`` most recently active runs.
        self._events: BoundedMap[str, list[dict[str, Any]]] = BoundedMap(RUNS_KEPT)
        #: Per run and tier: throughput, newest commit, saves in flight (the ``RUNS_KEPT`` most recent runs).
        self._gauges = RunGauges(RUNS_KEPT)
        #: Each save's moments (``rayckpt status --plot``).
        self._log = SaveLog(RUNS_KEPT)
        #: Worker groups started per Ray Train run id, the ``RUNS_KEPT`` most recent.
        self._attempts = AttemptCounter(RUNS_KEPT)
        self._gauge_refresher: asyncio.Task | None = None
        install_dashboard_soon()  # where the head's Grafana looks (never fails the actor, never waited for)

    def __repr__(self) -> str:
        """The Ray dashboard's Repr column and the prefix of this actor's log lines: Ray takes it once, as the
        actor starts (a restart: a new incarnation); its runs and commits are in ``rayckpt status``."""
        return f"MetadataActor(incarnation={self._incarnation})"

    async def ping(self) -> str:
        """``"ok"``: the actor answers (operators, benchmarks)."""
        self._keep_gauges()
        return "ok"

    async def incarnation(self) -> str:
        """This incarnation's id (every rank, when a save begins: it tags the save's reports and waits)."""
        self._keep_gauges()
        return self._incarnation

    # -- catalog ---------------------------------------------------------------

    async def register_run(self, run: str, run_root: str, filesystem: Any = None) -> list[CatalogEntry]:
        """Make ``run_root`` (on ``filesystem``) known as where ``run``'s checkpoints live (every rank's
        ``Checkpointer``); return the run's checkpoints, oldest first, scanned from storage now."""
        self._roots[run] = (run_root, filesystem)
        found = await asyncio.to_thread(self._scan, run)
        newest = latest_committed(found)
        if newest is not None:  # when it committed is not on storage: when its save began stands in
            self._gauges.committed(run, newest.step, newest.path, newest.created)
        start_counters(run)
        self._keep_gauges()
        return found

    async def record_metrics(self, samples: list[tuple[str, float, dict[str, str]]]) -> None:
        """Record events training workers saw: (metric, value, tags) each (``metrics.send``: a stall, a restore,
        a load; every rank, not waited for). Here, in a process that lives as long as the cluster, they reach
        the export port even when the worker ends before Ray's next report of its own metrics."""
        for name, value, tags in samples:
            metrics.record(name, value, **tags)

    def _scan(self, run: str) -> list[CatalogEntry]:
        run_root, fs = self._roots[run]
        found = {e.path: e for e in scan_run(CheckpointDir.resolve(run_root, fs), run)}
        # In-flight and rolled-back saves are not (or no longer) on storage: keep them.
        for e in self._tracker.catalog(run):
            if e.status in (PENDING, FAILED) and e.path not in found:
                found[e.path] = e
        return sorted(found.values(), key=entry_order)

    async def checkpoints(self, run: str) -> list[CatalogEntry]:
        """The run's checkpoints, oldest first (operators): re-read from storage when the run is
        registered, else the saves this incarnation tracks."""
        if run not in self._roots:
            return self._tracker.catalog(run)
        return await asyncio.to_thread(self._scan, run)

    async def latest(self, run: str) -> CatalogEntry | None:
        """The run's newest committed checkpoint (operators); a corrupt or incomplete one is passed over."""
        return latest_committed(await self.checkpoints(run))

    # -- commit protocol -------------------------------------------------------

    async def begin_save(
        self,
        spec: SaveSpec,
        target: SaveTarget,
        commit_timeout_s: float | None = None,
        layout: LayoutRef | None = None,
    ) -> str:
        """Register a save (rank 0, once per save, not waited for).

        Args:
            spec: what every rank agreed on (without its tensors and paths when ``layout`` is given).
            target: the save's run, step, location and filesystem.
            commit_timeout_s: the save fails unless committed within it (default: the actor's).
            layout: the save's layout (``layout_cache``), fetched from rank 0's object store
                only if this actor lacks it.

        Returns:
            This incarnation's id.
        """
        if layout is not None:
            spec = join_spec(spec, await self._layout(layout, spec, target.run, target.step))
        self._log.heard(spec.save_id, target.run, target.step, time.time(), registered=True)
        self._keep_gauges()
        settled = await asyncio.to_thread(self._tracker.begin_save, spec, target, commit_timeout_s)
        self._watch()  # once the save is registered, so that the watchdog's first look sees it pending
        await self._settle(settled)
        return self._incarnation

    async def _layout(self, layout: LayoutRef, spec: SaveSpec, run: str, step: int | None) -> SpecLayout:
        """The layout of ``layout.digest``: held, else fetched from rank 0 (its first save here) and kept."""
        held = self._layouts.specs.get(layout.digest)
        if held is None:
            try:
                fetched = await layout.ref
            except Exception as exc:  # noqa: BLE001 - any failure to fetch fails this save, named
                fetched = exc
            held = self._layouts.add_spec(layout.digest, fetched, spec.save_id, run, step)
        return held

    async def report_written(
        self, target: SaveTarget, shard: WrittenShard | ShardReport, seconds: float, node: str = ""
    ) -> str | None:
        """A rank's shard files are durable (its ShardWriter).

        Args:
            target: the save; its ``incarnation`` is the id the rank heard when the save
                began, and its run, step, location and filesystem name a save this
                incarnation does not know (and remove its files if it never commits).
            shard: what the rank wrote, or its ``ShardReport`` (``layout_cache``).
            seconds: how long the writer took.
            node: the writer's node.

        Returns:
            ``LAYOUT_WANTED`` (nothing else done) when ``shard`` comes without a chunk layout
            this actor lacks: the writer sends it again with the layout; else ``None``.
        """
        if isinstance(shard, ShardReport):
            joined = await self._written_shard(shard)
            if joined is None:
                return LAYOUT_WANTED
            shard = joined
        known = self._tracker.entry(target.save_id)
        now = time.time()
        self._log.heard(target.save_id, known.run or target.run, known.step, now - seconds)
        nbytes = written_bytes(target.save_id, shard.files)  # not the files it shares with earlier saves
        self._log.written(target.save_id, now, seconds, nbytes)
        if known.status != FAILED:  # a failed save's files are removed: not counted as written
            run, tier = run_and_tier(known.run or target.run)
            metrics.observe("rayckpt_persist_seconds", seconds, run=run, tier=tier)
            metrics.inc("rayckpt_bytes_written", nbytes, run=run, tier=tier)
            if seconds > 0:
                self._gauges.throughput(known.run or target.run, nbytes / seconds)
                self._keep_gauges()
        settled = await asyncio.to_thread(self._tracker.report_written, target, shard, node)
        if self._restarted_since(target.incarnation):
            reason = self._lost_reason(target.incarnation)
            settled += await asyncio.to_thread(self._tracker.lost, target.for_rank(shard.rank), reason)
        self._watch()  # a save nobody registered expires too
        await self._settle(settled)
        return None

    async def _written_shard(self, report: ShardReport) -> WrittenShard | None:
        """The rank's ``WrittenShard`` from its report: ``None`` when its chunk layout is neither held nor sent."""
        layout = self._layouts.chunk_layout(report)
        return None if layout is None else await asyncio.to_thread(join_shard, report, layout)

    async def report_failed(self, target: SaveTarget, error: str) -> None:
        """A rank's part of the save failed (the rank, or its writer).

        Args:
            target: the save and the rank that failed; where the save goes, for a failure
                that arrives before rank 0's registration (its event and its cleanup).
            error: what failed.
        """
        settled = await asyncio.to_thread(self._tracker.report_failed, target, error)
        await self._settle(settled)

    async def fail_pending(self, run: str, reason: str) -> list[str]:
        """Fail ``run``'s in-flight saves, files removed; their ids (``RayckptCallback``, rank 0's ``Checkpointer``)."""
        settled = await asyncio.to_thread(self._tracker.fail_pending, run, reason)
        await self._settle(settled)
        return [o.entry.save_id for o in settled]

    async def wait_commit(
        self, target: SaveTarget, timeout: float | None = None, stall: float | None = None
    ) -> CommitAnswer:
        """Block until the save committed or failed (every rank).

        Args:
            target: the save, as the asking rank knows it. A save begun under another
                incarnation than ``target.incarnation`` (this actor restarted since) is
                settled at once, its rank, run, step, location and filesystem saying whose
                and where.
            timeout: seconds to wait at most (``None``: until it settles).
            stall: how long the save blocked the asking rank (kept for ``timeline``).

        Returns:
            The save's catalog entry ("pending" if it did not settle in time) and, once it
            settled, how long it took by this actor's clock (what rank 0's commit line prints).
        """
        save_id = target.save_id
        if stall is not None and target.rank is not None:
            self._log.stalled(save_id, stall)
        if self._restarted_since(target.incarnation):
            reason = self._lost_reason(target.incarnation)
            await self._settle(await asyncio.to_thread(self._tracker.lost, target, reason))
        if self._tracker.entry(save_id).status == PENDING:
            waiters = self._waiters.setdefault(save_id, set())
            settled = asyncio.Event()
            waiters.add(settled)
            try:
                await asyncio.wait_for(settled.wait(), timeout)
            except TimeoutError:
                pass
            finally:
                waiters.discard(settled)
                if not waiters and self._waiters.get(save_id) is waiters:
                    del self._waiters[save_id]
        return CommitAnswer(self._tracker.entry(save_id), self._tracker.settled_seconds(save_id))

    def _keep_gauges(self) -> None:
        """Start setting the runs' gauges and publishing ``status()`` (``published``) every ``_GAUGE_REFRESH_S``."""
        if self._gauge_refresher is None or self._gauge_refresher.done():
            self._gauge_refresher = asyncio.get_running_loop().create_task(self._refresh_gauges())

    async def _refresh_gauges(self) -> None:
        while True:
            flying: dict[str, int] = {}
            for save in self._tracker.in_flight():
                flying[save["run"]] = flying.get(save["run"], 0) + 1
            self._gauges.refresh(flying)
            published.publish(published.METADATA_KEY, await self.status())
            await asyncio.sleep(_GAUGE_REFRESH_S)

    def _restarted_since(self, incarnation: str | None) -> bool:
        """Whether a save begun when the actor was ``incarnation`` began under another incarnation."""
        return incarnation is not None and incarnation != self._incarnation

    def _lost_reason(self, incarnation: str | None) -> str:
        return (
            f"the MetadataActor restarted while this save was in flight (it began under incarnation "
            f"{incarnation}, this is {self._incarnation}), so it cannot commit; save again"
        )

    def _watch(self) -> None:
        """Start the watchdog unless it runs (it stops once nothing is in flight)."""
        if (self._watchdog is None or self._watchdog.done()) and self._tracker.has_pending():
            self._watchdog = asyncio.get_running_loop().create_task(self._expire_loop())

    async def _settle(self, outcomes: list[SaveOutcome]) -> None:
        """Announce saves that settled: cached plans, metrics, events, then wake their waiters."""
        now = time.time()
        for o in outcomes:
            e = o.entry
            run, tier = run_and_tier(e.run)
            self._log.settled(e.save_id, e.run, e.step, now, status=e.status, error=e.error, bytes=e.bytes)
            if e.status == COMMITTED:
                self._plans.forget(e.path)  # a new checkpoint replaced whatever was cached there
                metrics.inc("rayckpt_checkpoints_committed", run=run, tier=tier)
                self._gauges.committed(e.run, e.step, e.path, now)
                self._keep_gauges()
                data = {"save_id": e.save_id, "step": e.step, "location": e.path, "writer_nodes": o.writer_nodes}
                await self.record_event(e.run, "committed", data)
                metrics.observe("rayckpt_commit_seconds", o.seconds, run=run, tier=tier)
                logger.info(
                    "committed step %s of run %r: %s (%d bytes from %d ranks, %.2f s after the save began)",
                    e.step,
                    e.run,
                    redact(e.path),
                    e.bytes,
                    e.world_size,
                    o.seconds,
                )
            else:
                logger.warning(
                    "save %s of run %r (step %s) to %s failed and was rolled back (its files removed): %s",
                    e.save_id,
                    e.run,
                    e.step,
                    redact(e.path),
                    e.error,
                )
                metrics.inc("rayckpt_checkpoints_failed", run=run, tier=tier)
                data = {"save_id": e.save_id, "step": e.step, "location": e.path, "error": e.error}
                await self.record_event(e.run, "failed", data)
            for settled in self._waiters.pop(e.save_id, ()):
                settled.set()

    async def _expire_loop(self) -> None:
        while self._tracker.has_pending():
            await asyncio.to_thread(self._tracker.refresh_leases)
            await self._settle(await asyncio.to_thread(self._tracker.expire))
            await asyncio.sleep(_EXPIRE_EVERY_S)

    # -- reshard planning ------------------------------------------------------

    async def read_plan(self, location: str, filesystem: Any, ask: ReadAsk, run: str = "") -> LoadBundle:
        """A loading rank's read plan for checkpoint ``location``, cached per (checkpoint, request) (every rank).

        Args:
            location: The checkpoint directory, as the actors reach it.
            filesystem: The ``pyarrow.fs`` filesystem ``location`` is a path on.
            ask: What the rank asks for, and which rank of how many it is (``ReadAsk``).
            run: The run whose metrics count the planning time.

        Returns:
            The rank's ``LoadBundle``: its plan and the manifest facts it needs.
        """
        bundle = await asyncio.to_thread(self._plans.plan, location, filesystem, ask)
        metrics.observe("rayckpt_plan_seconds", bundle.plan_seconds, run=run_and_tier(run)[0])
        return bundle

    async def user_metadata(self, location: str, filesystem: Any = None) -> dict[str, Any]:
        """The ``user_metadata`` of a committed checkpoint: step, run, metrics (``Checkpointer.restore``)."""
        m = await asyncio.to_thread(self._plans.manifest, location, filesystem)
        return dict(m.user_metadata)

    async def data_position(self, location: str, filesystem: Any = None) -> dict[str, Any] | None:
        """The ``data_position`` of a committed checkpoint (None: saved without one; ``Checkpointer.restore``)."""
        m = await asyncio.to_thread(self._plans.manifest, location, filesystem)
        return m.data_position

    async def cached_plans(self) -> int:
        """Plans held: per-request plans plus all-ranks (bulk) plans (operators, tests)."""
        return self._plans.cached_plans()


def get_metadata_actor(commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S) -> Any:
    """The namespace's MetadataActor, created on first use (detached, 0 CPUs, on the head node).

    Args:
        commit_timeout_s: the actor's default commit timeout, if this call creates it.

    Returns:
        Its handle (``actors.named``: Ray's cached handle while the actor lives).
    """
    return named(METADATA_ACTOR_NAME, functools.partial(_create_metadata_actor, commit_timeout_s))


@functools.cache
def _remote_class() -> Any:
    return ray.remote(MetadataActor)


def _create_metadata_actor(commit_timeout_s: float) -> Any:
    return (
        _remote_class()
        .options(
            name=METADATA_ACTOR_NAME,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            # On the head node, as Ray Train's own state actor: a worker node's death (the failure a run
            # must recover from) then never takes the catalog and commit protocol down with it.
            resources={HEAD_NODE_RESOURCE: 0.001},
            max_concurrency=1000,
            max_restarts=-1,
        )
        .remote(commit_timeout_s)
    )
