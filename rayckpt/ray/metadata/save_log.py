"""The moments of each save the MetadataActor sees, for ``rayckpt status`` and a run's timeline picture.

Ray-free. Per save: when the actor first heard of it (``begun``), when rank 0
registered it, when the first rank's ShardWriter took its staged copy (``staged``: the
write's start), when the last rank's files were durable (``written``), how many ranks'
were (``ranks_written``), the longest stall a rank reported (``stall``), and when the
save settled (committed or failed, with the error). The same few numbers whatever the
world size; the newest ``SAVES_KEPT`` saves of each of the ``runs`` most recently
active runs are kept.

Runs are named as the actor tracks them: a memory-tier save's run is ``<run>@memory``
(``records.run_and_tier`` splits it).
"""

from __future__ import annotations

import threading
from typing import Any

from ...bounded import BoundedMap
from ..records import MEMORY_TIER, run_and_tier, tracked_run

#: Saves kept per run.
SAVES_KEPT = 64


class SaveLog:
    """Each save's moments (Unix seconds), by tracked run; thread-safe."""

    def __init__(self, runs: int, per_run: int = SAVES_KEPT) -> None:
        self.per_run = per_run
        self._lock = threading.Lock()
        #: tracked run -> save id -> its record, oldest first.
        self._runs: BoundedMap[str, BoundedMap[str, dict[str, Any]]] = BoundedMap(runs)
        #: save id -> tracked run.
        self._run_of: dict[str, str] = {}

    def _record(self, save_id: str, run: str = "", step: int | None = None) -> dict[str, Any] | None:
        """The record of ``save_id``, made under ``run`` when new (``None``: unknown and no run to make it in)."""
        known = self._run_of.get(save_id)
        if known is not None:
            rec = self._runs.peek(known).peek(save_id)
            if step is not None and rec["step"] is None:
                rec["step"] = step
            return rec
        if not run:
            return None
        base, tier = run_and_tier(run)
        rec = {"save_id": save_id, "run": base, "tier": tier, "step": step, "begun": None, "registered": None}
        rec.update(staged=None, written=None, ranks_written=0, stall=None, settled=None, status="pending", error=None)
        rec["bytes"] = 0
        saves = self._runs.get(run) or BoundedMap(self.per_run)
        for _, gone in self._runs.put(run, saves):
            for old in gone:
                self._run_of.pop(old, None)
        for old, _ in saves.put(save_id, rec):
            self._run_of.pop(old, None)
        self._run_of[save_id] = run
        return rec

    def heard(self, save_id: str, run: str, step: int | None, at: float, registered: bool = False) -> None:
        """The actor heard of the save (a registration, or a rank's report that came first)."""
        with self._lock:
            rec = self._record(save_id, run, step)
            if rec is None:
                return
            rec["begun"] = at if rec["begun"] is None else min(rec["begun"], at)
            if registered:
                rec["registered"] = at

    def written(self, save_id: str, at: float, seconds: float, nbytes: int) -> None:
        """A rank's files are durable at ``at``: ``nbytes``, its ShardWriter took ``seconds``."""
        with self._lock:
            rec = self._record(save_id)
            if rec is not None:
                staged = at - seconds
                rec["staged"] = staged if rec["staged"] is None else min(rec["staged"], staged)
                rec["written"] = at if rec["written"] is None else max(rec["written"], at)
                rec["ranks_written"] += 1
                rec["bytes"] += nbytes

    def stalled(self, save_id: str, seconds: float) -> None:
        """A rank was blocked ``seconds`` by the save (its own measure, sent when it waits for the outcome)."""
        with self._lock:
            rec = self._record(save_id)
            if rec is not None:
                rec["stall"] = seconds if rec["stall"] is None else max(rec["stall"], seconds)

    def settled(self, save_id: str, run: str, step: int | None, at: float, **outcome: Any) -> None:
        """The save committed or failed at ``at``: ``status``, ``error``, ``bytes``."""
        with self._lock:
            rec = self._record(save_id, run, step)
            if rec is not None:
                rec.update(settled=at, **outcome)
                if rec["begun"] is None:
                    rec["begun"] = at

    def of_run(self, run: str) -> list[dict[str, Any]]:
        """The saves of ``run`` (its name, both tiers), oldest first by when they began; copies."""
        with self._lock:
            found = []
            for tracked in (run, tracked_run(run, MEMORY_TIER)):
                saves = self._runs.peek(tracked)
                found += [] if saves is None else [dict(r) for r in saves.values()]
        return sorted(found, key=lambda r: r["begun"] or 0.0)

    def __len__(self) -> int:
        """Saves held, every run together."""
        with self._lock:
            return len(self._run_of)

    def runs(self) -> list[str]:
        """Every run with a save here (by name, each tier folded in), most recently active last."""
        with self._lock:
            names = [run_and_tier(tracked)[0] for tracked, _ in self._runs.items()]
        return list(dict.fromkeys(reversed(names)))[::-1]
