"""A rank's async save in flight, and how the rank learns its outcome from the MetadataActor.

``SaveHandle.wait()`` waits for the rank's ShardWriter, then asks the
MetadataActor for the save's outcome (``wait_commit``), tagged with the actor
incarnation the save began under. The outcome is learned once and kept: a
failed save raises its ``SaveFailedError`` from its own ``wait()`` (every time
it is called) and never from a later save's. When the actor restarted mid-save
its new incarnation answers at once (failed, or committed if storage holds
the save); when it died for good, storage answers.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import ray

from ...errors import SaveFailedError
from ...storage.catalog import CatalogEntry, describe
from ...storage.checkpoint_dir import CheckpointDir
from ..metadata.actor import get_metadata_actor
from ..records import SaveTarget
from ..shm import StagedRegion

#: The incarnation tag of a save whose registration (or incarnation query) reached an
#: incarnation that died before answering: every live incarnation is another one.
UNKNOWN_INCARNATION = "unknown"
#: Seconds a rank waits before asking again when the MetadataActor died under its request
#: (Ray restarts it; a request sent just then may fail too); then storage answers.
_RETRY_AFTER_S = (0.2, 0.5, 1.0, 2.0)


#: Set to 1 where a local path is storage every node mounts (NFS): saves across nodes may use it.
LOCAL_IS_SHARED_ENV = "RAYCKPT_LOCAL_IS_SHARED"


def local_is_shared_by_env() -> bool:
    """Whether ``RAYCKPT_LOCAL_IS_SHARED=1`` says a local path is storage every node mounts."""
    return os.environ.get(LOCAL_IS_SHARED_ENV, "") == "1"


def actor_location(ckdir: CheckpointDir, filesystem: Any) -> str:
    """How the actors reach ``ckdir``: its path on ``filesystem`` when one was given, else the user's URI."""
    return ckdir.fs_path if filesystem is not None else ckdir.uri


@dataclass(frozen=True, slots=True, kw_only=True)
class StartedSave:
    """What ``save_async`` started on a rank, for its ``SaveHandle`` to wait for."""

    #: The copy of this rank's share (``copier.CopyJob``): its ShardWriter's ``write`` once the copy is done.
    copy: Any
    #: What the share was staged in (a ``StagedRegion`` or an object-store ref).
    staged_ref: Any
    #: How long ``save_async`` blocked this rank.
    stall_seconds: float
    #: Rank 0: the MetadataActor's ``begin_save``, not yet waited for.
    registered: Any = None
    #: The MetadataActor's ``incarnation()`` when the save began, not yet waited for.
    incarnation: Any = None


class SaveHandle:
    """An async save in flight on this rank, returned by ``save_async``; ``wait()`` until committed.

    Attributes:
        save_id: The save's id (the manifest carries it once committed).
        location: The checkpoint directory, as the caller named it.
        run: The run the save belongs to.
        step: The training step saved.
        rank: This rank.
        stall_seconds: How long ``save_async`` blocked this rank (plan, and the part of the copy
            made before it returned).
        staging: Where the share was staged: ``"shm"`` (the staging buffer) or ``"object_store"``.
        late_bytes: Bytes of the share copied after ``save_async`` returned (0: none).
    """

    def __init__(
        self,
        target: SaveTarget,
        ckdir: CheckpointDir,
        started: StartedSave,
        *,
        timeout: float,
        on_outcome: Callable[[SaveHandle], None] | None = None,
    ) -> None:
        """Made by ``save_async`` (every rank), once the rank's share is staged.

        Args:
            target: the save and this rank (its location as the actors reach it).
            ckdir: the checkpoint directory, as the user named it.
            started: what ``save_async`` started (``StartedSave``).
            timeout: the commit timeout.
            on_outcome: told once the outcome is known.
        """
        copy, staged_ref, stall_seconds = started.copy, started.staged_ref, started.stall_seconds
        registered, incarnation = started.registered, started.incarnation
        self.target = target
        self.location = ckdir.location
        #: Seconds this rank was blocked by ``save_async`` (plan + copy into shared memory).
        self.stall_seconds = stall_seconds
        #: Once the outcome is known: how long the save took to commit (or fail) by the MetadataActor's clock,
        #: from its first report of the save; ``None`` until then, or when storage answered for a lost actor.
        self.commit_seconds: float | None = None
        #: Where the share was staged: "shm" (the reusable buffer) or "object_store".
        self.staging = "shm" if isinstance(staged_ref, StagedRegion) else "object_store"
        self._ckdir = ckdir
        self._copy = copy
        self._staged_ref = staged_ref
        self._timeout = timeout
        self._entry: CatalogEntry | None = None
        #: Rank 0: the registration with the MetadataActor (``begin_save``), not yet waited for.
        self._registered = registered
        #: The MetadataActor's answer to ``incarnation()`` when the save began, not yet waited for.
        self._incarnation = incarnation
        #: Told once the outcome is known (its saver stops holding the next save up for it).
        self._on_outcome = on_outcome
        #: Held by the one thread that learns the outcome; the others then read it.
        self._learning = threading.Lock()
        #: Callers of ``wait()`` waiting or told the outcome: a failure is theirs to hear.
        self._watchers = 0
        self._watchers_lock = threading.Lock()

    @property
    def save_id(self) -> str:
        return self.target.save_id

    @property
    def run(self) -> str:
        return self.target.run

    @property
    def step(self) -> int | None:
        return self.target.step

    @property
    def rank(self) -> int | None:
        return self.target.rank

    def copied(self) -> bool:
        """Whether this rank's copy of its share is over: the state may change from then on.

        Returns:
            True once every tensor of the share is copied (or the copy failed).
        """
        return self._copy.copied()

    def wait_copied(self, timeout: float | None = None) -> bool:
        """Block until this rank's copy of its share is over (an optimizer guarded by
        ``guard_optimizer`` waits for it by itself, in its step).

        Args:
            timeout: Seconds to wait at most (default: no limit).

        Returns:
            True once the copy is over; False if ``timeout`` ran out first.
        """
        return self._copy.wait_copied(timeout)

    @property
    def late_bytes(self) -> int:
        """Bytes of this rank's share copied after ``save_async`` returned (0: none)."""
        return self._copy.late_bytes

    @property
    def copy_seconds(self) -> float | None:
        """Seconds from the ``save_async`` call to the end of this rank's copy (``None`` until it ends)."""
        return self._copy.seconds

    def join_copy(self) -> None:
        """Wait for the copy's thread to end (before the buffer it copies into is closed)."""
        self._copy.join()

    def done(self) -> bool:
        """Whether this rank's share is written (the commit may still be pending).

        Returns:
            True once this rank's ShardWriter finished its ``write`` (or failed it), or the copy failed.
        """
        if not self._copy.copied():
            return False
        if self._copy.write_ref is None:
            return True
        ready, _ = ray.wait([self._copy.write_ref], timeout=0)
        return bool(ready)

    def wait(self, timeout: float | None = None) -> CatalogEntry:
        """Block until the save is committed or failed (any thread; Ray Train's upload thread waits here).

        Waits for this rank's ShardWriter, then asks the MetadataActor (``wait_commit``).
        The outcome is learned once: a failed save's error is raised by its own
        ``wait()`` (each time it is called), or, if nobody waited for it, once by the
        next ``save_async``, never by a later save. If the MetadataActor restarts while
        the save is in flight, ``wait()`` fails within seconds (docs/internals.md,
        "When the MetadataActor restarts mid-save"); if it died for good, storage
        answers: committed when the directory's manifest carries this save's id.

        Args:
            timeout: Seconds to wait at most (default ``commit_timeout_s``).

        Returns:
            The committed checkpoint's ``CatalogEntry``.

        Raises:
            SaveFailedError: The save failed (naming its id, step and location and the
                failing rank's error), or was not committed in time (``commit_timeout_s``,
                or a longer ``timeout``): the rank then tells the MetadataActor, so it
                cannot commit afterwards.
            TimeoutError: A ``timeout`` shorter than ``commit_timeout_s`` ran out: the
                save is still in flight, and the next ``save_async`` waits for it.
        """
        self._count_watcher(+1)
        try:
            entry = self._outcome(timeout)
        except TimeoutError:
            self._count_watcher(-1)  # not told: the failure may still be the next save's to raise
            raise
        return self._checked(entry)

    def wait_before_next_save(self) -> CatalogEntry:
        """Wait for the outcome (this process's next ``save_async``): a failure is raised here
        only if no ``wait()`` caller hears of it, so that it is raised once, for its own save."""
        entry = self._outcome(None)
        return entry if self._count_watcher(0) else self._checked(entry)

    def _count_watcher(self, change: int) -> int:
        with self._watchers_lock:
            self._watchers += change
            return self._watchers

    def _checked(self, entry: CatalogEntry) -> CatalogEntry:
        if entry.status != "committed":
            raise SaveFailedError(
                f"save of step {self.step} to {self.location} (save {self.save_id}) failed; nothing was committed: "
                f"{entry.error}"
            )
        return entry

    def _outcome(self, timeout: float | None) -> CatalogEntry:
        """The save's outcome, learned once: one thread asks, the others wait for its answer."""
        limit = timeout if timeout is not None else self._timeout
        if not self._learning.acquire(timeout=limit if timeout is not None else -1):
            raise TimeoutError(f"save {self.save_id} to {self.location}: no outcome within {limit}s")
        try:
            if self._entry is None:
                self._entry = self._learn(limit)
                self._staged_ref = None  # release the staged copy in the object store
                if self._on_outcome is not None:
                    self._on_outcome(self)
            return self._entry
        finally:
            self._learning.release()

    def _learn(self, limit: float) -> CatalogEntry:
        try:
            return self._wait_outcome(limit)
        except TimeoutError:
            if limit < self._timeout:
                raise
        gave_up = f"not committed within {limit:g}s: rank {self.rank} stopped waiting"
        self._report_failed(gave_up)  # so that it cannot commit after this rank called it failed
        entry = self._ask(0.0, None)
        return self._failed_entry(gave_up) if entry.status == "pending" else entry

    def _wait_outcome(self, limit: float) -> CatalogEntry:
        if not self._copy.wait_copied(limit):
            raise TimeoutError(f"save {self.save_id} to {self.location}: not copied within {limit}s")
        try:
            if self._copy.write_ref is not None:  # None: the copy failed, and told the MetadataActor
                ray.get(self._copy.write_ref, timeout=limit)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"save {self.save_id} to {self.location}: not written within {limit}s") from None
        except Exception as exc:  # noqa: BLE001 - the writer died or raised: the save failed
            self._report_failed(f"{type(exc).__name__}: {exc}")
        entry = self._ask(limit, self._began_under(limit))
        if entry.status == "pending":
            raise TimeoutError(f"save {self.save_id} to {self.location}: not committed within {limit}s")
        return entry

    def _began_under(self, limit: float) -> str | None:
        """The MetadataActor incarnation the save began under: the one that registered it (rank 0),
        else the one this rank asked; ``None`` when unknown (a handle made without either).

        Rank 0: a registration that failed fails the save (the others learn it from the actor).
        """
        if self._registered is not None:
            try:
                return ray.get(self._registered, timeout=limit)
            except ray.exceptions.RayActorError:
                return UNKNOWN_INCARNATION  # it died before registering the save: no incarnation has it
            except Exception as exc:  # noqa: BLE001 - begin_save raised: the save cannot commit
                self._report_failed(f"registering with the MetadataActor: {type(exc).__name__}: {exc}")
        if self._incarnation is not None:
            try:
                return ray.get(self._incarnation, timeout=limit)
            except ray.exceptions.RayActorError:
                return UNKNOWN_INCARNATION
        return None

    def _ask(self, limit: float, began_under: str | None) -> CatalogEntry:
        """The MetadataActor's answer (waiting up to ``limit``): asked again when it died under
        the request, as its next incarnation settles this save at once; storage's answer when
        the actor cannot be reached."""
        for pause in (*_RETRY_AFTER_S, None):
            asked = replace(self.target, incarnation=began_under)
            try:
                answer = ray.get(get_metadata_actor().wait_commit.remote(asked, limit, self.stall_seconds))
                self.commit_seconds = answer.seconds
                return answer.entry
            except ray.exceptions.RayActorError:
                began_under = began_under or UNKNOWN_INCARNATION  # the incarnation asked is gone
                if pause is not None:
                    time.sleep(pause)
        return self._entry_from_storage()

    def _report_failed(self, error: str) -> None:
        report_failed(self.target, error)

    def _entry_from_storage(self) -> CatalogEntry:
        """The MetadataActor cannot be reached: storage says whether the save committed."""
        found = describe(self._ckdir, self.run)
        if found is not None and found.status == "committed" and found.save_id == self.save_id:
            return found
        return self._failed_entry("the MetadataActor died before this save was committed")

    def _failed_entry(self, error: str) -> CatalogEntry:
        return CatalogEntry(
            run=self.run,
            step=self.step,
            path=self._ckdir.uri,
            status="failed",
            created=time.time(),
            world_size=0,
            bytes=0,
            save_id=self.save_id,
            error=error,
        )


def report_failed(target: SaveTarget, error: str) -> None:
    """Tell the MetadataActor that ``target.rank``'s part of a save failed (a rank).

    ``target`` says where the save goes: the report may arrive before rank 0's
    registration, or at a restarted actor. Asked again when the actor died under
    the request; if it cannot be reached the failure is not lost: the rank's
    ``wait()`` learns the outcome from storage.
    """
    for pause in (*_RETRY_AFTER_S, None):
        try:
            ray.get(get_metadata_actor().report_failed.remote(target, error))
            return
        except ray.exceptions.RayActorError:
            if pause is not None:
                time.sleep(pause)
