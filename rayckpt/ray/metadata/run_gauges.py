"""The gauges the MetadataActor keeps set for each run and tier, between saves as well as at them, and the
counters of a run's rare events that it exports at 0 (``start_counters``).

Ray's export drops a gauge not set for two report intervals, and an age must move
while nothing happens: ``refresh`` sets every one again (the actor calls it every
``REFRESH_S``). Per (run, tier): the last shard write's throughput, when the newest
committed checkpoint committed and its age, and the saves in flight. The
``runs`` most recently active runs are kept.
"""

from __future__ import annotations

import time
from typing import Any

from ...bounded import BoundedMap
from .. import metrics
from ..records import run_and_tier
from ..status.report import Newest

#: How often the actor sets the gauges again.
REFRESH_S = 1.0


class RunGauges:
    """Per (run, tier): throughput, newest commit, saves in flight; ``refresh`` exports them all."""

    def __init__(self, runs: int) -> None:
        self._throughput: BoundedMap[tuple[str, str], float] = BoundedMap(runs)
        self._newest: BoundedMap[tuple[str, str], Newest] = BoundedMap(runs)
        #: (run, tier) with a save seen (in flight, written or committed): its count is set, 0 when none flies.
        self._flying: BoundedMap[tuple[str, str], int] = BoundedMap(runs)

    def throughput(self, tracked: str, bytes_per_second: float) -> None:
        """The last shard write of ``tracked`` (a run as the actor tracks it) ran at ``bytes_per_second``."""
        key = run_and_tier(tracked)
        self._flying.put(key, 0)
        self._throughput.put(key, bytes_per_second)
        metrics.observe("rayckpt_write_throughput_bytes_per_second", bytes_per_second, run=key[0], tier=key[1])

    def committed(self, tracked: str, step: int | None, path: str, at: float) -> None:
        """A checkpoint of ``tracked`` committed at ``at`` (or was found committed on storage): kept if newest."""
        key = run_and_tier(tracked)
        self._flying.put(key, 0)
        held = self._newest.peek(key)
        if held is None or at >= held.at:
            self._newest.put(key, Newest(step=step, path=path, at=at))
            self._export_newest(key, self._newest.peek(key), time.time())

    def newest(self) -> dict[tuple[str, str], Newest]:
        """(run, tier) -> its newest committed checkpoint."""
        return dict(self._newest.items())

    def refresh(self, in_flight: dict[str, int], now: float | None = None) -> None:
        """Set every gauge again; ``in_flight``: saves in flight per tracked run (runs with none left out)."""
        now = time.time() if now is None else now
        for (run, tier), value in self._throughput.items():
            metrics.observe("rayckpt_write_throughput_bytes_per_second", value, run=run, tier=tier)
        for key, newest in self._newest.items():
            self._export_newest(key, newest, now)
        counts = {run_and_tier(tracked): n for tracked, n in in_flight.items()}
        for key in counts:
            self._flying.put(key, 0)
        for key, _ in self._flying.items():
            metrics.observe("rayckpt_saves_in_flight", counts.get(key, 0), run=key[0], tier=key[1])

    @staticmethod
    def _export_newest(key: tuple[str, str], newest: Any, now: float) -> None:
        run, tier = key
        metrics.observe("rayckpt_last_commit_timestamp_seconds", newest.at, run=run, tier=tier)
        metrics.observe("rayckpt_checkpoint_age_seconds", max(0.0, now - newest.at), run=run, tier=tier)


def start_counters(tracked: str) -> None:
    """Export the counters of the rare events of ``tracked`` (a run as the actor tracks it) at 0 before their
    first event, so that Prometheus sees them increase (``increase()`` counts nothing at a series' first sample)."""
    run, tier = run_and_tier(tracked)
    for name in ("rayckpt_checkpoints_committed", "rayckpt_checkpoints_failed"):
        metrics.start_at_zero(name, run=run, tier=tier)
    metrics.start_at_zero("rayckpt_restore_fallbacks", run=run)
    for why in ("busy", "no_room"):
        metrics.start_at_zero("rayckpt_memory_saves_skipped", run=run, reason=why)
    for source in ("memory_local", "memory_peer", "storage"):
        metrics.start_at_zero("rayckpt_restored_bytes", run=run, tier=source)
