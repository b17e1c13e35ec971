"""Async saves through the Ray actors: the rank blocks only for one copy into shared memory.

``save_async`` (every rank) runs the engine's first save step
(``engine.save.collect_state``: flatten, share, plan), registers the save with
the MetadataActor (rank 0, not waited for), copies this rank's share once into
the node's shared memory (its reusable staging buffer, or Ray's object store
when that buffer cannot be had) and hands it to the node's ShardWriter, which
runs the engine's write step; the MetadataActor runs the commit step when every
rank's files are durable. A process's saves are owned by one ``AsyncSaver``:
the save in flight and the staging buffer it reuses.
"""

from __future__ import annotations

import atexit
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import pyarrow.fs as pafs
import ray

from ..engine.coordinator import Coordinator, default_coordinator
from ..engine.save import SaveContext, collect_state
from ..engine.state import flatten
from ..engine.writer import chunk_pieces, chunk_specs, create_chunk_data
from ..errors import InvalidStateError, SaveFailedError
from ..format.shard_file import DEFAULT_BLOCK_SIZE
from ..storage.catalog import CatalogEntry, describe
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import remove_failed_save
from ..storage.lease import release_lease
from . import metrics
from .metadata_actor import DEFAULT_COMMIT_TIMEOUT_S, get_metadata_actor
from .shard_writer import ShardWrite, get_shard_writer
from .staging import StagedRegion, StagingBuffer, StagingUnavailable, staged_size

#: Set to 1 when a local path is on storage every node shares (NFS, a single machine).
LOCAL_IS_SHARED_ENV = "RAYCKPT_LOCAL_IS_SHARED"
#: Where ``save_async`` stages: "auto" (the reusable buffer, else the object store), "shm", "object_store".
STAGING_ENV = "RAYCKPT_STAGING"
STAGING_MODES = ("auto", "shm", "object_store")


def actor_location(ckdir: CheckpointDir, filesystem: Any) -> str:
    """How the actors reach ``ckdir``: its path on ``filesystem`` when one was given, else the user's URI."""
    return ckdir.fs_path if filesystem is not None else ckdir.location


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
        on_outcome: Callable[[SaveHandle], None] | None = None,
    ) -> None:
        self.save_id = save_id
        self.location = ckdir.location
        self.run = run
        self.step = step
        self.rank = rank
        #: Seconds this rank was blocked by ``save_async`` (plan + copy into shared memory).
        self.stall_seconds = stall_seconds
        #: Where the share was staged: "shm" (the reusable buffer) or "object_store".
        self.staging = "shm" if isinstance(staged_ref, StagedRegion) else "object_store"
        self._ckdir = ckdir
        self._filesystem = filesystem
        self._write_ref = write_ref
        self._staged_ref = staged_ref
        self._timeout = timeout
        self._entry: CatalogEntry | None = None
        #: Rank 0: the registration with the MetadataActor (``begin_save``), not yet waited for.
        self._registered = registered
        #: Told once the outcome is known (its saver stops holding the next save up for it).
        self._on_outcome = on_outcome

    def done(self) -> bool:
        """Whether this rank's share is written (the commit may still be pending)."""
        ready, _ = ray.wait([self._write_ref], timeout=0)
        return bool(ready)

    def wait(self, timeout: float | None = None) -> CatalogEntry:
        """Block until the checkpoint is committed; raise ``SaveFailedError`` if it failed."""
        if self._entry is None:
            self._entry = self._wait_outcome(timeout if timeout is not None else self._timeout)
            self._staged_ref = None  # release the staged copy in the object store
            if self._on_outcome is not None:
                self._on_outcome(self)
        if self._entry.status != "committed":
            raise SaveFailedError(
                f"save of step {self.step} to {self.location} (save {self.save_id}) failed; nothing was committed: "
                f"{self._entry.error}"
            )
        return self._entry

    def _wait_outcome(self, limit: float) -> CatalogEntry:
        meta = get_metadata_actor()
        try:
            ray.get(self._write_ref, timeout=limit)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"save {self.save_id} to {self.location}: not written within {limit}s") from None
        except Exception as exc:  # noqa: BLE001 - the writer died or raised: the save failed
            self._report_failed(meta, f"{type(exc).__name__}: {exc}")
        self._check_registered(meta, limit)
        try:
            entry = ray.get(meta.wait_commit.remote(self.save_id, limit))
        except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError):
            entry = self._entry_from_storage()
        if entry.status == "pending":
            raise TimeoutError(f"save {self.save_id} to {self.location}: not committed within {limit}s")
        return entry

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
            self.location,
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
    location = actor_location(ckdir, filesystem)
    ray.get(meta.report_failed.remote(save_id, rank, error, run, step, location, filesystem))


def staging_mode(staging: str | None) -> str:
    """``staging``, else ``RAYCKPT_STAGING``, else "auto"; checked."""
    mode = staging or os.environ.get(STAGING_ENV) or "auto"
    if mode not in STAGING_MODES:
        raise ValueError(f"staging={mode!r}: expected one of {', '.join(STAGING_MODES)}")
    return mode


class AsyncSaver:
    """A process's async saves: the one in flight and the staging buffer they reuse.

    One per process (``saver()``): a rank trains in one process, and its staging
    buffer is sized to that process's share.
    """

    def __init__(self) -> None:
        self.inflight: SaveHandle | None = None
        #: The reusable staging buffer in ``/dev/shm``, made on first use.
        self.buffer: StagingBuffer | None = None

    def save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str | Any,
        *,
        run: str,
        step: int | None,
        filesystem: pafs.FileSystem | None,
        coordinator: Coordinator,
        block_size: int,
        metadata: dict[str, Any] | None,
        commit_timeout_s: float,
        local_is_shared: bool | None,
        staging: str | None,
    ) -> SaveHandle:
        """``save_async`` (see there)."""
        staging = staging_mode(staging)
        self.wait()
        start = time.perf_counter()
        ckdir = CheckpointDir.resolve(checkpoint_id, filesystem)
        node_id = ray.get_runtime_context().get_node_id()
        metadata = {"step": step, "run": run, **(metadata or {})}
        # Rank 0 claims the location (a lease) before any rank writes; the MetadataActor
        # keeps the lease fresh from the registration on and releases it when the save settles.
        ctx = collect_state(
            coordinator, state_dict, block_size=block_size, metadata=metadata, node=node_id, claim=ckdir
        )
        try:
            _check_reachable(ckdir, ctx, local_is_shared)
        except BaseException:
            if ctx.rank == 0:
                release_lease(ckdir, ctx.spec.save_id)
                remove_failed_save(ckdir, ctx.spec.save_id)
            raise
        registered = None
        if ctx.rank == 0:
            registered = self._register(ctx, ckdir, filesystem, run, step, commit_timeout_s)
        try:
            staged_ref = self.stage_share(ctx, node_id, staging)  # the one copy: into shared memory
            request = ShardWrite(
                ctx.spec.save_id,
                actor_location(ckdir, filesystem),
                filesystem,
                ctx.rank,
                ctx.spec.block_size,
                chunk_specs(ctx.plan, ctx.flat),
            )
            write_ref = get_shard_writer(node_id).write.remote(request, staged_ref)
            if isinstance(staged_ref, StagedRegion):
                self.buffer.busy = write_ref  # the writer reads the buffer until this resolves
        except Exception as exc:
            failed = f"staging: {type(exc).__name__}: {exc}"
            report_failed(ctx.spec.save_id, ctx.rank, failed, run, step, ckdir, filesystem)
            raise SaveFailedError(
                f"save of step {step} to {ckdir.location}: staging failed on rank {ctx.rank}: {exc}"
            ) from exc
        stall = time.perf_counter() - start
        metrics.observe("rayckpt_save_stall_seconds", stall, run=run, rank=ctx.rank)
        self.inflight = SaveHandle(
            ctx.spec.save_id,
            ckdir,
            run,
            step,
            ctx.rank,
            write_ref,
            staged_ref,
            stall,
            commit_timeout_s,
            registered,
            filesystem,
            self._seen,
        )
        return self.inflight

    def _seen(self, handle: SaveHandle) -> None:
        """A save whose outcome its caller has seen no longer holds up the next save."""
        if self.inflight is handle:
            self.inflight = None

    @staticmethod
    def _register(
        ctx: SaveContext, ckdir: CheckpointDir, filesystem: Any, run: str, step: int | None, timeout: float
    ) -> Any:
        """Rank 0: register the save with the MetadataActor (sent, not waited for, no collective).

        The actor commits a save only once it is registered; ``wait()`` on rank 0
        checks that it was, and a registration that cannot even be sent fails the
        save for every rank.
        """
        location = actor_location(ckdir, filesystem)
        try:
            return get_metadata_actor().begin_save.remote(ctx.spec, location, filesystem, run, step, timeout)
        except Exception as exc:
            failed = f"registering with the MetadataActor: {type(exc).__name__}: {exc}"
            report_failed(ctx.spec.save_id, ctx.rank, failed, run, step, ckdir, filesystem)
            raise SaveFailedError(f"save of step {step} to {ckdir.location}: {failed}") from exc

    def stage_share(self, ctx: SaveContext, node_id: str, staging: str) -> Any:
        """Copy this rank's share into shared memory: a ``StagedRegion`` of the staging
        buffer, or (``staging="object_store"``, or "auto" without room in ``/dev/shm``)
        an object-store ref to the chunks' arrays."""
        if staging != "object_store":
            buffer = self._staging_buffer()
            in_use = buffer.busy is not None and not ray.wait([buffer.busy], timeout=0)[0]
            try:
                return buffer.stage(chunk_pieces(ctx.plan, ctx.flat), node_id, in_use=in_use)
            except StagingUnavailable:
                if staging == "shm":
                    raise
        return ray.put([c.data for c in create_chunk_data(ctx.plan, ctx.flat)])

    def _staging_buffer(self) -> StagingBuffer:
        if self.buffer is None:
            self.buffer = StagingBuffer()
            atexit.register(self.close_buffer)
        return self.buffer

    def wait(self) -> CatalogEntry | None:
        """Wait for the save in flight, if any (raises if it failed); the next save no longer waits for it."""
        previous, self.inflight = self.inflight, None
        return previous.wait() if previous is not None else None

    def prepare_staging(self, state_dict: dict[str, Any], staging: str | None = None) -> int:
        """``prepare_staging`` (see there)."""
        mode = staging_mode(staging)
        if mode == "object_store":
            return 0
        flat = flatten(state_dict)
        buffer = self._staging_buffer()
        try:
            buffer.reserve(staged_size([p.local for leaf in flat.tensors.values() for p in leaf.pieces]))
        except StagingUnavailable:
            if mode == "shm":
                raise
            return 0
        return buffer.capacity

    def release_staging(self) -> None:
        """Wait for the save in flight, then free the staging buffer."""
        try:
            self.wait()
        finally:
            self.close_buffer()

    def close_buffer(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None


@functools.cache
def saver() -> AsyncSaver:
    """This process's ``AsyncSaver``."""
    return AsyncSaver()


def _check_reachable(ckdir: CheckpointDir, ctx: SaveContext, local_is_shared: bool | None) -> None:
    """Refuse a node-local path when the ranks run on several nodes (unless it is shared storage)."""
    if local_is_shared is None:
        local_is_shared = os.environ.get(LOCAL_IS_SHARED_ENV, "") == "1"
    nodes = set(ctx.nodes)
    if ckdir.is_local and len(nodes) > 1 and not local_is_shared:
        raise InvalidStateError(
            f"checkpoint location {ckdir.location} is node-local storage but the ranks run on {len(nodes)} nodes; "
            "every node must reach the same files: use shared storage (s3://..., gs://..., or an NFS path with "
            f"{LOCAL_IS_SHARED_ENV}=1)"
        )


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
    a Ray worker or driver. Another save writing to the same location (another
    run's) makes every rank raise ``SaveFailedError`` naming it, before anything
    is written (rank 0's claim, ``storage.lease``). At most one save is in flight per process: a second
    call first waits for the previous one (and raises if it failed). A local path
    with workers on several nodes is refused unless it is shared storage
    (``local_is_shared=True`` or ``RAYCKPT_LOCAL_IS_SHARED=1``).

    ``staging`` (default ``RAYCKPT_STAGING`` or "auto"): "shm" copies the share
    into this process's staging buffer in ``/dev/shm``, kept and reused from save
    to save (memory already mapped: the fastest copy); "object_store" ``ray.put``s
    it; "auto" is "shm", falling back to the object store when ``/dev/shm`` cannot
    hold the share.
    """
    return saver().save(
        state_dict,
        checkpoint_id,
        run=run,
        step=step,
        filesystem=filesystem,
        coordinator=coordinator or default_coordinator(process_group),
        block_size=block_size,
        metadata=metadata,
        commit_timeout_s=commit_timeout_s,
        local_is_shared=local_is_shared,
        staging=staging,
    )


def prepare_staging(state_dict: dict[str, Any], staging: str | None = None) -> int:
    """Make this process's staging buffer before its first ``save_async`` (not collective).

    The first save otherwise pays for creating it (0.5-0.6 s more stall at 1 GB on
    the benchmark machine). Sized to every local tensor of ``state_dict``, which a
    rank's share never exceeds. Returns the buffer's size in bytes: 0 with
    ``staging="object_store"`` or when ``/dev/shm`` cannot hold it ("shm" raises).
    """
    return saver().prepare_staging(state_dict, staging)


def release_staging() -> None:
    """Free this process's staging buffer (the next ``save_async`` makes a new one).

    Waits for an in-flight save first, so no writer is still reading it.
    """
    saver().release_staging()


def wait_inflight() -> CatalogEntry | None:
    """Wait for this process's in-flight save, if any (raises if it failed)."""
    return saver().wait()
