"""The commit protocol of saves through the Ray actors: each save's state, from first report to outcome.

Ray-free and asyncio-free; the MetadataActor is its one caller. A save commits
once rank 0 registered it (``begin_save``, bringing the ``SaveSpec``) and every
rank's shard files are durable (``report_written``), in either order. It fails
when a rank reports a failure (``report_failed``), when its run's workers died
(``fail_pending``) or when it is not committed by its deadline (``expire``);
its files are then removed, and files reported after that are removed too.

Rank 0 claimed the save's location (a lease file, ``storage.lease``) before any
rank wrote; from the registration on, the tracker keeps that lease fresh
(``refresh_leases``, from the actor's watchdog) and releases it once the save
committed or failed, so another run's save to the same location is refused
while this one is in flight.

The tracker does the storage work itself, through the two functions it is
given (``commit_save`` and ``remove_failed_save`` by default), and outside its
lock: the actor calls it from worker threads. Each call returns the saves it
settled (``SaveOutcome``), for the actor to turn into events, metrics and
wake-ups. Storage stays the truth; the tracker only knows the saves it saw.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..format.manifest import Manifest
from ..storage.catalog import CatalogEntry, entry_order
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import SaveSpec, WrittenShard, commit_save, remove_failed_save
from ..storage.lease import HELD, LEASE_TTL_S, release_lease, write_lease

PENDING = "pending"
COMMITTED = "committed"
FAILED = "failed"

#: ``commit_save``'s signature: write the manifest of a save from every rank's shard.
CommitFn = Callable[[CheckpointDir, SaveSpec, Iterable[WrittenShard]], Manifest]
#: ``remove_failed_save``'s signature: remove a failed save's files (the given ones and its id's).
RemoveFn = Callable[[CheckpointDir, str, Sequence[str]], None]


@dataclass(frozen=True, slots=True)
class SaveOutcome:
    """A save that settled: committed (manifest written) or failed (its files removed)."""

    entry: CatalogEntry
    #: Node of the ShardWriter that wrote each rank's share.
    writer_nodes: dict[int, str]
    #: From the tracker first hearing of the save until it settled.
    seconds: float


@dataclass(frozen=True, slots=True)
class _Removal:
    """Files of a failed save to remove, captured under the lock and removed outside it."""

    location: str
    filesystem: Any
    save_id: str
    paths: tuple[str, ...]


@dataclass
class _Save:
    """One save's state; changed only under the tracker's lock."""

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
    #: Set while one thread writes the manifest: no second commit, and no failure
    #: may remove the files the manifest is about to name.
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


class CommitTracker:
    """Every save the MetadataActor has heard of, and the catalog entries of those with a location.

    Thread-safe: one lock guards the state, and storage I/O runs outside it.
    """

    def __init__(
        self,
        default_timeout_s: float,
        *,
        commit: CommitFn = commit_save,
        remove: RemoveFn = remove_failed_save,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``default_timeout_s``: how long a registered save may take to commit, unless its
        registration says otherwise. ``clock``: wall time in seconds (tests pass their own)."""
        self._default_timeout_s = default_timeout_s
        self._commit_fn = commit
        self._remove_fn = remove
        self._clock = clock
        self._lock = threading.Lock()
        self._saves: dict[str, _Save] = {}
        #: run -> location -> the entry of the last tracked save there.
        self._catalog: dict[str, dict[str, CatalogEntry]] = {}

    # -- reports (each returns the saves it settled) -----------------------------

    def begin_save(
        self,
        spec: SaveSpec,
        location: str,
        filesystem: Any,
        run: str,
        step: int | None,
        timeout_s: float | None = None,
    ) -> list[SaveOutcome]:
        """Register a save (rank 0, once per save, through the actor); commits it if every rank
        already reported. It fails unless committed within ``timeout_s`` (default: the tracker's)."""
        with self._lock:
            s = self._save(spec.save_id)
            s.spec, s.location, s.filesystem, s.run, s.step = spec, location, filesystem, run, step
            s.timeout = timeout_s or self._default_timeout_s
            s.deadline = self._clock() + s.timeout
            s.registered = True
            self._note(s)
            ready = s.ready_to_commit()
            if ready:
                s.committing = True
        return self._commit(s) if ready else []

    def report_written(self, save_id: str, shard: WrittenShard, node: str = "") -> list[SaveOutcome]:
        """A rank's shard files are durable (its ShardWriter, through the actor); commits the
        save when it was the last one missing. Files of a save that already failed are removed."""
        with self._lock:
            s = self._save(save_id)
            s.writer_nodes[shard.rank] = node
            late = s.status == FAILED
            if late:
                removal = self._removal(s, [f.path for f in shard.files])
            else:
                s.written[shard.rank] = shard
            ready = not late and s.ready_to_commit()
            if ready:
                s.committing = True
        if late:
            self._remove(removal)
            return []
        return self._commit(s) if ready else []

    def report_failed(
        self,
        save_id: str,
        rank: int,
        error: str,
        run: str = "",
        step: int | None = None,
        location: str = "",
        filesystem: Any = None,
    ) -> list[SaveOutcome]:
        """A rank's part of the save failed (the rank or its writer, through the actor).

        ``run``, ``step``, ``location``, ``filesystem``: where the save goes, for a
        failure that arrives before rank 0's registration (its catalog entry and
        its cleanup).
        """
        with self._lock:
            s = self._save(save_id)
            if not s.registered:
                s.run, s.step, s.location, s.filesystem = run, step, location, filesystem
            s.failures[rank] = error
        return self._fail(s, f"rank {rank}: {error}")

    def fail_pending(self, run: str, reason: str) -> list[SaveOutcome]:
        """Fail every in-flight save of ``run`` (the actor, when the run's worker group died).

        A save already writing its manifest is left to commit: every rank's files are durable.
        """
        with self._lock:
            pending = [s for s in self._saves.values() if s.run == run and s.status == PENDING]
        return [o for s in pending for o in self._fail(s, reason)]

    def expire(self, now: float | None = None) -> list[SaveOutcome]:
        """Fail every registered save past its deadline, naming the ranks that did not report
        (the actor's watchdog, periodically)."""
        now = self._clock() if now is None else now
        with self._lock:
            overdue = []
            for s in self._saves.values():
                if s.status == PENDING and s.registered and not s.committing and now > s.deadline:
                    missing = sorted(set(range(s.spec.world_size)) - set(s.written))
                    overdue.append((s, f"rank(s) {missing} did not report within {s.timeout:g}s"))
        return [o for s, reason in overdue for o in self._fail(s, reason)]

    def refresh_leases(self, now: float | None = None) -> None:
        """Rewrite the lease of every registered save in flight that was not written for a
        quarter of its TTL (the actor's watchdog, periodically; the first time takes it over
        from rank 0). A refresh that fails is retried on the next call."""
        now = self._clock() if now is None else now
        with self._lock:
            due = [
                s
                for s in self._saves.values()
                if s.status == PENDING and s.registered and now - s.lease_written >= LEASE_TTL_S / 4
            ]
        for s in due:
            if not s.io_lock.acquire(blocking=False):
                continue  # being committed or removed right now
            try:
                with self._lock:
                    still = s.status == PENDING and not s.committing
                if still:
                    write_lease(CheckpointDir.resolve(s.location, s.filesystem), s.save_id, HELD)
                    s.lease_written = now
            except OSError:
                pass
            finally:
                s.io_lock.release()

    # -- queries -----------------------------------------------------------------

    def entry(self, save_id: str) -> CatalogEntry:
        """The save's catalog entry ("pending" for a save not heard of yet)."""
        with self._lock:
            return self._save(save_id).entry()

    def catalog(self, run: str) -> list[CatalogEntry]:
        """The entries of ``run``'s tracked saves, the last one per location, oldest first."""
        with self._lock:
            return sorted(self._catalog.get(run, {}).values(), key=entry_order)

    def has_pending(self) -> bool:
        """Whether some save is still in flight (the actor's watchdog runs while one is)."""
        with self._lock:
            return any(s.status == PENDING for s in self._saves.values())

    # -- the steps (called without the lock) ---------------------------------------

    def _commit(self, s: _Save) -> list[SaveOutcome]:
        """Write the manifest of ``s``, which the caller marked ``committing``."""
        with self._lock:
            location, filesystem, spec, shards = s.location, s.filesystem, s.spec, tuple(s.written.values())
        with s.io_lock:
            ckdir = CheckpointDir.resolve(location, filesystem)
            try:
                manifest = self._commit_fn(ckdir, spec, shards)
            except Exception as exc:  # noqa: BLE001 - a failed commit fails the save, not its caller
                failed = f"commit: {type(exc).__name__}: {exc}"
            else:
                failed = ""
                try:
                    release_lease(ckdir, s.save_id)
                except OSError:
                    pass  # committed; the lease expires by itself
        if failed:
            return self._fail(s, failed, committing=True)
        with self._lock:
            s.committing = False
            s.status = COMMITTED
            s.total_bytes = manifest.total_bytes
            self._note(s)
            return [self._outcome(s)]

    def _fail(self, s: _Save, reason: str, committing: bool = False) -> list[SaveOutcome]:
        """Fail ``s`` unless it already settled or is being committed (``committing``: by this
        caller, whose commit failed); then remove its files."""
        with self._lock:
            if s.status != PENDING or s.committing != committing:
                return []
            s.status, s.error, s.committing = FAILED, reason, False
            removal = self._removal(s, [f.path for shard in s.written.values() for f in shard.files])
        try:
            with s.io_lock:
                self._remove(removal)
        except Exception as exc:  # noqa: BLE001 - the save failed either way: say so, with the leftovers
            reason = f"{reason} (removing its files failed too: {type(exc).__name__}: {exc})"
        with self._lock:
            s.error = reason
            if s.location:
                self._note(s)
            return [self._outcome(s)]

    def _remove(self, removal: _Removal) -> None:
        if removal.location:
            ckdir = CheckpointDir.resolve(removal.location, removal.filesystem)
            release_lease(ckdir, removal.save_id)
            self._remove_fn(ckdir, removal.save_id, removal.paths)

    # -- helpers (called with the lock held) ----------------------------------------

    def _save(self, save_id: str) -> _Save:
        s = self._saves.get(save_id)
        if s is None:
            s = self._saves[save_id] = _Save(save_id, started=self._clock())
        return s

    def _note(self, s: _Save) -> None:
        self._catalog.setdefault(s.run, {})[s.location] = s.entry()

    def _removal(self, s: _Save, paths: list[str]) -> _Removal:
        return _Removal(s.location, s.filesystem, s.save_id, tuple(paths))

    def _outcome(self, s: _Save) -> SaveOutcome:
        return SaveOutcome(s.entry(), dict(s.writer_nodes), self._clock() - s.started)
