"""The record every report about a save carries across the actors (whose save it is and where it goes), and
the names runs are tracked under, one per tier."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..storage.catalog import CatalogEntry

MEMORY_TIER = "memory"
STORAGE_TIER = "storage"
#: What the MetadataActor's name of a run's memory checkpoints adds to the run's name.
_MEMORY_SUFFIX = "@" + MEMORY_TIER


def tracked_run(run: str, tier: str) -> str:
    """The name the MetadataActor tracks ``run``'s checkpoints of ``tier`` under: ``<run>@memory`` for memory."""
    return run + _MEMORY_SUFFIX if tier == MEMORY_TIER else run


def run_and_tier(tracked: str) -> tuple[str, str]:
    """(run, tier) of a name the MetadataActor tracks (``tracked_run``'s inverse)."""
    if tracked.endswith(_MEMORY_SUFFIX):
        return tracked[: -len(_MEMORY_SUFFIX)], MEMORY_TIER
    return tracked, STORAGE_TIER


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveTarget:
    """Where a save comes from and goes, as a rank, its ShardWriter and the MetadataActor name it.

    Every report about a save carries it (``begin_save``, ``report_written``,
    ``report_failed``, ``wait_commit``), so that an actor that never saw the save
    registered (a report that overtook rank 0's registration, or an actor that
    restarted mid-save) can still name the save and remove its files.
    """

    save_id: str
    run: str = ""
    step: int | None = None
    #: The checkpoint directory as the actors reach it (with ``filesystem``): ``save_handle.actor_location``.
    location: str = ""
    filesystem: Any = None
    #: The rank whose part this report is about; ``None``: the save as a whole.
    rank: int | None = None
    #: The MetadataActor incarnation the save began under (``None``: not known to the sender).
    incarnation: str | None = None

    def for_rank(self, rank: int | None) -> SaveTarget:
        """The same save, as reported by ``rank``."""
        return replace(self, rank=rank)


@dataclass(frozen=True, slots=True)
class CommitAnswer:
    """The MetadataActor's answer to ``wait_commit``: the save's catalog entry and, once it settled, how long
    it took to commit or fail, by the actor's clock from the moment it first heard of the save."""

    entry: CatalogEntry
    seconds: float | None = None
