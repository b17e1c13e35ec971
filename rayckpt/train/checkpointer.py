"""``Checkpointer``: async sharded checkpoints inside a ``TorchTrainer`` loop, resumed with any worker count.

Inside ``train_loop_per_worker`` (every worker)::

    ckpt = Checkpointer()
    step = ckpt.restore(state) or 0         # any worker count: N -> M
    ...
    ckpt.save(step, state, {"loss": loss})  # async; reported to Ray Train once committed
    ...
    ckpt.wait()

Checkpoints are written straight under the run's directory in
``RunConfig.storage_path`` as ``rayckpt-step-<step>`` and reported with
``checkpoint_upload_mode=ASYNC`` and an upload function that only waits for
the commit, so Ray never copies the files, ``CheckpointConfig`` retention and
``ray.train.get_checkpoint()`` work as usual, and training is not blocked.
"""

from __future__ import annotations

import logging
import posixpath
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import ray
import ray.train

from ..data.loaders import resume
from ..engine.coordinator import default_coordinator
from ..engine.load import LoadInfo
from ..engine.save import SaveOptions
from ..engine.state import FlatState, flatten
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, RestoreFailedError, SaveFailedError
from ..ray import metrics
from ..ray.memory.store import peer_bytes
from ..ray.metadata.actor import DEFAULT_COMMIT_TIMEOUT_S, get_metadata_actor
from ..ray.rank.async_save import DEFAULT_LANE, prepare_staging, start_save, wait_inflight
from ..ray.rank.loading import load as ray_load
from ..ray.rank.options import RayOptions, SaveDestination
from ..ray.rank.save_handle import SaveHandle
from ..storage.catalog import CatalogEntry, checkpoint_dir_name, latest_committed
from .announce import SaveAnnouncer
from .restore import candidates, fell_back, ray_data_names, reason, restored, warn_ray_data
from .run_id import attempt_key
from .tiers import MEMORY, STORAGE, MemoryTier, SaveSettings, TierPolicy, memory_need

logger = logging.getLogger(__name__)


class Checkpointer:
    """Async sharded checkpoints of a TorchTrainer run. Create one per worker, in the train loop.

    Checkpoints go to ``<storage_path>/<run name>/rayckpt-step-<step:08d>``; with a memory
    tier, also to the nodes' memory (``rayckpt.ray.memory``). Where each save goes and how
    it is reported: docs/internals.md, "The Checkpointer's saves".

    Args:
        block_size: Bytes per block checksum of every save (as for ``save_async``).
        report: Report each storage save to Ray Train once committed, announcing it as it
            settles; False: not reported, announced when ``wait()`` or the next ``save()`` learns it.
        commit_timeout_s: A save fails unless committed within it.
        local_is_shared: As for ``save_async``.
        staging: As for ``save_async``.
        memory_every: Save every ``memory_every``-th step to the nodes' memory (0: no memory tier).
        persist_every: Save every ``persist_every``-th step to storage.
        memory_keep: How many memory checkpoints are kept, the newest (``release_memory()`` frees them).
        memory_skip_busy: Skip a memory save while the one before it is unwritten on some
            rank (False: wait for it).
        overlap: As for ``save_async``: True copies the tensors of an ``AppState``'s optimizer
            beside the next forward and backward (its step waits for the copy); False copies
            everything before ``save`` returns; ``"all"`` copies everything beside training.
        incremental: Storage saves write only the chunks that changed since the run's last committed
            one, into the shared store beside the checkpoints (False: each self-contained).
        full_every: With ``incremental``: every ``full_every``-th storage save shares nothing (0: never).
        data: The job's place in its data, saved with every checkpoint of either tier and resumed by
            ``restore`` under any worker count: a ``rayckpt.data.ResumableSampler`` or the loader
            around it (docs/data.md). ``save`` and ``restore`` take one of their own too.

    Attributes:
        restarts: Rank 0: worker groups of this ``fit()`` started before this one (Ray Train's
            restarts and resizes, counted by the MetadataActor's ``begin_attempt``); None elsewhere.
        last_load: After ``restore``: its ``LoadInfo``.
        restored_metadata: After ``restore``: the checkpoint's user metadata.
        restored_from: After ``restore``: ``{"tier", "path", "step", "bytes_read", "peer_bytes"}``.
        fallbacks: After ``restore``: the checkpoints passed over, newest first.
        staging_bytes: The size of the staging buffers ``restore`` makes in the background.
        memory_skipped: Memory saves skipped because the one before was still unwritten.

    Raises:
        ValueError: ``memory_every``, ``persist_every`` or ``memory_keep`` is not a whole number in range,
            or ``overlap`` is not True, False or "all".
    """

    def __init__(
        self,
        *,
        block_size: int | None = None,
        report: bool = True,
        commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S,
        local_is_shared: bool | None = None,
        staging: str | None = None,
        memory_every: int = 0,
        persist_every: int = 1,
        memory_keep: int = 2,
        memory_skip_busy: bool = True,
        overlap: bool | str = True,
        incremental: bool = True,
        full_every: int = 0,
        data: Any = None,
    ) -> None:
        #: Where each step's save goes (``tiers.TierPolicy``): storage every ``persist_every`` steps, the
        #: nodes' memory every ``memory_every`` steps between (0: no memory tier).
        self.policy = TierPolicy(memory_every, persist_every, memory_keep)
        #: Skip a memory save while the save before it is unwritten (``False``: wait for it, as storage saves do).
        self.memory_skip_busy = memory_skip_busy
        ctx = ray.train.get_context()
        storage = ctx.get_storage()
        self.run: str = ctx.get_experiment_name()
        self.run_root: str = storage.experiment_fs_path
        self.filesystem = storage.storage_filesystem
        self.rank: int = ctx.get_world_rank()
        #: How the saves write and run on Ray, checked once (each tier's records: ``SaveSettings.for_tier``).
        self.settings = SaveSettings(
            write=SaveOptions(block_size=block_size, incremental=bool(incremental), full_every=full_every),
            on_ray=RayOptions(
                staging=staging, overlap=overlap, commit_timeout_s=commit_timeout_s, local_is_shared=local_is_shared
            ),
            report=report,
        )
        #: What ``save`` takes the data position from and ``restore`` resumes (None: no data position).
        self.data = data
        #: Size of this worker's staging buffer made by ``restore`` (0: none).
        self.staging_bytes = 0
        #: What the last ``restore`` loaded (``LoadInfo``), for logs and tests.
        self.last_load: LoadInfo | None = None
        #: The user metadata of the checkpoint the last ``restore`` loaded (``{}``: none loaded).
        self.restored_metadata: dict[str, Any] = {}
        #: The checkpoints the last ``restore`` passed over, newest first: ``{"path", "step", "reason", "next", ...}``.
        self.fallbacks: list[dict[str, Any]] = []
        #: The memory tier of the run (``None``: ``memory_every=0``).
        self.memory = MemoryTier(self.run, self.policy) if self.policy.memory_every else None
        self._local_ranks = ctx.get_local_world_size()
        #: Where the last ``restore`` read from (``peer_bytes``: from another node's memory; ``{}``: nothing restored).
        self.restored_from: dict[str, Any] = {}
        #: Memory saves skipped because the save before them was not yet written on some rank.
        self.memory_skipped = 0
        #: Rank 0 prints ``rayckpt: <run> committed step N (...)`` (or a failure line) per save.
        self.announcer = SaveAnnouncer(self.run, self.rank)
        #: The same for memory saves: ``rayckpt: <run> (memory) committed step N (...)``.
        self.memory_announcer = SaveAnnouncer(f"{self.run} (memory)", self.rank)
        #: The last save begun here of each tier and when (``time.perf_counter()``): ``wait()`` announces
        #: their outcomes. Storage and memory saves are in flight side by side (``save_async``'s lanes).
        self._last: dict[str, tuple[SaveHandle, float]] = {}
        #: Rank 0: worker groups of this Ray Train run started before this one (0: the first); else ``None``.
        self.restarts: int | None = None
        if self.rank == 0:
            metrics.keep_set("rayckpt_run_active", 1, self, run=self.run)  # while this rank 0 lives
            self.restarts = ray.get(
                get_metadata_actor().begin_attempt.remote(self.run, attempt_key(self.run), ctx.get_world_size())
            )
        #: The run's checkpoints when this worker started (the first ``restore`` plans from it, later ones re-scan).
        self._found: list[CatalogEntry] | None = self._register_run(STORAGE)
        self._found_memory: list[CatalogEntry] | None = None
        if self.memory is not None and self.restarts:
            # A new group of the same fit(): the memory saves the earlier group left in flight are failed
            # (as begin_attempt fails its storage saves), so their leases do not refuse this group's.
            reason = f"its worker group was replaced (Ray Train restart {self.restarts})"
            ray.get(get_metadata_actor().fail_pending.remote(self.memory.run, reason))
        if self.memory is not None:
            self._found_memory = self._register_run(MEMORY)

    def _register_run(self, tier: str) -> list[CatalogEntry]:
        """Make the run's checkpoints of ``tier`` known to the MetadataActor; its catalog of them, oldest first."""
        m = self.memory if tier == MEMORY else None
        where = (m.run, m.root, m.filesystem) if m is not None else (self.run, self.run_root, self.filesystem)
        return ray.get(get_metadata_actor().register_run.remote(*where))

    def path(self, step: int) -> str:
        """Where step ``step``'s checkpoint is (or would be): ``<run_root>/rayckpt-step-<step:08d>``."""
        return posixpath.join(self.run_root, checkpoint_dir_name(step))

    def save(
        self,
        step: int,
        state: dict[str, Any],
        metrics: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        persist: bool | None = None,
        data: Any = None,
    ) -> SaveHandle | None:
        """Start saving ``state`` as step ``step`` (collective); return a ``SaveHandle`` once its copy is launched.

        A storage save goes through ``save_async`` and is reported to Ray Train once
        committed (Ray never copies its files; ``CheckpointConfig`` retention deletes old
        ones). With a memory tier a step may go to memory, storage or both, and a memory
        save may be skipped or go to storage instead: docs/internals.md, "The
        Checkpointer's saves". Waits first for this worker's previous save of each tier.

        Args:
            step: The training step; it names the checkpoint directory.
            state: The state to save (this rank's share of it is staged).
            metrics: Reported to Ray Train with ``step``, and kept in the manifest.
            metadata: JSON-able user metadata for the manifest (``restore`` gives it back).
            persist: True: to storage whatever ``persist_every`` says; False: to memory only.
            data: The data position's source for this save in place of the constructor's ``data``.

        Returns:
            The storage save's handle when there is one, else the memory save's, else None.

        Raises:
            SaveFailedError: The previous save of a tier failed (and no ``wait()`` raised it),
                or this one could not start (as for ``save_async``).
        """
        tiers = self.policy.tiers(step, persist)
        metrics = dict(metrics or {}, step=step)
        data = data if data is not None else self.data
        handle = None
        if MEMORY in tiers:
            state = flatten(state)  # once, for both tiers: its Stateful objects' state_dict() is not free
            if (go := self._memory_go(step, state)) == MEMORY:
                handle = self._save_to_memory(step, state, metrics, metadata, data)
            elif go == STORAGE:
                tiers = (STORAGE,)  # no room in some node's budget: to storage instead (one WARNING)
        # Else flattened by the save itself, inside its first collective: a rank whose state cannot be
        # saved then fails every rank.
        return self._save_to_storage(step, state, metrics, metadata, data) if STORAGE in tiers else handle

    def _save_to_storage(
        self,
        step: int,
        state: dict[str, Any] | FlatState,
        metrics: dict[str, Any],
        metadata: dict[str, Any] | None,
        data: Any,
    ) -> SaveHandle:
        """``save`` to storage, reported to Ray Train; waits first for the storage save before it."""
        self._wait(STORAGE)  # what ``save_async`` does first, here so the previous save's outcome is announced
        handle = self._start(STORAGE, step, state, {**(metadata or {}), "metrics": metrics}, data)
        if self.settings.report:
            from ray.train import Checkpoint, CheckpointUploadMode

            def wait_for_commit(checkpoint: Checkpoint, _dir_name: str) -> Checkpoint:
                self._announced_wait(handle, handle.wait)
                return checkpoint

            ray.train.report(
                metrics,
                checkpoint=Checkpoint(path=self.path(step), filesystem=self.filesystem),
                checkpoint_dir_name=checkpoint_dir_name(step),
                checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                checkpoint_upload_fn=wait_for_commit,
                delete_local_checkpoint_after_upload=False,
            )
        return handle

    def _memory_go(self, step: int, flat: FlatState) -> str | None:
        """Whether a memory save goes ahead, goes to storage instead or is skipped (``MemoryTier.go``);
        a skipped one is counted here (training does not wait for a memory save: the next step tries again)."""
        assert self.memory is not None
        if not self.memory_skip_busy:
            self._wait(MEMORY)
        last = self._last.get(MEMORY)
        busy = last is not None and not last[0].done()
        go = self.memory.go(step, busy, memory_need(flat, self._local_ranks), self.rank, self.run)
        self.memory_skipped += go is None
        return go

    def _save_to_memory(
        self, step: int, state: FlatState, metrics: dict[str, Any], metadata: dict[str, Any] | None, data: Any
    ) -> SaveHandle:
        """``save`` to the memory tier, in its own lane (beside a storage save still being written)."""
        self._wait(MEMORY)  # written on every rank (``_memory_go``): its commit is at hand
        return self._start(MEMORY, step, state, {**(metadata or {}), "metrics": metrics}, data)

    def _start(
        self, tier: str, step: int, state: dict[str, Any] | FlatState, metadata: dict[str, Any], data: Any
    ) -> SaveHandle:
        """Start the save of ``step`` to ``tier`` (``save_async``, its options as records)."""
        write, on_ray = self.settings.for_tier(tier)
        m = self.memory if tier == MEMORY else None
        where = (m.path(step), m.run, m.filesystem) if m is not None else (self.path(step), self.run, self.filesystem)
        dest = SaveDestination(checkpoint_id=where[0], run=where[1], step=step, filesystem=where[2])
        began = time.perf_counter()
        handle = start_save(state, dest, replace(write, metadata=metadata, data=data), on_ray)
        self._last[tier] = (handle, began)
        return handle

    def release_memory(self) -> None:
        """Rank 0: wait for the save in flight, then free the run's memory checkpoints (its last save persisted)."""
        self.wait()
        if self.memory is not None and self.rank == 0:
            self.memory.drop_all()

    def latest(self) -> CatalogEntry | None:
        """The run's latest committed checkpoint, from the MetadataActor's catalog.

        The catalog is re-read from storage, so this holds after the actor was
        killed and recreated. A checkpoint whose manifest is damaged is listed as
        corrupt and passed over: the newest good one is returned.
        """
        return latest_committed(self._register_run(STORAGE))

    def restore(self, state: dict[str, Any], data: Any = None) -> int | None:
        """Load the newest committed checkpoint that restores into ``state`` (collective; any worker count).

        Every rank tries rank 0's list of the run's committed checkpoints, newest first,
        passing over one whose data is damaged or gone for the next older one
        (docs/guarantees.md, "Restoring a run"). Then it starts making this worker's
        staging buffers in the background (``prepare_staging``), so the first save only copies.

        Args:
            state: The target, filled in place (as for ``rayckpt.load``).
            data: Continued from the restored checkpoint's data position (in place of the
                constructor's ``data``): this rank's share of the rest of the epoch. A checkpoint
                without a position restarts the epoch, with one WARNING.

        Returns:
            The restored step; None when the run has no checkpoint (``state`` untouched).

        Raises:
            RestoreFailedError: No committed checkpoint restores (naming each one tried and why).
            IncompatibleStateError: ``state`` does not fit the checkpoint (a changed model).
            DataPositionError: The checkpoint's data position is of another dataset or another
                length (both named).
        """
        step = self._load_latest(state, data if data is not None else self.data)
        staging = self.settings.on_ray.staging
        self.staging_bytes = prepare_staging(state, staging)
        if self.memory is not None:  # the memory lane's own buffer: it stages while a storage save is written
            self.staging_bytes += prepare_staging(state, staging, lane=MEMORY)
        return step

    def _candidates(self) -> tuple[list[tuple[str, int | None, str]], list[tuple[str, int | None, str]]]:
        """What ``restore`` tries and what it passes over at once (``restore.candidates``)."""
        entries, self._found = self._found, None
        if entries is None:
            entries = self._register_run(STORAGE)
        held: list[CatalogEntry] = []
        if self.memory is not None:
            held, self._found_memory = self._found_memory, None
            if held is None:
                held = self._register_run(MEMORY)
        ray_ckpt = ray.train.get_checkpoint()
        return candidates(entries, held, ray_ckpt.path if ray_ckpt is not None else None)

    def _load_latest(self, state: dict[str, Any], data: Any) -> int | None:
        # Every rank tries rank 0's list: the ranks' catalogs were read at different moments (an
        # earlier group's save may commit in between), and all must load the same checkpoint.
        candidates, passed_over = default_coordinator().all_gather(self._candidates())[0]
        self.fallbacks = []
        self.restored_from = {}
        failed = list(passed_over)
        began = time.perf_counter()
        for path, step, tier in candidates:
            if failed:
                self._fell_back(failed[-1], (path, step))
            # Ray Train's checkpoints live on the run's storage filesystem too
            filesystem, run = self.filesystem, self.run
            if tier == MEMORY and self.memory is not None:
                filesystem, run = self.memory.filesystem, self.memory.run
            from_peers = peer_bytes()
            try:
                self.last_load = ray_load(state, path, run=run, filesystem=filesystem)
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                failed.append((path, step, reason(exc)))
                continue
            metadata = ray.get(get_metadata_actor().user_metadata.remote(path, filesystem))
            self.restored_metadata = metadata
            if data is not None:
                resume(data, ray.get(get_metadata_actor().data_position.remote(path, filesystem)), path)
            restored_step = metadata.get("step")
            peer = peer_bytes() - from_peers
            self.restored_from = {
                "tier": tier,
                "path": path,
                "step": restored_step,
                "bytes_read": self.last_load.bytes_read,
                "peer_bytes": peer,
            }
            world = ray.train.get_context().get_world_size()
            restored(self.run, self.rank, world, self.restored_from, time.perf_counter() - began)
            if self.rank == 0 and (names := ray_data_names()):
                warn_ray_data(self.run, restored_step, names)
            return restored_step
        if failed:
            tried = "; ".join(f"step {s} at {p}: {why}" for p, s, why in failed)
            raise RestoreFailedError(
                f"run {self.run!r}: no committed checkpoint could be restored ({len(failed)} tried, newest first): "
                f"{tried}. Nothing was restored; repair or remove them (rayckpt verify / rayckpt rm) to start over"
            )
        return None

    def _fell_back(self, failed: tuple[str, int | None, str], to: tuple[str, int | None]) -> None:
        """Record that ``failed`` (path, step, reason) could not be restored and ``to`` is tried instead."""
        path, step, reason = failed
        self.fallbacks.append({"path": path, "step": step, "reason": reason, "next": to[0], "next_step": to[1]})
        if self.rank == 0:
            fell_back(self.run, self.fallbacks[-1])

    def wait(self) -> CatalogEntry | None:
        """Block until this worker's in-flight saves (storage and memory) are committed.

        Returns:
            The newest one's ``CatalogEntry``; None when none was in flight.

        Raises:
            SaveFailedError: The first failure, once both are settled.
        """
        newest = max(self._last, key=lambda tier: self._last[tier][1], default=STORAGE)
        entries, failed = {}, []
        for tier in (MEMORY, STORAGE):
            try:
                entries[tier] = self._wait(tier)
            except SaveFailedError as exc:
                failed.append(exc)
        if failed:
            raise failed[0]
        return entries[newest]

    def _wait(self, tier: str) -> CatalogEntry | None:
        """``wait()`` for the save in flight of one tier (its lane), announcing its outcome."""
        lane = MEMORY if tier == MEMORY else DEFAULT_LANE
        if tier not in self._last:
            return wait_inflight(lane)
        handle, _ = self._last[tier]
        return self._announced_wait(handle, lambda: wait_inflight(lane))

    def _announced_wait(self, handle: SaveHandle, wait: Callable[[], CatalogEntry | None]) -> CatalogEntry | None:
        """``wait()`` for ``handle``'s outcome (Ray Train's upload thread, or this worker's next
        save or ``wait``), then announce it (rank 0, once per save)."""
        announcer = self.announcer
        if self.memory is not None and handle.run == self.memory.run:
            announcer = self.memory_announcer
        try:
            entry = wait()
        except SaveFailedError as exc:
            announcer.announce(handle.save_id, handle.step, error=str(exc))
            raise
        if entry is not None and entry.save_id == handle.save_id:
            announcer.announce(handle.save_id, handle.step, entry, seconds=handle.commit_seconds)
        return entry
