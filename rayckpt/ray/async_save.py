"""Save and load through the Ray actors.

``save_async`` (every rank): plan like ``save``, copy this rank's share once into
the node's shared memory (the only time training is blocked): into the rank's
reusable staging buffer (``staging``), or into Ray's object store when that buffer
cannot be had; hand it to the node's ShardWriter; the MetadataActor commits when
every rank's files are durable. ``load`` (every rank): the MetadataActor plans the
byte ranges this rank reads (cached), the rank reads and verifies them.
"""

from __future__ import annotations

import atexit
import os
import time
from typing import Any

import pyarrow.fs as pafs
import ray

from ..engine.coordinator import Coordinator, default_coordinator
from ..engine.save import Collected, collect_state
from ..engine.state import flatten
from ..engine.writer import chunk_pieces, create_chunk_data
from ..errors import InvalidStateError, SaveFailedError
from ..format.shard_file import DEFAULT_BLOCK_SIZE
from ..storage.catalog import CatalogEntry, describe
from ..storage.checkpoint_dir import CheckpointDir
from . import metrics
from .metadata_actor import DEFAULT_COMMIT_TIMEOUT_S, get_metadata_actor
from .shard_writer import get_shard_writer
from .staging import StagedRegion, StagingBuffer, StagingUnavailable, staged_size

#: Set to 1 when a local path is on storage every node shares (NFS, a single machine).
LOCAL_IS_SHARED_ENV = "RAYCKPT_LOCAL_IS_SHARED"


#: Where ``save_async`` stages: "auto" (the reusable buffer, else the object store), "shm", "object_store".
STAGING_ENV = "RAYCKPT_STAGING"


STAGING_MODES = ("auto", "shm", "object_store")


_inflight: SaveHandle | None = None


_buffer: StagingBuffer | None = None


class SaveHandle:
    """An async save in flight on this rank. ``wait()`` until committed."""

    def __init__(
        self,
        save_id: str,
        ckdir: CheckpointDir,
        run: str,
        step: int | None,
        rank: int,
        write_ref: Any,
        staged_ref: Any,
        stall_seconds: float,
        timeout: float,
        registered: Any = None,
        filesystem: Any = None,
    ) -> None:
        self.save_id = save_id
        self.uri = ckdir.uri
        self.run = run
        self.step = step
        self._ckdir = ckdir
        self._filesystem = filesystem
        self.rank = rank
        #: Seconds this rank was blocked by ``save_async`` (plan + copy into shared memory).
        self.stall_seconds = stall_seconds
        #: Where the share was staged: "shm" (the reusable buffer) or "object_store".
        self.staging = "shm" if isinstance(staged_ref, StagedRegion) else "object_store"
        self._write_ref = write_ref
        self._staged_ref = staged_ref
        self._timeout = timeout
        self._entry: CatalogEntry | None = None
        #: Rank 0: the registration with the MetadataActor (``begin_save``), not yet waited for.
        self._registered = registered

    def done(self) -> bool:
        """Whether this rank's share is written (the commit may still be pending)."""
        ready, _ = ray.wait([self._write_ref], timeout=0)
        return bool(ready)

    def wait(self, timeout: float | None = None) -> CatalogEntry:
        """Block until the checkpoint is committed; raise ``SaveFailedError`` if it failed."""
        if self._entry is None:
            meta = get_metadata_actor()
            limit = timeout if timeout is not None else self._timeout
            try:
                ray.get(self._write_ref, timeout=limit)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"save {self.save_id} to {self.uri}: not written within {limit}s") from None
            except Exception as exc:  # noqa: BLE001 - the writer died or raised: the save failed
                self._report_failed(meta, f"{type(exc).__name__}: {exc}")
            self._check_registered(meta, limit)
            try:
                entry = ray.get(meta.wait_commit.remote(self.save_id, limit))
            except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError):
                entry = self._entry_from_storage()
            if entry.status == "pending":
                raise TimeoutError(f"save {self.save_id} to {self.uri}: not committed within {limit}s")
            self._entry = entry
            self._staged_ref = None  # release the staged copy in the object store
            _clear_inflight(self)
        if self._entry.status != "committed":
            raise SaveFailedError(
                f"save of step {self.step} to {self.uri} (save {self.save_id}) failed; nothing was committed: "
                f"{self._entry.error}"
            )
        return self._entry

    def _check_registered(self, meta: Any, limit: float) -> None:
        """Rank 0: a registration that failed fails the save (the others learn it from the actor)."""
        if self._registered is None:
            return
        try:
            ray.get(self._registered, timeout=limit)
        except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError):
            pass  # the actor is gone: wait_commit below asks storage
        except Exception as exc:  # noqa: BLE001 - begin_save raised: the save cannot commit
            failed = f"registering with the MetadataActor: {type(exc).__name__}: {exc}"
            self._report_failed(meta, failed)

    def _report_failed(self, meta: Any, error: str) -> None:
        report_failed(self.save_id, self.rank, error, self.run, self.step, self._ckdir, self._filesystem, meta)

    def _entry_from_storage(self) -> CatalogEntry:
        """The MetadataActor died while this rank waited: storage says whether the save committed."""
        found = describe(self._ckdir, self.run)
        if found is not None and found.status == "committed" and found.save_id == self.save_id:
            return found
        return CatalogEntry(
            self.run,
            self.step,
            self.uri,
            "failed",
            time.time(),
            0,
            0,
            self.save_id,
            "the MetadataActor died before this save was committed",
        )


def report_failed(
    save_id: str,
    rank: int,
    error: str,
    run: str,
    step: int | None,
    ckdir: CheckpointDir,
    filesystem: Any,
    meta: Any = None,
) -> None:
    """Tell the MetadataActor that ``rank``'s part of a save failed, with where the save
    goes: the report may arrive before rank 0's registration."""
    meta = meta or get_metadata_actor()
    ray.get(meta.report_failed.remote(save_id, rank, error, run, step, _location(ckdir, filesystem), filesystem))


def _location(ckdir: CheckpointDir, filesystem: Any) -> str:
    """How the actors reach ``ckdir``: its root on ``filesystem`` when one was given, else the user's URI."""
    return ckdir.root if filesystem is not None else ckdir.uri


def _clear_inflight(handle: SaveHandle) -> None:
    """A handle whose outcome its caller has seen no longer holds up the next save."""
    global _inflight
    if _inflight is handle:
        _inflight = None


def save_async(
    state_dict: dict[str, Any],
    checkpoint_id: str | Any,
    *,
    run: str = "default",
    step: int | None = None,
    filesystem: pafs.FileSystem | None = None,
    process_group: Any = None,
    coordinator: Coordinator | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    metadata: dict[str, Any] | None = None,
    commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S,
    local_is_shared: bool | None = None,
    staging: str | None = None,
) -> SaveHandle:
    """Start a save through the Ray actors; return once this rank's share is staged.

    Called by every rank (collective when a process group is initialized), inside
    a Ray worker or driver. At most one save is in flight per process: a second
    call first waits for the previous one (and raises if it failed). A local path
    with workers on several nodes is refused unless it is shared storage
    (``local_is_shared=True`` or ``RAYCKPT_LOCAL_IS_SHARED=1``).

    ``staging`` (default ``RAYCKPT_STAGING`` or "auto"): "shm" copies the share
    into this process's staging buffer in ``/dev/shm``, kept and reused from save
    to save (memory already mapped: the fastest copy); "object_store" ``ray.put``s
    it; "auto" is "shm", falling back to the object store when ``/dev/shm`` cannot
    hold the share.
    """
    global _inflight
    staging = staging_mode(staging)
    if _inflight is not None:
        previous, _inflight = _inflight, None
        previous.wait()
    start = time.perf_counter()
    coord = coordinator or default_coordinator(process_group)
    ckdir = CheckpointDir.resolve(checkpoint_id, filesystem)
    location = _location(ckdir, filesystem)
    node_id = ray.get_runtime_context().get_node_id()
    collected = collect_state(coord, state_dict, extra=node_id)
    if local_is_shared is None:
        local_is_shared = os.environ.get(LOCAL_IS_SHARED_ENV, "") == "1"
    nodes = sorted(set(collected.extras))
    if ckdir.is_local and len(nodes) > 1 and not local_is_shared:
        raise InvalidStateError(
            f"checkpoint location {ckdir.uri} is node-local storage but the ranks run on {len(nodes)} nodes; "
            "every node must reach the same files: use shared storage (s3://..., gs://..., or an NFS path with "
            f"{LOCAL_IS_SHARED_ENV}=1)"
        )
    rank = coord.rank
    metadata = {"step": step, "run": run, **(metadata or {})}
    registered = None
    if rank == 0:
        # Submitted, not waited for and no collective: the actor commits a save only
        # once it is registered; ``wait()`` on rank 0 checks that it was, and a
        # registration that cannot even be sent fails the save for every rank.
        try:
            registered = get_metadata_actor().begin_save.remote(
                collected.save_id,
                location,
                filesystem,
                run,
                step,
                coord.world_size,
                collected.tensor_meta,
                collected.values,
                block_size,
                metadata,
                commit_timeout_s,
            )
        except Exception as exc:
            failed = f"registering with the MetadataActor: {type(exc).__name__}: {exc}"
            report_failed(collected.save_id, rank, failed, run, step, ckdir, filesystem)
            raise SaveFailedError(f"save of step {step} to {ckdir.uri}: {failed}") from exc
    items = [(i.key, collected.flat.tensors[i.key].dtype, i.box) for i in collected.plans[rank].items]
    try:
        staged_ref = stage_share(collected, rank, node_id, staging)  # the one copy: into shared memory
        writer = get_shard_writer(node_id)
        write_ref = writer.write.remote(collected.save_id, location, filesystem, rank, items, block_size, staged_ref)
        if isinstance(staged_ref, StagedRegion):
            _buffer.busy = write_ref  # the writer reads the buffer until this resolves
    except Exception as exc:
        failed = f"staging: {type(exc).__name__}: {exc}"
        report_failed(collected.save_id, rank, failed, run, step, ckdir, filesystem)
        raise SaveFailedError(f"save of step {step} to {ckdir.uri}: staging failed on rank {rank}: {exc}") from exc
    stall = time.perf_counter() - start
    metrics.observe("rayckpt_save_stall_seconds", stall, run=run, rank=rank)
    handle = SaveHandle(
        collected.save_id,
        ckdir,
        run,
        step,
        rank,
        write_ref,
        staged_ref,
        stall,
        commit_timeout_s,
        registered=registered,
        filesystem=filesystem,
    )
    _inflight = handle
    return handle


def stage_share(collected: Collected, rank: int, node_id: str, staging: str) -> Any:
    """Copy this rank's share into shared memory: a ``StagedRegion`` of the staging
    buffer, or (``staging="object_store"``, or "auto" without room in ``/dev/shm``)
    an object-store ref to the chunks' arrays."""
    plan = collected.plans[rank]
    if staging != "object_store":
        buffer = _staging_buffer()
        in_use = buffer.busy is not None and not ray.wait([buffer.busy], timeout=0)[0]
        try:
            return buffer.stage(chunk_pieces(plan, collected.flat), node_id, in_use=in_use)
        except StagingUnavailable:
            if staging == "shm":
                raise
    return ray.put([c.data for c in create_chunk_data(plan, collected.flat)])


def staging_mode(staging: str | None) -> str:
    """``staging``, else ``RAYCKPT_STAGING``, else "auto"; checked."""
    mode = staging or os.environ.get(STAGING_ENV) or "auto"
    if mode not in STAGING_MODES:
        raise ValueError(f"staging={mode!r}: expected one of {', '.join(STAGING_MODES)}")
    return mode


def _staging_buffer() -> StagingBuffer:
    global _buffer
    if _buffer is None:
        _buffer = StagingBuffer()
        atexit.register(_close_buffer)
    return _buffer


def prepare_staging(state_dict: dict[str, Any], staging: str | None = None) -> int:
    """Make this process's staging buffer before its first ``save_async`` (not collective).

    The first save otherwise pays for creating it (0.5-0.6 s more stall at 1 GB on
    the benchmark machine). Sized to every local tensor of ``state_dict``, which a
    rank's share never exceeds. Returns the buffer's size in bytes: 0 with
    ``staging="object_store"`` or when ``/dev/shm`` cannot hold it ("shm" raises).
    """
    mode = staging_mode(staging)
    if mode == "object_store":
        return 0
    flat = flatten(state_dict)
    buffer = _staging_buffer()
    try:
        buffer.reserve(staged_size([leaf.local for leaf in flat.tensors.values()]))
    except StagingUnavailable:
        if mode == "shm":
            raise
        return 0
    return buffer.capacity


def release_staging() -> None:
    """Free this process's staging buffer (the next ``save_async`` makes a new one).

    Waits for an in-flight save first, so no writer is still reading it.
    """
    try:
        wait_inflight()
    finally:
        _close_buffer()


def _close_buffer() -> None:
    global _buffer
    if _buffer is not None:
        _buffer.close()
        _buffer = None


def wait_inflight() -> CatalogEntry | None:
    """Wait for this process's in-flight save, if any (raises if it failed)."""
    global _inflight
    previous, _inflight = _inflight, None
    return previous.wait() if previous is not None else None
