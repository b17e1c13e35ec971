"""What the MetadataActor remembers of settled saves: a small entry each, a bounded number of them.

Ray-free. A save in flight holds its spec and every rank's chunk records (with
their block checksums: megabytes for a large model); once it settles, the
``CommitTracker`` keeps only its ``SettledSave`` here. ``SaveHistory`` keeps
the newest ``SETTLED_KEPT_PER_RUN`` of each of the ``RUNS_KEPT`` most recently
active runs, so a long-lived actor's memory stays flat however many saves it
commits. Storage stays the truth: committed checkpoints are re-read from it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..storage.catalog import CatalogEntry

#: Settled saves kept per run (``checkpoints()``, late reports and late waits use them).
SETTLED_KEPT_PER_RUN = 32
#: Runs whose settled saves are kept; the least recently active run is forgotten first.
RUNS_KEPT = 64


@dataclass(frozen=True, slots=True)
class SettledSave:
    """What is kept of a settled save: its entry, and its filesystem to remove files reported late."""

    entry: CatalogEntry
    filesystem: Any


class SaveHistory:
    """Settled saves by id: the newest ``per_run`` of each of the ``runs`` most recently active runs.

    Not thread-safe: its owner's lock guards it.
    """

    def __init__(self, per_run: int = SETTLED_KEPT_PER_RUN, runs: int = RUNS_KEPT) -> None:
        self.per_run, self.runs = per_run, runs
        #: run -> save id -> settled save, oldest first; runs least recently active first.
        self._by_run: OrderedDict[str, OrderedDict[str, SettledSave]] = OrderedDict()
        self._run_of: dict[str, str] = {}

    def add(self, done: SettledSave) -> None:
        run, save_id = done.entry.run, done.entry.save_id
        self._drop(save_id)
        saves = self._by_run.setdefault(run, OrderedDict())
        self._by_run.move_to_end(run)
        saves[save_id] = done
        self._run_of[save_id] = run
        while len(saves) > self.per_run:
            del self._run_of[saves.popitem(last=False)[0]]
        while len(self._by_run) > self.runs:
            for old in self._by_run.popitem(last=False)[1]:
                del self._run_of[old]

    def get(self, save_id: str) -> SettledSave | None:
        run = self._run_of.get(save_id)
        return None if run is None else self._by_run[run][save_id]

    def of_run(self, run: str) -> list[SettledSave]:
        """``run``'s settled saves, oldest first."""
        return list(self._by_run.get(run, {}).values())

    def run_count(self) -> int:
        return len(self._by_run)

    def __len__(self) -> int:
        return len(self._run_of)

    def _drop(self, save_id: str) -> None:
        run = self._run_of.pop(save_id, None)
        if run is not None:
            del self._by_run[run][save_id]
