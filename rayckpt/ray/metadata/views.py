"""The MetadataActor's events and what it shows operators: each run's events (``record_event``, ``events``),
``rayckpt status`` (``status``), a run's timeline (``timeline``) and the records it holds (``debug_stats``).

A mixin of ``MetadataActor``: it reads the actor's tracker, gauges, save log and events.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ...bounded import BoundedMap
from ...redaction import redact_fields
from ..records import MEMORY_TIER, STORAGE_TIER, run_and_tier, tracked_run
from ..status.report import run_status
from .attempts import AttemptCounter
from .commit_tracker import CommitTracker
from .layout_cache import SaveLayouts
from .plan_cache import PlanCache
from .run_gauges import RunGauges
from .save_log import SaveLog

logger = logging.getLogger("rayckpt.ray.metadata.actor")

#: Events kept per run.
EVENTS_KEPT = 100


class OperatorViews:
    """Events, ``status``, ``timeline`` and ``debug_stats``, for the actor that holds ``_tracker``, ``_gauges``,
    ``_log``, ``_events``, ``_attempts``, ``_waiters``, ``_plans`` and ``_layouts`` (and ``fail_pending``)."""

    _incarnation: str
    _tracker: CommitTracker
    _gauges: RunGauges
    _log: SaveLog
    _events: BoundedMap[str, list[dict[str, Any]]]
    _attempts: AttemptCounter
    _waiters: dict[str, set[Any]]
    _plans: PlanCache
    _layouts: SaveLayouts

    async def debug_stats(self) -> dict[str, Any]:
        """Records held and this process's resident memory: operators and tests check both stay flat."""
        import psutil  # a dependency of Ray's

        return {
            "incarnation": self._incarnation,
            "pid": os.getpid(),
            "rss_bytes": psutil.Process().memory_info().rss,
            **self._tracker.counts(),
            "waited_saves": len(self._waiters),
            "event_runs": len(self._events),
            "events": sum(len(e) for e in self._events.values()),
            "logged_saves": len(self._log),
            **self._plans.counts(),
            **self._layouts.counts(),
        }

    # -- events (the actor's own, and the controller callback's) -------------------

    async def begin_attempt(self, run: str, attempt_key: str, world_size: int) -> int:
        """A worker group of ``world_size`` ranks of training run ``attempt_key`` starts (rank 0's
        ``Checkpointer``): return how many started before it; from the second on, fail ``run``'s saves
        still in flight (``attempts``: why)."""
        restarts = self._attempts.begin(attempt_key)
        reason = f"its worker group was replaced (Ray Train restart {restarts})"
        # ``fail_pending`` is the actor's own
        failed = await self.fail_pending(run, reason) if restarts else []  # type: ignore[attr-defined]
        event = {"restarts": restarts, "world_size": world_size, "failed_saves": failed}
        await self.record_event(run, "started", event)
        return restarts

    async def record_event(self, run: str, kind: str, data: dict[str, Any]) -> None:
        """Add an event ``kind`` with ``data`` to ``run``'s log (the ``RayckptCallback``, ``Checkpointer``)."""
        events = self._events.get(run) or []
        events.append({"time": time.time(), "kind": kind, **redact_fields(data)})
        del events[:-EVENTS_KEPT]
        self._events.put(run, events)

    async def events(self, run: str) -> list[dict[str, Any]]:
        """``run``'s last events, oldest first: ``time``, ``kind`` and its data (operators, tests)."""
        return list(self._events.peek(run) or [])

    async def status(self) -> dict[str, Any]:
        """Every run this incarnation knows: ``status_report.run_status`` each (newest checkpoint per tier,
        saves in flight, recent failures and restores), with the time and this incarnation."""
        now = time.time()
        newest: dict[str, dict[str, Any]] = {}
        for (run, tier), n in self._gauges.newest().items():
            newest.setdefault(run, {})[tier] = n
        flying: dict[str, list[dict[str, Any]]] = {}
        for save in self._tracker.in_flight():
            flying.setdefault(run_and_tier(save["run"])[0], []).append(save)
        names = [*self._log.runs(), *newest, *flying]
        names += [run_and_tier(tracked)[0] for tracked, _ in self._events.items()]
        runs = [
            run_status(run, newest.get(run, {}), flying.get(run, []), self._tier_events(run), now)
            for run in dict.fromkeys(names)
        ]
        return {"time": now, "incarnation": self._incarnation, "pid": os.getpid(), "runs": runs}

    async def timeline(self, run: str) -> dict[str, Any]:
        """``run``'s saves with their moments (``save_log``), both tiers, and its events (``rayckpt status --plot``)."""
        return {"run": run, "saves": self._log.of_run(run), "events": self._tier_events(run)}

    def _tier_events(self, run: str) -> list[dict[str, Any]]:
        """``run``'s events of both tiers, oldest first, each with its ``tier``."""
        found = []
        for tier in (STORAGE_TIER, MEMORY_TIER):
            found += [{**e, "tier": e.get("tier", tier)} for e in self._events.peek(tracked_run(run, tier)) or []]
        return sorted(found, key=lambda e: e["time"])


def show_commits_in_log() -> None:
    """Let the actor's commit (INFO) and rollback (WARNING) lines reach its log file.

    Ray leaves an actor's logging unconfigured unless the job passes a ``ray.LoggingConfig``
    (INFO lines would be dropped). Without a root handler this logger writes to stderr: the
    actor's ``worker-*.err`` under ``<session>/logs`` (the dashboard's Actors page).
    """
    logger.setLevel(logging.INFO)
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s rayckpt.metadata_actor: %(message)s"))
        logger.addHandler(handler)
