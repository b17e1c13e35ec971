"""``save``: collect -> plan -> write -> commit, the steps every save path shares.

Roles: every rank calls ``save`` (collective when a process group is
initialized); rank 0 commits. ``collect_state`` is the first step of every save,
``rayckpt.save`` and the Ray async save alike: each rank flattens its state,
rank 0 gathers the ranks' layouts, plans every rank's writes and sends each
rank its own plan, and holds the ``SaveSpec`` the committer needs (the plans
are cached while the layouts repeat: ``save_layout``). Then each rank writes its share
(``write_share`` here; on Ray the node's ShardWriter does, from shared memory)
and the committer (rank 0 here; the MetadataActor on Ray) calls
``storage.commit.commit_save``. Each step ends in one all-gather that carries
failures, so an error on any rank is raised on every rank and nobody hangs.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import pyarrow.fs as pafs

from ..errors import PeerLostError, RayckptError, SaveFailedError
from ..planning.save_plan import SavePlan
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import (
    SaveSpec,
    WrittenShard,
    commit_save,
    new_save_id,
    read_manifest,
    remove_failed_save,
)
from ..storage.lease import LeaseKeeper, claim_location, release_lease
from .coordinator import Coordinator, default_coordinator, gather_or_raise
from .coordinator import claim as claim_decision
from .save_layout import agree_on_plan
from .state import FlatState
from .writer import create_chunk_data, write_chunks


@dataclass(frozen=True, slots=True)
class SaveInfo:
    """What ``save`` returns on every rank."""

    path: str
    save_id: str
    bytes_written: int
    num_files: int
    world_size: int


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
) -> SaveInfo:
    """Save ``state_dict`` to ``checkpoint_id`` (a path or a ``pyarrow.fs`` URI).

    Called by every rank of the process group, if one is initialized. Sharded
    DTensors are written by their owners; replicated data once. The checkpoint
    exists once ``manifest.json`` is committed by rank 0 after every rank's files
    are durable. On any rank's failure every rank raises ``SaveFailedError`` (or
    the shared error type), this save's files are removed and a previous
    checkpoint at the same location stays loadable. A peer that dies mid-save
    (the collective fails) gives ``PeerLostError`` on the ranks left; they remove
    this save's files unless rank 0 had already taken the commit.

    ``block_size``: bytes per block checksum; None: 64 KiB, larger for states past
    32 GiB (``shard_file.auto_block_size``), chosen by rank 0 for every rank.

    ``overwrite=False``: refuse (``CheckpointExistsError`` on every rank, before
    anything is written) when the location already holds a committed checkpoint;
    by default a new save replaces it atomically.

    Rank 0 first claims the location (a lease file, ``storage.lease``): when
    another save (another job) is writing there, every rank raises
    ``SaveFailedError`` naming the location and that save's id, before anything
    is written, and the other save goes on untouched.
    """
    coord = coordinator or default_coordinator(process_group)
    ckdir = CheckpointDir.resolve(checkpoint_id, filesystem)
    try:
        return _save(coord, ckdir, state_dict, block_size, metadata, overwrite)
    except RayckptError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever broke, the caller gets a SaveFailedError
        raise SaveFailedError(
            f"save to {ckdir.location} failed on rank {coord.rank}: {type(exc).__name__}: {exc}"
        ) from exc


def _save(
    coord: Coordinator,
    ckdir: CheckpointDir,
    state_dict: dict[str, Any],
    block_size: int | None,
    metadata: dict[str, Any] | None,
    overwrite: bool,
) -> SaveInfo:
    ctx = collect_state(coord, state_dict, block_size=block_size, metadata=metadata, claim=ckdir, overwrite=overwrite)
    save_id = ctx.spec.save_id
    written_files: list[str] = []
    shards: list[WrittenShard] = []
    committed: list[int] = []  # rank 0, once the manifest is written: the checkpoint's bytes

    def commit() -> int:
        if coord.rank != 0:
            return 0
        if claim_decision(coord, _decision_key(save_id), "commit") not in ("commit", None):
            raise SaveFailedError(
                f"rank 0 did not commit save {save_id}: a rank gave up on it after a collective failed"
            )
        committed.append(commit_save(ckdir, ctx.spec, shards).total_bytes)
        return committed[0]

    try:
        # Rank 0 owns the lease it claimed: refreshed while the save runs, deleted when it ends.
        with LeaseKeeper(ckdir, save_id) if coord.rank == 0 else nullcontext():
            write = partial(write_share, ckdir, ctx, written_files)
            shards = gather_or_raise(coord, "save (writing shards)", write, SaveFailedError, PeerLostError)
            total = gather_or_raise(coord, "save (commit)", commit, SaveFailedError, PeerLostError)[0]
    except BaseException as exc:
        if committed:  # rank 0 wrote the manifest: the checkpoint is complete whatever broke after
            if not isinstance(exc, Exception):
                raise
            return SaveInfo(ckdir.location, save_id, committed[0], sum(len(s.files) for s in shards), coord.world_size)
        if isinstance(exc, RayckptError) and not isinstance(exc, PeerLostError):
            remove_failed_save(ckdir, save_id, written_files)  # every rank saw this failure: nobody commits
            raise
        return _settle_lost(coord, ckdir, save_id, written_files, exc)
    num_files = sum(len(s.files) for s in shards)
    return SaveInfo(ckdir.location, save_id, total, num_files, coord.world_size)


def _decision_key(save_id: str) -> str:
    return f"save/{save_id}/decision"


def _settle_lost(
    coord: Coordinator, ckdir: CheckpointDir, save_id: str, written_files: list[str], exc: BaseException
) -> SaveInfo:
    """This rank left a save without knowing how the others ended (a collective failed, or it was interrupted).

    Rank 0, the only committer, knows it did not commit. Another rank asks the
    process group's store: if no rank took the commit, its "abort" wins (rank 0
    will not commit) and it removes the save's files; if rank 0 took it, the
    files stay (the manifest may name them) and the save counts as committed once
    its manifest is there. Raises ``PeerLostError`` (or ``exc`` itself when it is
    not an ``Exception``), unless the save is committed.
    """
    decision = "abort" if coord.rank == 0 else claim_decision(coord, _decision_key(save_id), "abort")
    if decision == "abort":
        remove_failed_save(ckdir, save_id, written_files)
        outcome = f"rank {coord.rank} removed the files of save {save_id}; nothing was committed"
    elif decision == "commit":
        if _committed_id(ckdir) == save_id:
            manifest = read_manifest(ckdir)
            total = sum(f.size for f in manifest.files)
            return SaveInfo(ckdir.location, save_id, total, len(manifest.files), coord.world_size)
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


@dataclass(frozen=True, slots=True)
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


def collect_state(
    coord: Coordinator,
    state_dict: dict[str, Any],
    *,
    block_size: int | None = None,
    metadata: dict[str, Any] | None = None,
    node: str = "",
    claim: CheckpointDir | None = None,
    overwrite: bool = True,
) -> SaveContext:
    """Save steps collect and plan (collective): flatten, agree on the save id, plan the writes.

    Rank 0 plans every rank's writes and each rank receives its own plan; the
    plans are cached while every rank's layout repeats (``save_layout``).
    ``node``: where this rank runs (the Ray node id), sent to rank 0.
    ``claim``: where the save goes; rank 0 claims it for the new save id before
    sharing the id, so before any rank writes (``lease.claim_location``, with
    ``overwrite``). When this step succeeds the lease is rank 0's to keep and
    release; when it fails, it is released here.
    """
    if block_size is not None and block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    claimed: list[str] = []

    def claim_ids() -> tuple[str, str | None]:
        save_id = new_save_id()
        previous = None
        if claim is not None:
            previous = claim_location(claim, save_id, overwrite=overwrite)
            claimed.append(save_id)
        return save_id, previous

    try:
        a = agree_on_plan(coord, state_dict, node, claim_ids, block_size)
    except BaseException:
        if claimed:
            release_lease(claim, claimed[0])
            remove_failed_save(claim, claimed[0])
        raise
    spec = SaveSpec(
        a.save_id, coord.world_size, a.block_size, a.tensors, a.values, dict(metadata or {}), a.paths, a.previous
    )
    return SaveContext(spec, coord.rank, a.plan, a.nodes, a.flat, a.cached, a.layouts)


def write_share(ckdir: CheckpointDir, ctx: SaveContext, written_files: list[str]) -> WrittenShard:
    """Save step write, in this process: this rank's chunks into its shard files."""
    chunks = create_chunk_data(ctx.plan, ctx.flat)
    return write_chunks(ckdir, chunks, ctx.spec.save_id, ctx.rank, ctx.spec.block_size, written_files)
