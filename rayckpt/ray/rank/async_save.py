"""Async saves through the Ray actors: the rank blocks for planning and the part of its copy no optimizer owns.

A save, across the processes it runs in (every rank calls ``save_async``):

1. Every rank plans (``engine.save.collect_state``: flatten, share, plan); rank 0
   first claims the location (a lease, ``storage.lease``).
2. Rank 0 registers the save with the MetadataActor (``begin_save``, not waited
   for; it answers with the actor's incarnation); every other rank asks the
   actor's ``incarnation()`` (not waited for either). Both go out while the
   rank's threads copy its share (step 3), before the share is sent.
3. Each rank copies its share once into the node's shared memory (its staging
   buffer, or Ray's object store); ``save_async`` returns a ``SaveHandle`` and
   training goes on, a guarded optimizer's tensors still being copied (``copier``).
   Once all of it is copied, the rank calls its node's ShardWriter ``write``.
4. The ShardWriter writes the share's files (``engine.writer.write_chunks``) and
   calls the MetadataActor's ``report_written``; if writing fails it removes the
   files and calls ``report_failed``.
5. The MetadataActor commits once the save is registered and every rank's files
   are durable (``metadata.commit_tracker``: the manifest last), or fails it and
   removes its files.
6. Each rank's ``SaveHandle.wait()`` waits for its ShardWriter's ``write``, then
   asks the MetadataActor's ``wait_commit`` for the outcome.

A process's saves of one lane are owned by one ``AsyncSaver``: the save in flight and the staging
buffer it reuses (docs/internals.md, "The staging buffer" and "Lanes").
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import time
from dataclasses import replace
from typing import Any

import pyarrow.fs as pafs
import ray

from ...engine.coordinator import Coordinator, default_coordinator
from ...engine.save import SaveContext, SaveOptions, collect_state
from ...engine.state import FlatState
from ...engine.writer import chunk_specs, create_chunk_data, parts_here
from ...errors import InvalidStateError, SaveFailedError
from ...storage.catalog import CatalogEntry
from ...storage.checkpoint_dir import CheckpointDir
from ...storage.commit import remove_failed_save
from ...storage.lease import release_lease
from .. import metrics
from ..metadata.actor import DEFAULT_COMMIT_TIMEOUT_S, get_metadata_actor
from ..metadata.layout_cache import LayoutRef, SpecLayout, split_spec
from ..records import SaveTarget, run_and_tier
from ..shm import StagedRegion
from ..writer.actor import ShardWrite, get_shard_writer
from .copier import Copying, CopyJob, launch
from .options import DEFAULT_LANE, RayOptions, SaveDestination
from .save_handle import (
    LOCAL_IS_SHARED_ENV,
    SaveHandle,
    StartedSave,
    actor_location,
    local_is_shared_by_env,
    report_failed,
)
from .staging import StagingBuffer, StagingUnavailable, local_pieces, of_device, staged_size, staging_mode


class AsyncSaver:
    """A process's async saves of one lane: the one in flight and the staging buffer they reuse.

    One per process and lane (``saver(lane)``): a rank trains in one process, and
    its staging buffer is sized to that process's share. Saves of two lanes (a
    ``Checkpointer``'s storage and memory saves) are in flight side by side, each
    staged in its own buffer.
    """

    def __init__(self) -> None:
        self.inflight: SaveHandle | None = None
        #: The reusable staging buffer in ``/dev/shm``, made on first use.
        self.buffer: StagingBuffer | None = None
        #: Rank 0: the layout of its last save, put in the object store (and the Ray job that
        #: owns the reference): every registration sends it, the actor reads it only when it lacks it.
        self.layout: tuple[LayoutRef, str] | None = None

    def save(
        self,
        state_dict: dict[str, Any] | FlatState,
        dest: SaveDestination,
        coordinator: Coordinator,
        options: SaveOptions,
        on_ray: RayOptions,
    ) -> SaveHandle:
        """``save_async`` (see there), its options as records."""
        staging = staging_mode(on_ray.staging)
        self.wait()
        start = time.perf_counter()
        run, step, filesystem = dest.run, dest.step, dest.filesystem
        ckdir = CheckpointDir.resolve(dest.checkpoint_id, filesystem)
        node_id = ray.get_runtime_context().get_node_id()
        metadata = {"step": step, "run": run, **(options.metadata or {})}
        # Rank 0 claims the location (a lease) before any rank writes; the MetadataActor
        # keeps the lease fresh from the registration on and releases it when the save settles.
        ctx = collect_state(coordinator, state_dict, replace(options, metadata=metadata), node=node_id, claim=ckdir)
        try:
            _check_reachable(ckdir, ctx, on_ray.local_is_shared)
        except BaseException:
            if ctx.rank == 0:
                release_lease(ckdir, ctx.spec.save_id)
                remove_failed_save(ckdir, ctx.spec.save_id)
            raise
        target = SaveTarget(
            save_id=ctx.spec.save_id,
            run=run,
            step=step,
            location=actor_location(ckdir, filesystem),
            filesystem=filesystem,
            rank=ctx.rank,
        )
        # The actor incarnation the save begins under (not waited for): its writer and wait() pass it on.
        calls = SaveCalls(self, ctx, target, ckdir, node_id=node_id, timeout=on_ray.commit_timeout_s)
        try:
            copying = Copying(
                overlap=on_ray.overlap, send=calls.send, fail=calls.fail, started=start, meanwhile=calls.begin
            )
            staged_ref, job = self.stage_share(ctx, node_id, staging, copying)
        except Exception as exc:
            if exc is calls.refused:  # the registration failed, and said so
                raise
            if not calls.began:  # failed before the registration went out: the actor settles the save
                with contextlib.suppress(Exception):  # (its lease, its files) once it is registered
                    calls.begin()
            failed = f"staging: {type(exc).__name__}: {exc}"
            report_failed(target, failed)
            raise SaveFailedError(
                f"save of step {step} to {ckdir.location}: staging failed on rank {ctx.rank}: {exc}"
            ) from exc
        stall = time.perf_counter() - start
        run_name, tier = run_and_tier(run)
        metrics.send("rayckpt_save_stall_seconds", stall, run=run_name, tier=tier, rank=ctx.rank)
        started = StartedSave(
            copy=job,
            staged_ref=staged_ref,
            stall_seconds=stall,
            registered=calls.registered,
            incarnation=calls.incarnation,
        )
        self.inflight = SaveHandle(target, ckdir, started, timeout=on_ray.commit_timeout_s, on_outcome=self._seen)
        return self.inflight

    def _seen(self, handle: SaveHandle) -> None:
        """A save whose outcome its caller has seen no longer holds up the next save."""
        if self.inflight is handle:
            self.inflight = None

    def register(self, meta: Any, ctx: SaveContext, target: SaveTarget, ckdir: CheckpointDir, timeout: float) -> Any:
        """Rank 0: register the save with the MetadataActor (sent, not waited for, no collective).

        The actor commits a save only once it is registered; ``wait()`` on rank 0
        checks that it was, and a registration that cannot even be sent fails the
        save for every rank. The spec goes without its tensors and paths, with a
        reference to them put in the object store once per layout (``metadata.layout_cache``).
        """
        try:
            spec, ref = ctx.spec, None
            if ctx.layout:
                spec, layout = split_spec(ctx.spec)
                ref = self._layout_ref(ctx.layout, layout)
            return meta.begin_save.remote(spec, target.for_rank(None), timeout, ref)
        except Exception as exc:
            failed = f"registering with the MetadataActor: {type(exc).__name__}: {exc}"
            report_failed(target, failed)
            raise SaveFailedError(f"save of step {target.step} to {ckdir.location}: {failed}") from exc

    def _layout_ref(self, digest: bytes, layout: SpecLayout) -> LayoutRef:
        """The reference to this save's layout: the last save's while its digest repeats (in this Ray job).

        The job is named by its id and this process's node id: a process that
        joins a new Ray session (``ray.shutdown``, ``ray.init``) may get the same
        job id again, and the old session's reference is unknown to the new one.
        """
        context = ray.get_runtime_context()
        job = f"{context.get_job_id()}@{context.get_node_id()}"
        if self.layout is None or self.layout[0].digest != digest or self.layout[1] != job:
            self.layout = (LayoutRef(digest, ray.put(layout)), job)
        return self.layout[0]

    def stage_share(self, ctx: SaveContext, node_id: str, staging: str, copying: Copying) -> tuple[Any, CopyJob]:
        """Copy this rank's share into shared memory and send it to the writer (``copying.send``): into a
        ``StagedRegion`` of the staging buffer (``copier.launch``: with overlap, partly after this returns),
        or (``staging="object_store"``, or "auto" without room in ``/dev/shm``) into the object store, now."""
        if staging != "object_store":
            buffer = self._staging_buffer()
            in_use = buffer.busy is not None and not ray.wait([buffer.busy], timeout=0)[0]
            try:
                # With no buffer made beforehand (prepare_staging), this makes it: the first save pays for it.
                # Through the object store instead, while the buffer is made in the background, that first
                # stall is longer still (the object store maps and zeroes fresh pages too).
                return launch(buffer, ctx, node_id, in_use=in_use, copying=copying)
            except StagingUnavailable:
                if staging == "shm":
                    raise
        staged = ray.put([c.data for c in create_chunk_data(ctx.plan, ctx.flat)])
        return staged, CopyJob.finished(copying.send(staged), time.perf_counter() - copying.started)

    def _staging_buffer(self) -> StagingBuffer:
        if self.buffer is None:
            self.buffer = StagingBuffer()
            atexit.register(self.close_buffer)
        return self.buffer

    def wait(self) -> CatalogEntry | None:
        """Wait for the save in flight, if any (raises if it failed); the next save no longer waits for it."""
        previous, self.inflight = self.inflight, None
        return previous.wait_before_next_save() if previous is not None else None

    def prepare_staging(self, state_dict: dict[str, Any], staging: str | None = None, wait: bool = False) -> int:
        """``prepare_staging`` (see there)."""
        mode = staging_mode(staging)
        if mode == "object_store":
            return 0
        pieces = local_pieces(state_dict)
        if self.inflight is not None:
            self.inflight.wait_copied()  # the buffer may be replaced: not while a copy writes into it
        buffer = self._staging_buffer()
        _start_actors()
        try:
            planned = buffer.prepare(staged_size(pieces), of_device(pieces))
            if wait:
                buffer.ready()
        except StagingUnavailable:
            if mode == "shm":
                raise
            return 0
        return planned

    def release_staging(self) -> None:
        """Wait for the save in flight, then free the staging buffer."""
        try:
            self.wait()
        finally:
            self.close_buffer()

    def close_buffer(self) -> None:
        if self.inflight is not None:
            self.inflight.join_copy()  # its thread may still write into the buffer
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None


class SaveCalls:
    """One save's calls from this rank to the actors: rank 0's registration (the other ranks ask the actor's
    incarnation) and the node's writer looked up, made once while the share is copied (``begin``); then the
    copied share sent to that ShardWriter (``send``), or a copy that failed after the call returned told (``fail``).
    """

    def __init__(
        self,
        saver: AsyncSaver,
        ctx: SaveContext,
        target: SaveTarget,
        ckdir: CheckpointDir,
        *,
        node_id: str,
        timeout: float,
    ) -> None:
        self.saver, self.ctx, self.target, self.ckdir = saver, ctx, target, ckdir
        self.node_id, self.timeout = node_id, timeout
        self.began = False
        #: Rank 0: its ``begin_save`` (answered with the actor's incarnation); the others: ``incarnation()``.
        self.registered: Any = None
        self.incarnation: Any = None
        #: The registration's failure (reported already): the save call raises it as it is.
        self.refused: SaveFailedError | None = None
        self._request: ShardWrite | None = None
        self._writer: Any = None

    def begin(self) -> None:
        """Register (rank 0) or ask the incarnation, and look the writer up; once (a copy that falls back
        to the object store calls it again)."""
        if self.began:
            return
        self.began = True
        ctx, meta = self.ctx, get_metadata_actor()
        if ctx.rank == 0:
            try:
                self.registered = self.saver.register(meta, ctx, self.target, self.ckdir, self.timeout)
            except SaveFailedError as exc:
                self.refused = exc
                raise
        else:
            self.incarnation = meta.incarnation.remote()
        self._request = ShardWrite(
            target=self.target,
            block_size=ctx.spec.block_size,
            chunks=chunk_specs(ctx.plan, ctx.flat),
            max_parts=parts_here(ctx.spec.world_size, len(ctx.nodes)),
            increment=ctx.increment,
        )
        self._writer = get_shard_writer(self.node_id)

    def send(self, staged: Any) -> Any:
        """Once the share is copied (the writer never reads a piece before): the writer's ``write`` ref."""
        self.begin()
        incarnation = self.registered if self.incarnation is None else self.incarnation
        ref = self._writer.write.remote(self._request, staged, incarnation)
        if isinstance(staged, StagedRegion):
            self.saver.buffer.busy = ref  # the writer reads the buffer until this resolves
        return ref

    def fail(self, error: str) -> None:
        """The copy failed after the call returned."""
        report_failed(self.target, error)


def _start_actors() -> None:
    """Start this node's ShardWriter (not waited for) and look the MetadataActor up now: the first save
    then neither waits for the writer's process nor exports the actor's class (a cost paid once per process)."""
    if ray.is_initialized():
        get_shard_writer()
        get_metadata_actor()


def saver(lane: str = DEFAULT_LANE) -> AsyncSaver:
    """This process's ``AsyncSaver`` of ``lane``."""
    return _savers(lane)  # one cache key per lane, however it is named in the call


@functools.cache
def _savers(lane: str) -> AsyncSaver:
    return AsyncSaver()


def _check_reachable(ckdir: CheckpointDir, ctx: SaveContext, local_is_shared: bool | None) -> None:
    """Refuse a node-local path when the ranks run on several nodes (unless it is shared storage)."""
    if local_is_shared is None:
        local_is_shared = local_is_shared_by_env()
    nodes = set(ctx.nodes)
    if ckdir.is_local and len(nodes) > 1 and not local_is_shared:
        raise InvalidStateError(
            f"checkpoint location {ckdir.location} is node-local storage but the ranks run on {len(nodes)} nodes; "
            "every node must reach the same files: use shared storage (s3://..., gs://..., or an NFS path with "
            f"{LOCAL_IS_SHARED_ENV}=1)"
        )


def save_async(
    state_dict: dict[str, Any] | FlatState,
    checkpoint_id: str | Any,
    *,
    run: str = "default",
    step: int | None = None,
    filesystem: pafs.FileSystem | None = None,
    process_group: Any = None,
    coordinator: Coordinator | None = None,
    block_size: int | None = None,
    metadata: dict[str, Any] | None = None,
    commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S,
    local_is_shared: bool | None = None,
    staging: str | None = None,
    lane: str = DEFAULT_LANE,
    overlap: bool | str = True,
    incremental: bool = False,
    full_every: int = 0,
    data: Any = None,
) -> SaveHandle:
    """Start a save through the Ray actors; return a ``SaveHandle`` once this rank's copy is launched.

    Called by every rank (collective when a process group is initialized), inside a Ray
    worker or driver; the order of a save across the ranks, their ShardWriters and the
    MetadataActor is in this module's docstring. A call first waits for the previous
    save of its ``lane``. The staging buffer and lanes: docs/internals.md, "The
    staging buffer" and "Lanes".

    Args:
        state_dict: The state to save, or the ``FlatState`` that
            ``rayckpt.engine.state.flatten`` made of it (to flatten once for two saves).
        checkpoint_id: A local path, a URI ``pyarrow.fs`` understands, or a path on ``filesystem``.
        run: The run the save belongs to (its catalog, events and metrics).
        step: The training step, kept in the manifest's user metadata.
        filesystem: A ``pyarrow.fs.FileSystem`` that ``checkpoint_id`` is a path on.
        process_group: The ``torch.distributed`` group to plan across (default: the default group).
        coordinator: How the ranks agree, in place of ``process_group``.
        block_size: Bytes per block checksum (default: chosen by rank 0, as for ``rayckpt.save``).
        metadata: JSON-able data for the manifest's ``user_metadata`` (beside ``step`` and ``run``).
        commit_timeout_s: The save fails unless committed within it.
        local_is_shared: Whether a local path is shared storage (NFS); default ``RAYCKPT_LOCAL_IS_SHARED=1``.
        staging: ``"shm"`` (the process's staging buffer in ``/dev/shm``), ``"object_store"``
            (one ``ray.put``) or ``"auto"`` (``"shm"``, else the object store); default
            ``RAYCKPT_STAGING``, else ``"auto"``.
        lane: Saves of different lanes are in flight side by side, each staged in its own buffer.
        overlap: True: the tensors a guarded optimizer owns (``guard_optimizer``; ``AppState``
            guards its own) are copied on a background thread beside the next forward and
            backward, and that optimizer's next step waits for the copy; the rest is copied
            before the call returns. ``"all"``: every tensor is copied in the background
            (the caller keeps the state unchanged until ``SaveHandle.wait_copied()``). False:
            everything is copied before the call returns. Through the object store the copy
            is always made before the call returns. A tensor changed in place before its
            copy is done fails the save, naming its key (docs/guarantees.md, "Saves beside training").
        incremental: As for ``rayckpt.save`` (the ShardWriters write and share).
        full_every: As for ``rayckpt.save``.
        data: As for ``rayckpt.save``: the job's data position, saved in the manifest.

    Returns:
        The save's ``SaveHandle``; its ``wait()`` returns the committed ``CatalogEntry``.

    Raises:
        SaveFailedError: Another save holds the location (naming it, before anything is
            written); staging or the registration failed; a tensor copied before the call
            returned changed during its copy; or the previous save of this lane failed and
            no ``wait()`` raised it.
        PeerLostError: A peer died during the planning collectives (before anything is staged).
        InvalidStateError: A node-local path while the ranks run on several nodes, unless
            ``local_is_shared`` says it is shared storage.
        ValueError: ``staging`` is none of the three, or ``overlap`` is not True, False or "all".
    """
    on_ray = RayOptions(
        staging=staging,
        overlap=overlap,
        lane=lane,
        commit_timeout_s=commit_timeout_s,
        local_is_shared=local_is_shared,
    )
    options = SaveOptions(
        block_size=block_size, metadata=metadata, incremental=incremental, full_every=full_every, data=data
    )
    dest = SaveDestination(checkpoint_id=checkpoint_id, run=run, step=step, filesystem=filesystem)
    return start_save(state_dict, dest, options, on_ray, coordinator or default_coordinator(process_group))


def start_save(
    state_dict: dict[str, Any] | FlatState,
    dest: SaveDestination,
    options: SaveOptions,
    on_ray: RayOptions,
    coordinator: Coordinator | None = None,
) -> SaveHandle:
    """``save_async`` with its options as records (the ``Checkpointer``'s call); ``coordinator``:
    None: the default process group's."""
    return saver(on_ray.lane).save(state_dict, dest, coordinator or default_coordinator(), options, on_ray)


def prepare_staging(
    state_dict: dict[str, Any], staging: str | None = None, wait: bool = False, lane: str = DEFAULT_LANE
) -> int:
    """Make this process's staging buffer (of ``lane``) before its first ``save_async`` (not collective).

    Sized to every local tensor of ``state_dict``, which a rank's share never exceeds,
    and page-locked when the state is on a CUDA device. The buffer is made, and this
    node's ShardWriter started, on a background thread while training goes on, so the
    first ``save_async`` only copies; a save that comes before the buffer is ready
    waits for the rest. Without it the first ``save_async`` makes the buffer inside
    its own stall. ``Checkpointer.restore`` calls it.

    Args:
        state_dict: The state the next saves will save (its local tensors size the buffer).
        staging: As for ``save_async``; ``"object_store"`` makes no buffer.
        wait: Return once the buffer is made, not at once.
        lane: The lane whose buffer this is (``save_async``'s ``lane``).

    Returns:
        The buffer's size in bytes: 0 with ``staging="object_store"``, or with ``"auto"``
        when ``/dev/shm`` cannot hold it.

    Raises:
        StagingUnavailable: With ``staging="shm"``, a staging directory that cannot be
            written (a buffer it cannot hold fails the first save instead).
        ValueError: ``staging`` is none of the three.
    """
    return saver(lane).prepare_staging(state_dict, staging, wait)


def release_staging(lane: str = DEFAULT_LANE) -> None:
    """Free this process's staging buffer of ``lane`` (the next ``save_async`` makes a new one).

    Waits for an in-flight save first, so no writer is still reading it.

    Args:
        lane: The lane whose buffer to free.

    Raises:
        SaveFailedError: The save in flight failed (the buffer is freed all the same).
    """
    saver(lane).release_staging()


def wait_inflight(lane: str = DEFAULT_LANE) -> CatalogEntry | None:
    """Wait for this process's in-flight save of ``lane``, if any.

    Args:
        lane: The lane whose save to wait for.

    Returns:
        The save's ``CatalogEntry`` (``"failed"`` when its handle's ``wait()`` already raised
        the failure); ``None`` when none is in flight, or its handle already learned the outcome.

    Raises:
        SaveFailedError: The save failed and no ``wait()`` of its handle raised it.
    """
    return saver(lane).wait()
