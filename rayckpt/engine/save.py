"""``save``: collect -> plan -> write -> commit, the steps every save path shares.

Roles: every rank calls ``save`` (collective when a process group is
initialized); rank 0 commits. ``collect_state`` is the first step of every save,
``rayckpt.save`` and the Ray async save alike: each rank flattens its state, one
all-gather shares every rank's boxes and values, and every rank computes the
same save plans and ``SaveSpec``. Then each rank writes its share
(``write_share`` here; on Ray the node's ShardWriter does, from shared memory)
and the committer (rank 0 here; the MetadataActor on Ray) calls
``storage.commit.commit_save``. Each step ends in one all-gather that carries
failures, so an error on any rank is raised on every rank and nobody hangs.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from ..errors import InvalidStateError, RayckptError, SaveFailedError
from ..format.paths import Path
from ..format.shard_file import DEFAULT_BLOCK_SIZE
from ..format.values import encode_value
from ..planning import save_plan
from ..planning.save_plan import LocalShard, SavePlan, create_save_plans
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import SaveSpec, WrittenShard, commit_save, new_save_id, remove_failed_save
from ..storage.lease import LeaseKeeper, claim_location, release_lease
from .coordinator import Coordinator, default_coordinator, gather_or_raise
from .state import FlatState, flatten
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
    block_size: int = DEFAULT_BLOCK_SIZE,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = True,
) -> SaveInfo:
    """Save ``state_dict`` to ``checkpoint_id`` (a path or a ``pyarrow.fs`` URI).

    Called by every rank of the process group, if one is initialized. Sharded
    DTensors are written by their owners; replicated data once. The checkpoint
    exists once ``manifest.json`` is committed by rank 0 after every rank's files
    are durable. On any rank's failure every rank raises ``SaveFailedError`` (or
    the shared error type), this save's files are removed and a previous
    checkpoint at the same location stays loadable.

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
    ctx = collect_state(coord, state_dict, block_size=block_size, metadata=metadata, claim=ckdir, overwrite=overwrite)
    written_files: list[str] = []
    try:
        # Rank 0 owns the lease it claimed: refreshed while the save runs, deleted when it ends.
        with LeaseKeeper(ckdir, ctx.spec.save_id) if coord.rank == 0 else nullcontext():
            shards = gather_or_raise(
                coord, "save (writing shards)", lambda: write_share(ckdir, ctx, written_files), SaveFailedError
            )

            def commit() -> int:
                return commit_save(ckdir, ctx.spec, shards).total_bytes if coord.rank == 0 else 0

            total = gather_or_raise(coord, "save (commit)", commit, SaveFailedError)[0]
    except RayckptError:
        remove_failed_save(ckdir, ctx.spec.save_id, written_files)
        raise
    num_files = sum(len(s.files) for s in shards)
    return SaveInfo(ckdir.location, ctx.spec.save_id, total, num_files, coord.world_size)


@dataclass(frozen=True, slots=True)
class SaveContext:
    """A save after its first step, on one rank: what every rank agreed on, and this rank's state."""

    #: The save as the committer sees it; the same on every rank.
    spec: SaveSpec
    rank: int
    #: Every rank's save plan, by rank.
    plans: tuple[SavePlan, ...]
    #: The node each rank runs on, by rank ("" when not on Ray).
    nodes: tuple[str, ...]
    #: This rank's flattened state (its local tensors).
    flat: FlatState

    @property
    def plan(self) -> SavePlan:
        """This rank's share of the save."""
        return self.plans[self.rank]


def collect_state(
    coord: Coordinator,
    state_dict: dict[str, Any],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    metadata: dict[str, Any] | None = None,
    node: str = "",
    claim: CheckpointDir | None = None,
    overwrite: bool = True,
) -> SaveContext:
    """Save steps collect and plan (collective): flatten, share every rank's boxes, plan the writes.

    ``node``: where this rank runs (the Ray node id), shared with every rank.
    ``claim``: where the save goes; rank 0 claims it for the new save id before
    sharing the id, so before any rank writes (``lease.claim_location``, with
    ``overwrite``). When this step succeeds the lease is rank 0's to keep and
    release; when it fails, it is released here.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    flat_holder: list[FlatState] = []

    def collect() -> tuple[list[LocalShard], dict[str, Any], tuple[str | None, str | None], str, dict[str, Path]]:
        flat = flatten(state_dict)
        flat_holder.append(flat)
        shards = [LocalShard(t.key, t.dtype, t.shape, box) for t in flat.tensors.values() for box in t.boxes()]
        values = {k: encode_value(v.value, k) for k, v in flat.values.items()}
        save_id = previous = None
        if coord.rank == 0:
            save_id = new_save_id()
            if claim is not None:
                previous = claim_location(claim, save_id, overwrite=overwrite)
                claimed.append(save_id)
        return shards, values, (save_id, previous), node, flat.paths

    claimed: list[str] = []
    try:
        gathered = gather_or_raise(coord, "save (collecting state)", collect, SaveFailedError)
        values = _merge_values([g[1] for g in gathered], {s.key for g in gathered for s in g[0]})
        plans = create_save_plans([g[0] for g in gathered], save_plan.MAX_CHUNK_BYTES)
    except BaseException:
        if claimed:
            release_lease(claim, claimed[0])
            remove_failed_save(claim, claimed[0])
        raise
    tensors = {s.key: (s.dtype, s.shape) for g in gathered for s in g[0]}
    paths = {k: p for g in reversed(gathered) for k, p in g[4].items()}  # the lowest rank's wins
    save_id, previous = gathered[0][2]
    spec = SaveSpec(save_id, coord.world_size, block_size, tensors, values, dict(metadata or {}), paths, previous)
    return SaveContext(spec, coord.rank, tuple(plans), tuple(g[3] for g in gathered), flat_holder[0])


def _merge_values(per_rank: Sequence[dict[str, Any]], tensor_keys: set[str]) -> dict[str, Any]:
    """Replicated plain values: the lowest rank that has a key wins."""
    merged: dict[str, Any] = {}
    for values in per_rank:
        for k, v in values.items():
            if k in tensor_keys:
                raise InvalidStateError(f"key {k!r} is a tensor on one rank and a plain value on another")
            merged.setdefault(k, v)
    return merged


def write_share(ckdir: CheckpointDir, ctx: SaveContext, written_files: list[str]) -> WrittenShard:
    """Save step write, in this process: this rank's chunks into its shard files."""
    chunks = create_chunk_data(ctx.plan, ctx.flat)
    return write_chunks(ckdir, chunks, ctx.spec.save_id, ctx.rank, ctx.spec.block_size, written_files)
