"""The records the ``CommitTracker`` keeps of each save in flight, and what it returns once one settles.

Ray-free. A ``SaveRecord`` is changed only under the tracker's lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ...storage.catalog import CatalogEntry
from ...storage.commit import SaveSpec, WrittenShard

PENDING = "pending"
COMMITTED = "committed"
FAILED = "failed"


@dataclass(frozen=True, slots=True)
class SaveOutcome:
    """A save that settled: committed (manifest written) or failed (its files removed)."""

    entry: CatalogEntry
    #: Node of the ShardWriter that wrote each rank's share.
    writer_nodes: dict[int, str]
    #: From the tracker first hearing of the save until it settled.
    seconds: float


@dataclass(frozen=True, slots=True)
class Removal:
    """Files of a failed save to remove, captured under the lock and removed outside it."""

    location: str
    filesystem: Any
    save_id: str
    paths: tuple[str, ...]


@dataclass(kw_only=True)
class SaveRecord:
    """One save in flight; changed only under the tracker's lock."""

    save_id: str
    started: float
    location: str = ""
    filesystem: Any = None
    run: str = ""
    step: int | None = None
    #: What every rank agreed on (rank 0's registration brings it).
    spec: SaveSpec | None = None
    deadline: float = 0.0
    timeout: float = 0.0
    registered: bool = False
    #: Set while one thread writes the manifest (or asks storage whether an earlier
    #: incarnation did): no second commit, and no failure may remove its files.
    committing: bool = False
    written: dict[int, WrittenShard] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    writer_nodes: dict[int, str] = field(default_factory=dict)
    status: str = PENDING
    error: str | None = None
    total_bytes: int = 0
    #: When the tracker last wrote the save's lease (0: not yet; rank 0's claim stands until then).
    lease_written: float = 0.0
    #: Held while the lease is refreshed, the manifest written or the files removed: no
    #: refresh may bring the lease of a save that settled back.
    io_lock: threading.Lock = field(default_factory=threading.Lock)

    def entry(self) -> CatalogEntry:
        return CatalogEntry(
            run=self.run,
            step=self.step,
            path=self.location,
            status=self.status,
            created=self.started,
            world_size=self.spec.world_size if self.spec else 0,
            bytes=self.total_bytes,
            save_id=self.save_id,
            error=self.error,
        )

    def ready_to_commit(self) -> bool:
        return (
            self.status == PENDING
            and self.registered
            and not self.committing
            and len(self.written) >= self.spec.world_size
        )
