"""``save`` and ``load``: plan, write, commit, read.

Roles: every rank calls ``save`` / ``load`` (collective when a process group is
initialized). Rank 0 commits. Each phase ends in one all-gather that carries
failures, so an error on any rank is raised on every rank and nobody hangs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..format.manifest import (
    FileEntry,
)
from ..format.shard_file import (
    ChunkData,
    WrittenChunk,
    storage_type,
    write_shard_file,
)
from ..planning.save_plan import SavePlan
from ..storage.checkpoint_dir import CheckpointDir
from .state import FlatState, as_bytes


def chunk_pieces(
    plan: SavePlan, flat: FlatState, local: dict[str, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The piece of its local tensor each item of ``plan`` saves: views, on any device.

    ``local``: the tensors to cut the pieces from (default: each leaf's own).
    """
    out = []
    for item in plan.items:
        leaf = flat.tensors[item.key]
        tensor = local[item.key] if local is not None else leaf.local.detach()
        out.append(tensor[item.box.relative_to(leaf.box).to_slices()])
    return out


def create_chunk_data(plan: SavePlan, flat: FlatState) -> list[ChunkData]:
    """The bytes of each item of ``plan``: zero-copy views of (CPU-staged) local tensors."""
    staged = stage_to_cpu(flat.tensors[item.key] for item in plan.items)
    pieces = chunk_pieces(plan, flat, staged)
    return [
        ChunkData(item.key, flat.tensors[item.key].dtype, item.box, as_bytes(piece.contiguous()))
        for item, piece in zip(plan.items, pieces)
    ]


def write_chunks(
    ckdir: CheckpointDir,
    chunks: Sequence[ChunkData],
    save_id: str,
    rank: int,
    block_size: int,
    written_files: list[str],
) -> tuple[list[WrittenChunk], list[FileEntry]]:
    """Write one rank's chunks: one Arrow file per storage type.

    Appends each file to ``written_files`` before writing it, so a failure can
    clean up. Called by a rank (in-process saves) or by a ShardWriter actor.
    """
    by_type: dict[str, list[ChunkData]] = {}
    for c in chunks:
        by_type.setdefault(storage_type(c.dtype), []).append(c)
    written: list[WrittenChunk] = []
    files: list[FileEntry] = []
    if by_type:
        ckdir.makedirs()
    for stype, data in sorted(by_type.items()):
        rel = f"{save_id}-r{rank:05d}-{stype}.arrow"
        written_files.append(rel)
        records, size = write_shard_file(ckdir, rel, data, block_size, save_id)
        written.extend(records)
        files.append(FileEntry(rel, size, rank))
    return written, files


def stage_to_cpu(leaves: Any) -> dict[str, torch.Tensor]:
    """Local tensors on the CPU: device tensors are copied (non-blocking, then one sync)."""
    staged: dict[str, torch.Tensor] = {}
    on_device = False
    for leaf in leaves:
        if leaf.key in staged:
            continue
        t = leaf.local.detach()
        if t.device.type != "cpu":
            on_device = True
            t = t.to("cpu", non_blocking=True)
        staged[leaf.key] = t
    if on_device and torch.cuda.is_available():
        torch.cuda.synchronize()
    return staged
