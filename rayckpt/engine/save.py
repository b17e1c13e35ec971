"""``save``: collect -> plan -> write -> commit, the steps every save path shares.

Roles: every rank calls ``save`` (collective when a process group is
initialized); rank 0 commits. ``collect_state`` is the first step of every save,
``rayckpt.save`` and the Ray async save alike: each rank flattens its state,
rank 0 gathers the ranks' layouts, plans every rank's writes and sends each
rank its own plan, and holds the ``SaveSpec`` the committer needs (the plans
are cached while the layouts repeat: ``save_layout``). Then each rank writes its share
(``write_own_share`` here; on Ray the node's ShardWriter does, from shared memory)
and the committer (rank 0 here; the MetadataActor on Ray) calls
``storage.commit.commit_save``. Each step ends in one all-gather that carries
failures, so an error on any rank is raised on every rank and nobody hangs.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import pyarrow.fs as pafs

from ..errors import PeerLostError, RayckptError, SaveFailedError
from ..format.file_paths import written_bytes
from ..format.manifest import MANIFEST_NAME
from ..phases import log_phases, phase, timed
from ..planning.save_plan import SavePlan
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import (
    SaveSpec,
    WrittenFiles,
    WrittenShard,
    commit_save,
    new_save_id,
    read_manifest,
    remove_failed_save,
)
from ..storage.lease import LeaseKeeper, claim_location, release_lease
from ..storage.shared import keeps_name
from .coordinator import Coordinator, default_coordinator, gather_or_raise
from .coordinator import claim as claim_decision
from .increments import FULL, Increment, choose_base, confirm_base, forget_choice
from .save_layout import PlanAgreement, PlanCache, SaveIds
from .state import FlatState
from .writer import ShareSpec, create_chunk_data, parts_here, write_rank_share


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveInfo:
    """What ``save`` returns on every rank: the committed checkpoint and where this rank's time went."""

    #: The checkpoint's location, credentials redacted.
    path: str
    #: The save's id, which its shard files' names start with.
    save_id: str
    #: Bytes of the shard files this save wrote, every rank's (the manifest and its chunk table not
    #: counted; an incremental save's shared files neither).
    bytes_written: int
    #: The checkpoint's shard files, every rank's.
    num_files: int
    world_size: int
    #: Where this rank's time went, in seconds (``rayckpt.phases``): ``plan`` (flatten, the planning
    #: collectives), ``lease_claim`` (rank 0), ``write`` (shard files), ``fsync``, ``gather_writes`` (waiting
    #: for every rank's files), rank 0's commit (``manifest_build``, ``commit_check``, ``manifest_encode``,
    #: ``chunk_table_write``, ``manifest_write``, ``sweep``), ``gather_commit`` (the others waiting for it),
    #: ``lease_release``, ``other`` and ``total``. Exclusive: they add up to ``total``.
    phases: dict[str, float] = field(default_factory=dict, compare=False)


def save(
    state_dict: dict[str, Any],
    checkpoint_id: str | Any,
    *,
    process_group: Any = None,
    coordinator: Coordinator | None = None,
    filesystem: pafs.FileSystem | None = None,
    block_size: int | None = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = True,
    incremental: bool = False,
    full_every: int = 0,
    data: Any = None,
) -> SaveInfo:
    """Save ``state_dict`` to ``checkpoint_id`` as one checkpoint, each rank writing its own shards.

    Collective when a process group is initialized (every rank calls it); works in
    a single process without one. The checkpoint exists once rank 0 has committed
    its ``manifest.json``; until then a previous one at the location stays loadable.

    Call order (each step ends in a collective that carries failures, so an error
    on any rank is raised on every rank and no rank is left waiting):

    1. Each rank flattens ``state_dict`` (calling Stateful objects' ``state_dict()``
       in sorted key order) and sends its layout to rank 0.
    2. Rank 0 claims the location with a lease file, picks the save id and block
       size, plans every rank's writes and sends each rank its own plan.
    3. Each rank writes its chunks into its own shard files (CUDA tensors copied to
       the CPU first) and makes them durable.
    4. Rank 0 (the committer) writes the manifest atomically, deletes the files of
       the checkpoint it replaced and of dead saves, and releases the lease.

    What a state dict may hold, how replicated data is stored once, and what
    happens when a rank fails, a rank dies or two saves race for one location:
    ``docs/guarantees.md``, "Save semantics".

    Args:
        state_dict: Nested dicts and lists of tensors, DTensors (FSDP2 / HSDP
            shards), plain values (JSON-able ones, ``bytes``, ``io.BytesIO``) and
            Stateful objects. A plain tensor or value is stored once, from the lowest
            rank holding its key: give per-rank state a per-rank key.
        checkpoint_id: A local path, a URI ``pyarrow.fs`` understands (``file://``,
            ``s3://``, ``gs://``, ``hdfs://``), or a path on ``filesystem``.
        process_group: The ``torch.distributed`` process group to save across;
            None: the default group when one is initialized, else this process alone.
        coordinator: How the ranks agree, in place of ``process_group`` (tests pass
            their own); None: from ``process_group``.
        filesystem: A ``pyarrow.fs.FileSystem`` that ``checkpoint_id`` is a path on.
        block_size: Bytes per block checksum. None: 64 KiB, larger for states past
            32 GiB (``shard_file.auto_block_size``), chosen by rank 0 for every rank.
        metadata: JSON-able data stored in the manifest's ``user_metadata``.
        overwrite: Whether a checkpoint committed at the location is replaced
            (atomically). False (DCP's writer option): such a save is refused.
        incremental: Write the shard files into the shared store beside the
            checkpoint directory (``<parent>/.rayckpt-shared``) and share every chunk
            that did not change since this process's last committed incremental save
            beside it (docs/guarantees.md, "Incremental saves"). False: a
            self-contained checkpoint.
        full_every: With ``incremental``: every ``full_every``-th save of a chain
            shares nothing (0: never).
        data: The job's place in its data, saved in the manifest's ``data_position``: a
            ``rayckpt.data.ResumableSampler`` or the loader around it (docs/data.md). Every
            rank's share is combined into one position that resumes under any world size.

    Returns:
        This rank's ``SaveInfo``: the location, the save id, the checkpoint's bytes
            and files, the world size, and ``phases``, where this rank's seconds
            went (also logged at DEBUG by the ``rayckpt.phases`` logger).

    Raises:
        ValueError: ``full_every`` is not a whole number >= 0.
        InvalidStateError: ``state_dict`` holds something the pickle-free format
            cannot store (a ``set``, a custom object, a ``ShardedTensor``), named by
            its key, before any file is written.
        DataPositionError: ``data`` cannot say what was consumed, or the ranks are at
            different data positions (``rayckpt.data.share_of``, ``combine``), before any file is written.
        CheckpointExistsError: ``overwrite=False`` and the location holds a
            committed checkpoint, which is left untouched.
        PeerLostError: A collective of the save failed (a rank died); the process
            group cannot be used again.
        SaveFailedError: A rank failed, or another save is in flight at the
            location. Raised on every rank, naming each failed rank; nothing is
            committed. Any other exception inside ``save`` is wrapped in one.

    Example:
        ```python
        from rayckpt.app_state import AppState

        app = AppState(model, optimizer)
        info = rayckpt.save({"app": app}, "s3://bucket/run/step-100")
        rayckpt.load({"app": app}, "s3://bucket/run/step-100")
        ```
    """
    coord = coordinator or default_coordinator(process_group)
    ckdir = CheckpointDir.resolve(checkpoint_id, filesystem)
    options = SaveOptions(
        block_size=block_size,
        metadata=metadata,
        overwrite=overwrite,
        incremental=incremental,
        full_every=full_every,
        data=data,
    )
    try:
        with timed() as clock:
            info = _save(coord, ckdir, state_dict, options)
        phases = clock.result()
        log_phases("save to", ckdir.location, coord.rank, phases)
        return replace(info, phases=phases)
    except RayckptError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever broke, the caller gets a SaveFailedError
        raise SaveFailedError(
            f"save to {ckdir.location} failed on rank {coord.rank}: {type(exc).__name__}: {exc}"
        ) from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveOptions:
    """How a save writes: ``save``'s and ``save_async``'s options of that name (see ``save``).

    Raises:
        ValueError: ``full_every`` is not a whole number >= 0.
    """

    #: Bytes per block checksum (None: rank 0 picks it); checked by the save's first step.
    block_size: int | None = None
    #: JSON-able data for the manifest's ``user_metadata``.
    metadata: dict[str, Any] | None = None
    overwrite: bool = True
    incremental: bool = False
    full_every: int = 0
    #: The job's place in its data: a ``ResumableSampler`` or the loader around it (``rayckpt.data``);
    #: None: no data position is saved.
    data: Any = None

    def __post_init__(self) -> None:
        full_every_count(self.full_every)


def full_every_count(value: Any) -> int:
    """``full_every`` checked: a whole number >= 0."""
    if type(value) is not int or value < 0:
        raise ValueError(f"full_every must be a whole number >= 0 (0: never), got {value!r}")
    return value


def _save(coord: Coordinator, ckdir: CheckpointDir, state_dict: dict[str, Any], options: SaveOptions) -> SaveInfo:
    ctx = collect_state(coord, state_dict, options, claim=ckdir)
    save_id = ctx.spec.save_id
    files = WrittenFiles(ckdir, save_id)
    shards: list[WrittenShard] = []
    committed: list[int] = []  # rank 0, once the manifest is written: the checkpoint's bytes

    def commit() -> int:
        if coord.rank != 0:
            return 0
        if claim_decision(coord, _decision_key(save_id), "commit") not in ("commit", None):
            raise SaveFailedError(
                f"rank 0 did not commit save {save_id}: a rank gave up on it after a collective failed"
            )
        manifest = commit_save(ckdir, ctx.spec, shards)
        committed.append(written_bytes(manifest.save_id, manifest.files))
        return committed[0]

    try:
        # Rank 0 owns the lease it claimed: refreshed while the save runs, deleted when it ends.
        with LeaseKeeper(ckdir, save_id) if coord.rank == 0 else nullcontext():
            write = partial(write_own_share, files, ctx)
            with phase("gather_writes"):
                shards = gather_or_raise(coord, "save (writing shards)", write, SaveFailedError, PeerLostError)
            with phase("gather_commit"):
                total = gather_or_raise(coord, "save (commit)", commit, SaveFailedError, PeerLostError)[0]
    except BaseException as exc:
        if committed:  # rank 0 wrote the manifest: the checkpoint is complete whatever broke after
            if not isinstance(exc, Exception):
                raise
            return SaveInfo(
                path=ckdir.location,
                save_id=save_id,
                bytes_written=committed[0],
                num_files=sum(len(s.files) for s in shards),
                world_size=coord.world_size,
            )
        if isinstance(exc, RayckptError) and not isinstance(exc, PeerLostError):
            files.remove_save()  # every rank saw this failure: nobody commits
            raise
        return _settle_lost(coord, files, exc)
    num_files = sum(len(s.files) for s in shards)
    return SaveInfo(
        path=ckdir.location, save_id=save_id, bytes_written=total, num_files=num_files, world_size=coord.world_size
    )


def _decision_key(save_id: str) -> str:
    return f"save/{save_id}/decision"


def _settle_lost(coord: Coordinator, files: WrittenFiles, exc: BaseException) -> SaveInfo:
    """This rank left a save without knowing how the others ended (a collective failed, or it was interrupted).

    Rank 0, the only committer, knows it did not commit. Another rank asks the
    process group's store: if no rank took the commit, its "abort" wins (rank 0
    will not commit) and it removes the save's files; if rank 0 took it, the
    files stay (the manifest may name them) and the save counts as committed once
    its manifest is there. Raises ``PeerLostError`` (or ``exc`` itself when it is
    not an ``Exception``), unless the save is committed.
    """
    ckdir, save_id = files.ckdir, files.save_id
    decision = "abort" if coord.rank == 0 else claim_decision(coord, _decision_key(save_id), "abort")
    if decision == "abort":
        files.remove_save()
        outcome = f"rank {coord.rank} removed the files of save {save_id}; nothing was committed"
    elif decision == "commit":
        if _committed_id(ckdir) == save_id:
            manifest = read_manifest(ckdir)
            total = sum(f.size for f in manifest.files)
            return SaveInfo(
                path=ckdir.location,
                save_id=save_id,
                bytes_written=total,
                num_files=len(manifest.files),
                world_size=coord.world_size,
            )
        outcome = (
            f"rank 0 had taken the commit of save {save_id} when this rank lost it, so rank {coord.rank} "
            f"kept its files: check whether {ckdir.location} holds save {save_id} (the next save there "
            "removes them if not)"
        )
    else:
        outcome = (
            f"rank {coord.rank} could not reach the process group's store to learn whether rank 0 commits "
            f"save {save_id}, so rank {coord.rank} kept its files (the next save at {ckdir.location} "
            "removes them if not)"
        )
    if not isinstance(exc, Exception):
        raise exc
    message = str(exc) if isinstance(exc, PeerLostError) else f"save failed on rank {coord.rank}: {exc!r}"
    raise PeerLostError(f"{message}; {outcome}") from exc


def _committed_id(ckdir: CheckpointDir) -> str | None:
    try:
        return read_manifest(ckdir).save_id
    except Exception:  # noqa: BLE001 - no manifest, or not one this rank can read: not committed here
        return None


#: This process's save plans: the ones ``rayckpt.save`` and the Ray saves of a process
#: reuse while every rank's layout repeats (``save_layout.PlanCache``).
PROCESS_PLANS = PlanCache()


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveContext:
    """A save after its first step, on one rank: what the ranks agreed on, and this rank's state."""

    #: The save as the committer sees it, on rank 0. Other ranks hold the same ids, world
    #: size, block size and metadata but no tensors, values or paths (only the committer needs them).
    spec: SaveSpec
    rank: int
    #: This rank's share of the save.
    plan: SavePlan
    #: The nodes the ranks run on, each once ("" when not on Ray).
    nodes: tuple[str, ...]
    #: This rank's flattened state (its local tensors).
    flat: FlatState
    #: Whether the plan came from this process's plan cache (``save_layout``).
    cached: bool = False
    #: Digest of every rank's layout (``save_layout``): saves with equal digests have equal
    #: ``spec.tensors`` and ``spec.paths`` (the MetadataActor keeps them per digest).
    layout: bytes = b""
    #: Whether the save is incremental and which save it shares with (``increments``).
    increment: Increment = FULL


def collect_state(
    coord: Coordinator,
    state_dict: dict[str, Any] | FlatState,
    options: SaveOptions = SaveOptions(),
    *,
    node: str = "",
    claim: CheckpointDir | None = None,
    plans: PlanCache | None = None,
) -> SaveContext:
    """Save steps collect and plan (collective): flatten, agree on the save id, plan the writes.

    Rank 0 plans every rank's writes and each rank receives its own plan; the
    plans are cached while every rank's layout repeats (``save_layout``).
    ``state_dict``: flattened here (inside the first collective, so that a rank whose
    state cannot be saved fails every rank), unless the caller did (a ``FlatState``).
    ``node``: where this rank runs (the Ray node id), sent to rank 0.
    ``claim``: where the save goes; rank 0 claims it for the new save id before
    sharing the id, so before any rank writes (``lease.claim_location``, with
    ``options.overwrite``). When this step succeeds the lease is rank 0's to keep and
    release; when it fails, it is released here. ``options.incremental`` (with ``claim``):
    rank 0 also picks the save's base (``increments``), every ``options.full_every``-th save none.
    ``plans``: where the plans are cached (default ``PROCESS_PLANS``).
    """
    block_size, incremental = options.block_size, options.incremental
    if block_size is not None and block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    claimed: list[str] = []

    def claim_ids() -> SaveIds:
        save_id = new_save_id()
        previous = None
        increment = FULL
        if claim is not None:
            if incremental:
                choose_base(claim, save_id, options.full_every)
            try:
                previous = claim_location(claim, save_id, overwrite=options.overwrite)
            except BaseException:
                forget_choice(save_id)
                claim.delete(keeps_name(save_id))
                if not claim.exists(MANIFEST_NAME):
                    claim.delete_dir_if_empty()
                raise
            claimed.append(save_id)
            if incremental:
                increment = confirm_base(claim, save_id)
        return SaveIds(save_id, previous, increment)

    agreement = PlanAgreement(
        coord, plans or PROCESS_PLANS, node=node, claim=claim_ids, block_size=block_size, data=options.data
    )
    try:
        with phase("plan"):
            a = agreement.agree(state_dict)
    except BaseException:
        if claimed:
            release_lease(claim, claimed[0])
            remove_failed_save(claim, claimed[0])
        raise
    spec = SaveSpec(
        save_id=a.ids.save_id,
        world_size=coord.world_size,
        block_size=a.block_size,
        tensors=a.root.tensors,
        values=a.root.values,
        metadata=dict(options.metadata or {}),
        paths=a.root.paths,
        previous=a.ids.previous,
        data_position=a.data_position,
    )
    return SaveContext(
        spec=spec,
        rank=coord.rank,
        plan=a.plan,
        nodes=a.nodes,
        flat=a.flat,
        cached=a.cached,
        layout=a.layouts,
        increment=a.ids.increment,
    )


def write_own_share(files: WrittenFiles, ctx: SaveContext) -> WrittenShard:
    """Save step write, in this process: this rank's chunks into its shard files (added to ``files``)."""
    with phase("write"):
        chunks = create_chunk_data(ctx.plan, ctx.flat)
        parts = parts_here(ctx.spec.world_size, len(ctx.nodes))
        share = ShareSpec(rank=ctx.rank, block_size=ctx.spec.block_size, max_parts=parts, increment=ctx.increment)
        return write_rank_share(files, chunks, share)
