"""Who is writing a checkpoint directory: one lease file per save in flight.

Two saves (two jobs, two runs, two ``rayckpt convert``) may point at one
location. A save first *claims* it: it writes ``.rayckpt-lease-<save_id>``
(owner, state, expiry; one whole-file write, atomic on local disks and object
stores alike), then lists the other leases. It wins only when no other live
lease is there; every later claimer then sees its lease and is refused
(``SaveFailedError`` naming the location and the winner's save id) before
writing anything. Two saves that claim at the same moment see each other: the
one with the larger save id gives up at once, the other waits (at most
``CLAIM_WAIT_S``) for it to go. No locks, no atomic rename: the rule holds on
S3-like stores.

While a save runs its owner refreshes the lease (``LeaseKeeper``, or the
MetadataActor for Ray saves); it is deleted once the save committed or failed.
A lease is *live* until its expiry and, on the host and process namespace that
wrote it, while its owner process runs. The commit sweep and ``rayckpt gc``
delete only files of saves without a live lease (docs/FORMAT.md: Leases).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import pyarrow.fs as pafs

from ..errors import CheckpointExistsError, CheckpointNotFoundError, SaveFailedError
from ..format.manifest import MANIFEST_NAME
from ..phases import phase
from .checkpoint_dir import CheckpointDir

LEASE_PREFIX = ".rayckpt-lease-"
#: A lease not refreshed for this long is dead.
LEASE_TTL_S = 60.0
#: How long a claimer that saw a rival (with a larger save id) waits for it to give up or win.
#: A live rival decides within one listing; only a stalled or crashed one makes this run out.
CLAIM_WAIT_S = 20.0
CLAIMING = "claiming"
HELD = "held"
_POLL_S = 0.05


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    """One lease file's content."""

    save_id: str
    #: ``claiming`` (written, not yet won) or ``held`` (the save owns the location).
    state: str
    #: ``<hostname>/<pid namespace>``: where ``pid`` means something.
    owner: str
    pid: int
    #: Wall time (seconds) after which the lease is dead unless refreshed.
    expires: float

    def is_live(self, now: float | None = None) -> bool:
        """Not expired, and (when written in this host's process namespace) its process runs."""
        if self.expires <= (time.time() if now is None else now):
            return False
        return self.owner != owner_id() or _process_runs(self.pid)

    def describe(self, now: float | None = None) -> str:
        left = self.expires - (time.time() if now is None else now)
        return f"save {self.save_id} ({self.state} by pid {self.pid} on {self.owner}, lease valid {left:.0f}s more)"


def owner_id() -> str:
    """This process's host and pid namespace: pids are compared only within it."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = "?"
    return f"{socket.gethostname()}/{ns}"


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lease_name(save_id: str) -> str:
    return f"{LEASE_PREFIX}{save_id}"


def write_lease(ckdir: CheckpointDir, save_id: str, state: str = HELD, ttl_s: float = LEASE_TTL_S) -> Lease:
    """Write (or refresh) ``save_id``'s lease, owned by this process, valid for ``ttl_s``."""
    lease = Lease(save_id=save_id, state=state, owner=owner_id(), pid=os.getpid(), expires=time.time() + ttl_s)
    data = json.dumps({"format": "rayckpt-lease", **_fields(lease)}).encode()
    for attempt in range(3):
        ckdir.makedirs()
        try:
            ckdir.write_atomic(lease_name(save_id), data, durable=False)  # a crash ends the save anyway
            return lease
        except FileNotFoundError:  # the directory was removed under us (a failed save's cleanup): again
            if attempt == 2:
                raise
    return lease


def _fields(lease: Lease) -> dict:
    return {f: getattr(lease, f) for f in Lease.__slots__}


def is_lease_file(name: str) -> bool:
    """A lease, or the temporary file of a lease being written (``.<lease>.tmp-<hex>`` on local disks)."""
    return name.startswith((LEASE_PREFIX, "." + LEASE_PREFIX))


def release_lease(ckdir: CheckpointDir, save_id: str) -> None:
    """Delete ``save_id``'s lease (its owner, once the save committed or failed)."""
    with phase("lease_release"):
        ckdir.delete(lease_name(save_id))


def read_leases(ckdir: CheckpointDir) -> list[Lease]:
    """Every lease in ``ckdir``. An unreadable one counts as a claim valid for a TTL after its mtime."""
    leases = []
    try:
        infos = ckdir.fs.get_file_info(pafs.FileSelector(ckdir.fs_path, allow_not_found=True))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for info in infos:
        name = info.base_name
        if info.type != pafs.FileType.File or not name.startswith(LEASE_PREFIX):
            continue
        save_id = name[len(LEASE_PREFIX) :]
        try:
            raw = json.loads(ckdir.read_bytes(name))
            leases.append(
                Lease(
                    save_id=save_id,
                    state=str(raw["state"]),
                    owner=str(raw["owner"]),
                    pid=int(raw["pid"]),
                    expires=float(raw["expires"]),
                )
            )
        except Exception:  # noqa: BLE001 - gone or garbled: never trust it more than its age says
            mtime = info.mtime.timestamp() if info.mtime is not None else time.time()
            leases.append(Lease(save_id=save_id, state=CLAIMING, owner="?", pid=0, expires=mtime + LEASE_TTL_S))
    return sorted(leases, key=lambda lease: lease.save_id)


def live_save_ids(ckdir: CheckpointDir) -> set[str]:
    """The saves that may still be writing into ``ckdir``."""
    now = time.time()
    return {lease.save_id for lease in read_leases(ckdir) if lease.is_live(now)}


def committed_save_id(ckdir: CheckpointDir) -> str:
    """The save id of the manifest in ``ckdir``: "" when there is none."""
    try:
        data = ckdir.read_bytes(MANIFEST_NAME)
    except CheckpointNotFoundError:
        return ""
    try:
        raw = json.loads(data)
    except ValueError:
        return "(unreadable manifest)"
    return str(raw.get("save_id", "?")) if isinstance(raw, dict) else "?"


def claim_location(ckdir: CheckpointDir, save_id: str, *, overwrite: bool = True, wait_s: float = CLAIM_WAIT_S) -> str:
    """Claim ``ckdir`` for ``save_id`` before anything is written (the save's owner: rank 0, an import).

    Call order of a claimed save (the owner's steps; the ranks write between 1 and 2):

    1. ``claim_location``: write this save's lease as "claiming", list the other
       leases, give up to a live rival that holds the location or has the smaller
       save id (waiting up to ``wait_s`` for one with a larger id to give up), then
       mark the lease "held".
    2. ``LeaseKeeper`` (or the MetadataActor on Ray) refreshes the lease while the
       ranks write.
    3. ``storage.commit.commit_save`` checks, right before the manifest write,
       that no other save took the location or committed there since step 1
       (``check_commit``).
    4. The owner releases the lease (``release_lease``), committed or not.

    On any failure in step 1 this save's lease is removed again, and so is a
    directory the claim created.

    Args:
        ckdir: The checkpoint directory the save goes to.
        save_id: The claiming save's id (``storage.commit.new_save_id``).
        overwrite: Whether a checkpoint committed at ``ckdir`` may be replaced.
        wait_s: The longest wait for a rival that claimed at the same moment.

    Returns:
        The save id of the checkpoint committed at ``ckdir`` now ("" when none),
            for ``SaveSpec.previous``: the commit refuses to replace anything else.

    Raises:
        SaveFailedError: Another save owns the location (the message names it), or
            the lease cannot be written there.
        CheckpointExistsError: ``overwrite=False`` and a checkpoint is committed
            at ``ckdir``.
    """
    with phase("lease_claim"):
        return _claim(ckdir, save_id, overwrite, wait_s)


def _claim(ckdir: CheckpointDir, save_id: str, overwrite: bool, wait_s: float) -> str:
    try:
        write_lease(ckdir, save_id, CLAIMING)
    except OSError as exc:
        raise SaveFailedError(
            f"{ckdir.location}: cannot write the save's lease there, nothing was written "
            f"({type(exc).__name__}: {exc}); is the location writable?"
        ) from exc
    try:
        deadline = time.monotonic() + wait_s
        while True:
            now = time.time()
            rivals = [x for x in read_leases(ckdir) if x.save_id != save_id and x.is_live(now)]
            if not rivals:
                break
            winner = next((x for x in rivals if x.state == HELD or x.save_id < save_id), None)
            if winner is not None or time.monotonic() > deadline:
                other = winner or rivals[0]
                raise SaveFailedError(
                    f"{ckdir.location}: another save is writing this checkpoint: {other.describe(now)}; "
                    f"save {save_id} was refused before writing anything. Wait for it to finish, or save elsewhere"
                )
            time.sleep(_POLL_S)  # rivals with larger ids that saw us give up at once
        write_lease(ckdir, save_id, HELD)
        previous = committed_save_id(ckdir)
        if previous and not overwrite:
            raise CheckpointExistsError(
                f"{ckdir.location} already holds a committed checkpoint and overwrite=False: nothing was written "
                f"(the checkpoint there is save {previous}); save elsewhere, or pass overwrite=True to replace it "
                "atomically"
            )
        return previous
    except BaseException:
        release_lease(ckdir, save_id)
        if not ckdir.exists(MANIFEST_NAME):
            ckdir.delete_dir_if_empty()  # the claim made it: leave no empty directory behind
        raise


def check_commit(ckdir: CheckpointDir, save_id: str, previous: str | None) -> None:
    """Right before the manifest write: refuse when another save owns the location or committed there
    since ``save_id`` claimed it (``previous``; ``None``: the save did not claim, only leases are checked).

    Both can happen only when this save's lease lapsed (its owner stalled past the TTL).
    """
    now = time.time()
    owners = [x for x in read_leases(ckdir) if x.save_id != save_id and x.state == HELD and x.is_live(now)]
    if owners:
        raise SaveFailedError(
            f"{ckdir.location}: refusing to commit save {save_id}: {owners[0].describe(now)} owns this "
            "location (this save's lease lapsed); nothing of the other save was touched"
        )
    if previous is not None:
        current = committed_save_id(ckdir)
        if current != previous:
            raise SaveFailedError(
                f"{ckdir.location}: refusing to commit save {save_id}: save {current or '(none)'} committed there "
                f"after this save claimed the location (it found {previous or 'no checkpoint'}); it is kept"
            )


class LeaseKeeper:
    """Refreshes a claimed lease from a thread while its save runs; deletes it on exit.

    The in-process owner of a save (rank 0 of ``rayckpt.save``, an import) uses it
    as a context manager around writing and committing, after ``claim_location``.
    A refresh that fails is retried at the next beat; the commit checks whether
    the lease lapsed meanwhile (``check_commit``).

    Args:
        ckdir: The checkpoint directory the lease is in.
        save_id: The save that claimed it.
        ttl_s: How long each refresh keeps the lease live; it is refreshed four
            times per ``ttl_s``.
    """

    def __init__(self, ckdir: CheckpointDir, save_id: str, ttl_s: float = LEASE_TTL_S) -> None:
        self.ckdir = ckdir
        self.save_id = save_id
        self.ttl_s = ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rayckpt-lease-{uuid.uuid4().hex[:6]}", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                write_lease(self.ckdir, self.save_id, HELD, self.ttl_s)
            except OSError:
                pass  # storage hiccup: the next beat tries again; the commit checks what it must

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        release_lease(self.ckdir, self.save_id)
