"""``save`` and ``load``: plan, write, commit, read.

Roles: every rank calls ``save`` / ``load`` (collective when a process group is
initialized). Rank 0 commits. Each phase ends in one all-gather that carries
failures, so an error on any rank is raised on every rank and nobody hangs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from ..errors import InvalidStateError, RayckptError, SaveFailedError
from ..format.manifest import (
    FileEntry,
    encode_value,
)
from ..format.shard_file import (
    DEFAULT_BLOCK_SIZE,
    WrittenChunk,
)
from ..planning import save_plan
from ..planning.save_plan import LocalShard, SavePlan, create_save_plans
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import commit_manifest, create_manifest
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
) -> SaveInfo:
    """Save ``state_dict`` to ``checkpoint_id`` (a path or a ``pyarrow.fs`` URI).

    Called by every rank of the process group, if one is initialized. Sharded
    DTensors are written by their owners; replicated data once. The checkpoint
    exists once ``manifest.json`` is committed by rank 0 after every rank's files
    are durable. On any rank's failure every rank raises ``SaveFailedError`` (or
    the shared error type), this save's files are removed and a previous
    checkpoint at the same location stays loadable.
    """
    coord = coordinator or default_coordinator(process_group)
    ckdir = CheckpointDir.resolve(checkpoint_id, filesystem)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")

    collected = collect_state(coord, state_dict)
    flat, save_id, values, plans = collected.flat, collected.save_id, collected.values, collected.plans
    written_files: list[str] = []

    def write() -> tuple[list[WrittenChunk], list[FileEntry]]:
        return write_plan(ckdir, plans[coord.rank], flat, save_id, coord.rank, block_size, written_files)

    try:
        results = gather_or_raise(coord, "save (writing shards)", write, SaveFailedError)

        def commit() -> int:
            if coord.rank != 0:
                return 0
            written = [w for chunks, _ in results for w in chunks]
            files = [f for _, fs in results for f in fs]
            manifest = create_manifest(
                collected.tensor_meta, written, files, values, save_id, coord.world_size, block_size, metadata or {}
            )
            commit_manifest(ckdir, manifest)
            return manifest.total_bytes

        total = gather_or_raise(coord, "save (commit)", commit, SaveFailedError)[0]
    except RayckptError:
        for rel in written_files:
            ckdir.delete(rel)
        if coord.rank == 0:
            ckdir.delete_dir_if_empty()
        raise
    num_files = sum(len(files) for _, files in results)
    return SaveInfo(ckdir.uri, save_id, total, num_files, coord.world_size)


@dataclass(slots=True)
class Collected:
    """The outcome of a save's first phase, the same on every rank except ``flat``."""

    flat: FlatState
    save_id: str
    values: dict[str, Any]
    tensor_meta: dict[str, tuple[str, tuple[int, ...]]]
    plans: list[SavePlan]
    #: Whatever each rank passed as ``extra`` to ``collect_state``, by rank.
    extras: list[Any]


def collect_state(coord: Coordinator, state_dict: dict[str, Any], extra: Any = None) -> Collected:
    """Save phase 1 (collective): flatten, share every rank's boxes, plan the writes."""
    flat_holder: list[FlatState] = []

    def collect() -> tuple[list[LocalShard], dict[str, Any], str | None, Any]:
        flat = flatten(state_dict)
        flat_holder.append(flat)
        shards = [LocalShard(t.key, t.dtype, t.shape, t.box) for t in flat.tensors.values()]
        values = {k: encode_value(v.value, k) for k, v in flat.values.items()}
        save_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}" if coord.rank == 0 else None
        return shards, values, save_id, extra

    gathered = gather_or_raise(coord, "save (collecting state)", collect, SaveFailedError)
    values = _merge_values([g[1] for g in gathered], {s.key for g in gathered for s in g[0]})
    plans = create_save_plans([g[0] for g in gathered], save_plan.MAX_CHUNK_BYTES)
    meta = {s.key: (s.dtype, s.shape) for g in gathered for s in g[0]}
    return Collected(flat_holder[0], gathered[0][2], values, meta, plans, [g[3] for g in gathered])


def _merge_values(per_rank: Sequence[dict[str, Any]], tensor_keys: set[str]) -> dict[str, Any]:
    """Replicated plain values: the lowest rank that has a key wins."""
    merged: dict[str, Any] = {}
    for values in per_rank:
        for k, v in values.items():
            if k in tensor_keys:
                raise InvalidStateError(f"key {k!r} is a tensor on one rank and a plain value on another")
            merged.setdefault(k, v)
    return merged


def write_plan(
    ckdir: CheckpointDir,
    plan: SavePlan,
    flat: FlatState,
    save_id: str,
    rank: int,
    block_size: int,
    written_files: list[str],
) -> tuple[list[WrittenChunk], list[FileEntry]]:
    """Write one rank's share of a save in this process."""
    return write_chunks(ckdir, create_chunk_data(plan, flat), save_id, rank, block_size, written_files)
