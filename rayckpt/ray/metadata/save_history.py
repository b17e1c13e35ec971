"""What the MetadataActor remembers of settled saves: a small entry each, a bounded number of them.

Ray-free. A save in flight holds its spec and every rank's chunk records (with
their block checksums: megabytes for a large model); once it settles, the
``CommitTracker`` keeps only its ``SettledSave`` here. ``SaveHistory`` keeps
the newest ``SETTLED_KEPT_PER_RUN`` of each of the ``RUNS_KEPT`` most recently
active runs, so a long-lived actor's memory stays flat however many saves it
commits. Storage stays the truth: committed checkpoints are re-read from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...bounded import BoundedMap
from ...storage.catalog import CatalogEntry

#: Settled saves kept per run (``checkpoints()``, late reports and late waits use them).
SETTLED_KEPT_PER_RUN = 32
#: Runs whose settled saves are kept; the least recently active run is forgotten first.
RUNS_KEPT = 64


@dataclass(frozen=True, slots=True)
class SettledSave:
    """What is kept of a settled save: its entry, its filesystem to remove files reported late, and how long it
    took to settle (from the tracker first hearing of it, by the actor's clock)."""

    entry: CatalogEntry
    filesystem: Any
    seconds: float | None = None


class SaveHistory:
    """Settled saves by id: the newest ``per_run`` of each of the ``runs`` most recently active runs.

    Not thread-safe: its owner's lock guards it.
    """

    def __init__(self, per_run: int = SETTLED_KEPT_PER_RUN, runs: int = RUNS_KEPT) -> None:
        self.per_run = per_run
        #: run -> save id -> settled save, oldest first; runs least recently active first.
        self._by_run: BoundedMap[str, BoundedMap[str, SettledSave]] = BoundedMap(runs)
        self._run_of: dict[str, str] = {}

    def add(self, done: SettledSave) -> None:
        run, save_id = done.entry.run, done.entry.save_id
        self._drop(save_id)
        saves = self._by_run.get(run) or BoundedMap(self.per_run)
        for _, gone_run in self._by_run.put(run, saves):
            for old in gone_run:
                del self._run_of[old]
        self._run_of[save_id] = run
        for old, _ in saves.put(save_id, done):
            del self._run_of[old]

    def get(self, save_id: str) -> SettledSave | None:
        run = self._run_of.get(save_id)
        return None if run is None else self._by_run.peek(run).peek(save_id)

    def of_run(self, run: str) -> list[SettledSave]:
        """``run``'s settled saves, oldest first."""
        saves = self._by_run.peek(run)
        return [] if saves is None else saves.values()

    def run_count(self) -> int:
        return len(self._by_run)

    def __len__(self) -> int:
        return len(self._run_of)

    def _drop(self, save_id: str) -> None:
        run = self._run_of.pop(save_id, None)
        if run is not None:
            self._by_run.peek(run).pop(save_id)
