"""The commit protocol of saves through the Ray actors: each save's state, from first report to outcome.

Ray-free and asyncio-free; the MetadataActor is its one caller. A save commits
once rank 0 registered it (``begin_save``, bringing the ``SaveSpec``) and every
rank's shard files are durable (``report_written``), in either order. It fails
when a rank reports a failure (``report_failed``), when its run's workers died
(``fail_pending``), when it is not committed by its deadline (``expire``) or
when the actor learns that the save belongs to an earlier incarnation of
itself (``lost``: the actor restarted mid-save); its files are then removed,
and files reported after that are removed too. Files reported for a save that
is never registered are removed once they are ``orphan_timeout_s`` old.

Memory stays bounded: a save's heavy state (its spec, every rank's chunk
records and checksums) lives only while it is in flight. Once it settles only
its catalog entry is kept, in a bounded ``save_history.SaveHistory``.

Rank 0 claimed the save's location (a lease file, ``storage.lease``) before any
rank wrote; from the registration on, the tracker keeps that lease fresh
(``refresh_leases``, from the actor's watchdog) and releases it once the save
committed or failed, so another run's save to the same location is refused
while this one is in flight.

The tracker does the storage work itself, through the two functions it is
given (``commit_save`` and ``remove_failed_save`` by default), and outside its
lock: the actor calls it from worker threads. Each call returns the saves it
settled (``SaveOutcome``), for the actor to turn into events, metrics and
wake-ups. Storage stays the truth: a save this tracker never saw registered is
failed only after storage shows that no earlier incarnation committed it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ...format.file_paths import written_bytes
from ...format.manifest import Manifest
from ...storage.catalog import CatalogEntry, describe, entry_order
from ...storage.checkpoint_dir import CheckpointDir
from ...storage.commit import SaveSpec, WrittenShard, commit_save, remove_failed_save
from ...storage.lease import HELD, LEASE_TTL_S, release_lease, write_lease
from ..records import SaveTarget
from .save_history import SaveHistory, SettledSave
from .save_record import COMMITTED, FAILED, PENDING, Removal, SaveOutcome, SaveRecord

#: How long files reported for a save that nobody registered are kept before they are removed.
ORPHAN_TIMEOUT_S = 60.0

#: ``commit_save``'s signature: write the manifest of a save from every rank's shard.
CommitFn = Callable[[CheckpointDir, SaveSpec, Iterable[WrittenShard]], Manifest]
#: ``remove_failed_save``'s signature: remove a failed save's files (the given ones and its id's).
RemoveFn = Callable[[CheckpointDir, str, Sequence[str]], None]


class CommitTracker:
    """The saves in flight the MetadataActor has heard of, and a bounded history of settled ones.

    Thread-safe: one lock guards the state, and storage I/O runs outside it.
    """

    def __init__(
        self,
        default_timeout_s: float,
        *,
        orphan_timeout_s: float | None = None,
        commit: CommitFn = commit_save,
        remove: RemoveFn = remove_failed_save,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``default_timeout_s``: how long a registered save may take to commit, unless its
        registration says otherwise. ``orphan_timeout_s``: how long files reported for an
        unregistered save are kept (default: ``ORPHAN_TIMEOUT_S``, at most ``default_timeout_s``).
        ``clock``: wall time in seconds (tests pass their own)."""
        self._default_timeout_s = default_timeout_s
        self._orphan_timeout_s = orphan_timeout_s or min(ORPHAN_TIMEOUT_S, default_timeout_s)
        self._commit_fn = commit
        self._remove_fn = remove
        self._clock = clock
        self._lock = threading.Lock()
        self._saves: dict[str, SaveRecord] = {}
        self._history = SaveHistory()

    # -- reports (each returns the saves it settled) -----------------------------

    def begin_save(self, spec: SaveSpec, target: SaveTarget, timeout_s: float | None = None) -> list[SaveOutcome]:
        """Register a save (rank 0, once per save, through the actor); commits it if every rank
        already reported. It fails unless committed within ``timeout_s`` (default: the tracker's).
        A save that already failed (a rank reported first) stays failed.

        Args:
            spec: what every rank agreed on; ``spec.save_id`` names the save.
            target: its run, step, location and filesystem.
        """
        with self._lock:
            if self._history.get(spec.save_id) is not None:
                return []
            s = self._save(spec.save_id)
            s.spec, s.location, s.filesystem = spec, target.location, target.filesystem
            s.run, s.step = target.run, target.step
            s.timeout = timeout_s or self._default_timeout_s
            s.deadline = self._clock() + s.timeout
            s.registered = True
            ready = s.ready_to_commit()
            if ready:
                s.committing = True
        return self._commit(s) if ready else []

    def report_written(self, target: SaveTarget, shard: WrittenShard, node: str = "") -> list[SaveOutcome]:
        """A rank's shard files are durable (its ShardWriter, through the actor); commits the
        save when it was the last one missing. Files of a save that failed are removed.

        Args:
            target: the save; its run, step, location and filesystem name and clean up a
                save that is never registered (see ``expire``).
            shard: what the rank wrote.
            node: the node of the ShardWriter that wrote it.
        """
        save_id = target.save_id
        paths = tuple(f.path for f in shard.files)
        with self._lock:
            done = self._history.get(save_id)
            if done is not None:
                if done.entry.status != FAILED:
                    return []  # a repeated report of a committed save: its files are the checkpoint's
                removal = Removal(
                    done.entry.path or target.location, done.filesystem or target.filesystem, save_id, paths
                )
                ready = False
            else:
                s = self._save(save_id)
                self._locate(s, target)
                s.writer_nodes[shard.rank] = node
                removal = self._removal(s, paths) if s.status == FAILED else None
                if removal is None:
                    s.written[shard.rank] = shard
                ready = removal is None and s.ready_to_commit()
                if ready:
                    s.committing = True
        if removal is not None:
            self._remove(removal)
            return []
        return self._commit(s) if ready else []

    def report_failed(self, target: SaveTarget, error: str) -> list[SaveOutcome]:
        """A rank's part of the save failed (the rank or its writer, through the actor).

        Args:
            target: the save and the rank that failed (``target.rank``); where the save
                goes, for a failure that arrives before rank 0's registration (its
                catalog entry and its cleanup).
            error: what failed.
        """
        with self._lock:
            if self._history.get(target.save_id) is not None:
                return []
            s = self._save(target.save_id)
            self._locate(s, target)
            s.failures[target.rank] = error
        return self._fail(s, f"rank {target.rank}: {error}")

    def lost(self, target: SaveTarget, reason: str) -> list[SaveOutcome]:
        """A rank (or its writer) that started the save under an earlier incarnation of the
        actor asks about it: fail it with ``reason`` unless this tracker has what it needs
        to commit it (its registration and, given ``target.rank``, that rank's files).

        A save this tracker never saw registered is failed only if storage does not hold
        it committed (the earlier incarnation may have committed it before it died).
        """
        with self._lock:
            if self._history.get(target.save_id) is not None:
                return []
            s = self._saves.get(target.save_id)
            if s is not None and s.registered and (target.rank is None or target.rank in s.written):
                return []
            s = s or self._save(target.save_id)
            self._locate(s, target)
        return self._fail(s, reason)

    def fail_pending(self, run: str, reason: str) -> list[SaveOutcome]:
        """Fail every in-flight save of ``run`` (the actor, when the run's worker group died).

        A save already writing its manifest is left to commit: every rank's files are durable.
        """
        with self._lock:
            pending = [s for s in self._saves.values() if s.run == run and s.status == PENDING]
        return [o for s in pending for o in self._fail(s, reason)]

    def expire(self, now: float | None = None) -> list[SaveOutcome]:
        """Fail every registered save past its deadline, naming the ranks that did not report,
        and every unregistered one whose first report is ``orphan_timeout_s`` old (the actor's
        watchdog, periodically)."""
        now = self._clock() if now is None else now
        with self._lock:
            overdue = []
            for s in self._saves.values():
                if s.status != PENDING or s.committing:
                    continue
                if s.registered and now > s.deadline:
                    missing = sorted(set(range(s.spec.world_size)) - set(s.written))
                    overdue.append((s, f"rank(s) {missing} did not report within {s.timeout:g}s"))
                elif not s.registered and now > s.started + self._orphan_timeout_s:
                    reason = (
                        f"rank(s) {sorted(s.written)} wrote files, but rank 0 did not register the save with this "
                        f"MetadataActor within {self._orphan_timeout_s:g}s (it restarted, or rank 0 died)"
                    )
                    overdue.append((s, reason))
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
        """The save's catalog entry ("pending" with no location for a save not heard of, or forgotten)."""
        with self._lock:
            s = self._saves.get(save_id)
            if s is not None:
                return s.entry()
            done = self._history.get(save_id)
            return (
                done.entry
                if done is not None
                else CatalogEntry(
                    run="", step=None, path="", status=PENDING, created=0.0, world_size=0, bytes=0, save_id=save_id
                )
            )

    def settled_seconds(self, save_id: str) -> float | None:
        """How long the save took to settle, from the tracker first hearing of it (``None``: unsettled or forgotten)."""
        with self._lock:
            done = self._history.get(save_id)
            return done.seconds if done is not None else None

    def catalog(self, run: str) -> list[CatalogEntry]:
        """The entries of ``run``'s tracked saves, the last one per location, oldest first."""
        with self._lock:
            latest = {d.entry.path: d.entry for d in self._history.of_run(run) if d.entry.path}
            for s in self._saves.values():
                if s.run == run and s.location and (s.registered or s.status != PENDING):
                    latest[s.location] = s.entry()
        return sorted(latest.values(), key=entry_order)

    def has_pending(self) -> bool:
        """Whether some save is still in flight (the actor's watchdog runs while one is)."""
        with self._lock:
            return any(s.status == PENDING for s in self._saves.values())

    def in_flight(self) -> list[dict[str, Any]]:
        """The saves in flight, oldest first: ``save_id``, ``run``, ``step``, ``location``, ``started`` (when
        first heard of), ``registered``, ``written`` (ranks whose files are durable), ``world_size``
        (0 until registered), ``committing`` (the manifest being written)."""
        with self._lock:
            flying = [s for s in self._saves.values() if s.status == PENDING]
            return [
                {
                    "save_id": s.save_id,
                    "run": s.run,
                    "step": s.step,
                    "location": s.location,
                    "started": s.started,
                    "registered": s.registered,
                    "written": len(s.written),
                    "world_size": s.spec.world_size if s.spec else 0,
                    "committing": s.committing,
                }
                for s in sorted(flying, key=lambda s: s.started)
            ]

    def counts(self) -> dict[str, int]:
        """Records held: saves in flight (registered or not), settled saves kept, runs they belong to."""
        with self._lock:
            registered = sum(s.registered for s in self._saves.values())
            return {
                "in_flight": len(self._saves),
                "unregistered": len(self._saves) - registered,
                "settled": len(self._history),
                "runs": self._history.run_count(),
            }

    # -- the steps (called without the lock) ---------------------------------------

    def _commit(self, s: SaveRecord) -> list[SaveOutcome]:
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
            s.total_bytes = written_bytes(manifest.save_id, manifest.files)
            return [self._settle(s)]

    def _fail(self, s: SaveRecord, reason: str, committing: bool = False) -> list[SaveOutcome]:
        """Fail ``s`` unless it already settled or is being committed (``committing``: by this
        caller, whose commit failed); then remove its files.

        A save never registered here is first looked up in storage: committed there (by an
        earlier incarnation of the actor), it settles as committed and its files stay.
        """
        with self._lock:
            if s.status != PENDING or s.committing != committing:
                return []
            verify = not s.registered and bool(s.location)
            s.committing = verify  # while storage is asked: no other outcome, no removal
        keep_files = False
        if verify:
            try:
                stored = describe(CheckpointDir.resolve(s.location, s.filesystem), s.run)
            except Exception as exc:  # noqa: BLE001 - storage cannot say: fail the save, leave its files
                stored, keep_files = None, True
                reason = f"{reason} (its files are left: checking storage failed: {type(exc).__name__}: {exc})"
            if stored is not None and stored.status == COMMITTED and stored.save_id == s.save_id:
                with self._lock:
                    s.committing, s.status, s.total_bytes = False, COMMITTED, stored.bytes
                    s.run, s.step = s.run or stored.run, s.step if s.step is not None else stored.step
                    return [self._settle(s)]
        with self._lock:
            s.status, s.error, s.committing = FAILED, reason, False
            removal = self._removal(s, [f.path for shard in s.written.values() for f in shard.files])
        if not keep_files:
            try:
                with s.io_lock:
                    self._remove(removal)
            except Exception as exc:  # noqa: BLE001 - the save failed either way: say so, with the leftovers
                reason = f"{reason} (removing its files failed too: {type(exc).__name__}: {exc})"
        with self._lock:
            s.error = reason
            return [self._settle(s)]

    def _remove(self, removal: Removal) -> None:
        if removal.location:
            ckdir = CheckpointDir.resolve(removal.location, removal.filesystem)
            release_lease(ckdir, removal.save_id)
            self._remove_fn(ckdir, removal.save_id, removal.paths)

    # -- helpers (called with the lock held) ----------------------------------------

    def _save(self, save_id: str) -> SaveRecord:
        s = self._saves.get(save_id)
        if s is None:
            s = self._saves[save_id] = SaveRecord(save_id=save_id, started=self._clock())
        return s

    @staticmethod
    def _locate(s: SaveRecord, target: SaveTarget) -> None:
        """Where an unregistered save goes, from a report that says (the registration says otherwise)."""
        if not s.registered:
            s.run, s.step = s.run or target.run, s.step if s.step is not None else target.step
            if target.location:
                s.location, s.filesystem = target.location, target.filesystem

    def _removal(self, s: SaveRecord, paths: Sequence[str]) -> Removal:
        return Removal(s.location, s.filesystem, s.save_id, tuple(paths))

    def _settle(self, s: SaveRecord) -> SaveOutcome:
        """``s`` settled: keep only its entry (its spec and chunk records go) and say so."""
        outcome = SaveOutcome(s.entry(), dict(s.writer_nodes), self._clock() - s.started)
        if self._saves.get(s.save_id) is s:
            del self._saves[s.save_id]
        self._history.add(SettledSave(outcome.entry, s.filesystem, outcome.seconds))
        return outcome
