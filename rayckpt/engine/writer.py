"""Tensors -> chunks -> shard files: the write step every save path shares.

A rank's ``SavePlan`` names the boxes it writes; ``chunk_specs`` says what each
chunk is, ``chunk_pieces`` cuts the pieces out of the rank's local tensors (on
any device), ``create_chunk_data`` gives their bytes on the CPU, and
``write_chunks`` writes them, one Arrow IPC file per storage type. Called by a
rank (``rayckpt.save``), by the node's ShardWriter actor (async saves on Ray,
with the bytes read from shared memory) and by imports (``rayckpt convert``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

import torch

from ..errors import SaveFailedError
from ..format.manifest import FileEntry
from ..format.shard_file import ChunkData, ChunkSpec, WrittenChunk, storage_type, write_shard_file
from ..planning.save_plan import SavePlan
from ..storage.checkpoint_dir import CheckpointDir, join_location
from ..storage.commit import WrittenShard, shard_file_name
from .device import DeviceToHost, host_like, needs_bounce
from .state import FlatState, Piece, TensorLeaf, as_bytes


def chunk_specs(plan: SavePlan, flat: FlatState) -> tuple[ChunkSpec, ...]:
    """What each item of ``plan`` stores: key, dtype and global box (no bytes)."""
    return tuple(ChunkSpec(item.key, flat.tensors[item.key].dtype, item.box) for item in plan.items)


def chunk_pieces(plan: SavePlan, flat: FlatState, leaves: Mapping[str, TensorLeaf] | None = None) -> list[torch.Tensor]:
    """The part of its local data each item of ``plan`` saves: views, on any device.

    ``leaves``: the leaves to cut the parts from (default: ``flat``'s own).
    """
    leaves = flat.tensors if leaves is None else leaves
    return [leaves[item.key].region(item.box).detach() for item in plan.items]


def create_chunk_data(plan: SavePlan, flat: FlatState) -> list[ChunkData]:
    """The bytes of each item of ``plan``: zero-copy views of the local tensors (copied to the CPU if on a device)."""
    on_cpu = cpu_leaves(flat.tensors[item.key] for item in plan.items)
    pieces = chunk_pieces(plan, flat, on_cpu)
    return [spec.with_data(as_bytes(piece.contiguous())) for spec, piece in zip(chunk_specs(plan, flat), pieces)]


def write_chunks(
    ckdir: CheckpointDir,
    chunks: Sequence[ChunkData],
    save_id: str,
    rank: int,
    block_size: int,
    written_files: list[str],
) -> WrittenShard:
    """Write one rank's chunks: one Arrow file per storage type, each durable on return.

    Appends each file to ``written_files`` before writing it, so a failure can
    clean up.
    """
    by_type: dict[str, list[ChunkData]] = {}
    for c in chunks:
        by_type.setdefault(storage_type(c.dtype), []).append(c)
    written: list[WrittenChunk] = []
    files: list[FileEntry] = []
    if by_type:
        ckdir.makedirs()
    for stype, data in sorted(by_type.items()):
        rel = shard_file_name(save_id, rank, stype)
        written_files.append(rel)
        try:
            records, size = write_shard_file(ckdir, rel, data, block_size, save_id)
        except OSError as exc:
            # pyarrow's message carries its own traceback; the errno says what happened.
            reason = os.strerror(exc.errno) if exc.errno else str(exc).strip().splitlines()[-1]
            where = join_location(ckdir.location, rel)
            raise SaveFailedError(f"rank {rank}: writing shard file {where} failed: {reason}") from exc
        written.extend(records)
        files.append(FileEntry(rel, size, rank))
    return WrittenShard(rank, tuple(written), tuple(files))


def cpu_leaves(leaves: Iterable[TensorLeaf]) -> dict[str, TensorLeaf]:
    """The leaves with every piece on the CPU: device pieces are copied into pinned host memory.

    The copies run on a side stream (``DeviceToHost``), all waited on once at the
    end. Not "staging": in rayckpt to stage is the async save's one copy into
    shared memory.
    """
    on_cpu: dict[str, TensorLeaf] = {}
    to_host = DeviceToHost()
    for leaf in leaves:
        if leaf.key in on_cpu:
            continue
        pieces = []
        for p in leaf.pieces:
            t = p.local.detach()
            if needs_bounce(t):
                host = host_like(t)
                to_host.copy(host, t)
                t = host
            pieces.append(Piece(p.box, t))
        on_cpu[leaf.key] = replace(leaf, pieces=tuple(pieces))
    to_host.wait()
    return on_cpu
