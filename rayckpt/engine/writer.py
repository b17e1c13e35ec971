"""Tensors -> chunks -> shard files: the write step every save path shares.

A rank's ``SavePlan`` names the boxes it writes; ``chunk_specs`` says what each
chunk is, ``chunk_pieces`` cuts the pieces out of the rank's local tensors (on
any device), ``create_chunk_data`` gives their bytes on the CPU, and
``write_chunks`` writes them, one Arrow IPC file per storage type (or several,
written at once, when a rank holds much of one). Called by a
rank (``rayckpt.save``), by the node's ShardWriter actor (async saves on Ray,
with the bytes read from shared memory) and by imports (``rayckpt convert``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from ..errors import SaveFailedError
from ..format.manifest import FileEntry, itemsize
from ..format.shard_file import ChunkData, ChunkSpec, WrittenChunk, storage_type, write_shard_file
from ..planning.save_plan import SavePlan
from ..storage.checkpoint_dir import join_location
from ..storage.commit import WrittenFiles, WrittenShard, shard_file_name
from ..storage.shared import shared_path, store_of
from .device import DeviceToHost, host_like, needs_bounce
from .increments import FULL, BaseChunk, Increment, Records, base_records, remember, split_unchanged, store_key
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


#: A rank's bytes of one storage type are split into files of about this many bytes when it has at
#: least twice that: the files are written at once, each on its own thread (with its own checksum
#: thread). One file is written at the speed of one thread, however many cores the node has, so a
#: large share written as one file leaves the node's other cores idle.
PART_BYTES = 256 << 20
#: The most files one rank writes for one storage type.
MAX_PARTS = 8


def parts_here(world_size: int, num_nodes: int) -> int:
    """How many files of one type a rank may write at once: the cores this process may run on, shared
    by the ranks of its node (``LOCAL_WORLD_SIZE``, set by torchrun and Ray Train; else the world size
    over the nodes), at most ``MAX_PARTS``. 1 where the ranks already fill the cores."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 0) or -(-world_size // max(1, num_nodes))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_PARTS, cores // max(1, local)))


def split_parts(chunks: Sequence[ChunkData], max_parts: int) -> list[list[ChunkData]]:
    """``chunks`` (all of one storage type) in consecutive groups, one per file: one group unless they
    hold at least twice ``PART_BYTES``, then one per ``PART_BYTES`` (at most ``max_parts``), cut where the
    running total passes each equal share. A chunk is never split: a single chunk is one file."""
    sizes = [itemsize(c.dtype) * c.box.volume for c in chunks]
    total = sum(sizes)
    n = max(1, min(max_parts, total // PART_BYTES, len(chunks)))
    groups: list[list[ChunkData]] = [[]]
    done = 0
    for c, size in zip(chunks, sizes):
        if groups[-1] and done >= total * len(groups) / n and len(groups) < n:
            groups.append([])
        groups[-1].append(c)
        done += size
    return groups


@dataclass(frozen=True, slots=True, kw_only=True)
class ShareSpec:
    """How one rank's share of a save is written (the rank itself, its node's ShardWriter, an import)."""

    rank: int
    #: Bytes per block checksum.
    block_size: int
    #: > 1: a storage type's bytes may be split over that many files (``split_parts``), written at once.
    max_parts: int = 1
    #: Whether the save is incremental and which save it shares with (``increments``).
    increment: Increment = FULL


def write_chunks(
    files: WrittenFiles, chunks: Sequence[ChunkData], share: ShareSpec, base: Records | None = None
) -> WrittenShard:
    """Write one rank's chunks into ``files.ckdir`` for save ``files.save_id``: one Arrow file per
    storage type, each durable on return.

    ``share.max_parts`` > 1: a storage type's bytes may be split over that many files
    (``split_parts``), written at once on their own threads. 1: one file per type, written in
    sorted type order (a streamed import reads its chunks in that order). Adds each file to
    ``files`` before writing anything, so a failure can clean up.

    An incremental ``share.increment``: the files go into the shared store beside the checkpoint
    directory (``storage.shared``) and each record carries its chunk's fingerprint; a chunk
    byte-identical to its record in ``base`` (the base save's records, ``increments``) is not
    written: its record is the base's.
    """
    ckdir, save_id, rank, block_size = files.ckdir, files.save_id, share.rank, share.block_size
    incremental, max_parts = share.increment.incremental, share.max_parts
    shared: list[BaseChunk] = []
    hashed: Callable[[ChunkData], bool] | bool = incremental
    if base:
        chunks, shared, keys = split_unchanged(chunks, base, block_size)
        hashed = lambda c: (c.key, c.box.offsets, c.box.sizes) in keys  # noqa: E731
    by_type: dict[str, list[ChunkData]] = {}
    for c in chunks:
        by_type.setdefault(storage_type(c.dtype), []).append(c)
    name = shared_path if incremental else str
    jobs = [
        (name(shard_file_name(save_id, rank, stype, part)), data)
        for stype, typed in sorted(by_type.items())
        for part, data in enumerate(split_parts(typed, max_parts) if max_parts > 1 else [typed])
    ]
    if jobs:
        (store_of(ckdir) if incremental else ckdir).makedirs()
    files.add(rel for rel, _ in jobs)

    def write(rel: str, data: list[ChunkData]) -> tuple[list[WrittenChunk], FileEntry]:
        try:
            records, size = write_shard_file(ckdir, rel, data, block_size, save_id, hashed)
        except OSError as exc:
            # pyarrow's message carries its own traceback; the errno says what happened.
            reason = os.strerror(exc.errno) if exc.errno else str(exc).strip().splitlines()[-1]
            where = join_location(ckdir.location, rel)
            raise SaveFailedError(f"rank {rank}: writing shard file {where} failed: {reason}") from exc
        return records, FileEntry(rel, size, rank)

    if max_parts > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="rayckpt-part") as pool:
            futures = [pool.submit(write, rel, data) for rel, data in jobs]
        results = [f.result() for f in futures]  # every file ended: the first error is raised
    else:
        results = [write(rel, data) for rel, data in jobs]
    if incremental and jobs:
        store_of(ckdir).sync_dir()  # the files' directory entries, before the commit names them
    written = [record for records, _ in results for record in records] + [b.chunk for b in shared]
    entries = [entry for _, entry in results] + list({b.file.path: b.file for b in shared}.values())
    return WrittenShard(rank, tuple(written), tuple(entries), save_id)


def write_rank_share(files: WrittenFiles, chunks: Sequence[ChunkData], share: ShareSpec) -> WrittenShard:
    """``write_chunks`` for one rank's share of a save (the rank itself, or its node's ShardWriter).

    An incremental save is written against the base's records this process holds for
    the rank (none: every chunk is written), and the records of what it wrote or shared
    are kept for the rank's next save (``increments``).
    """
    if not share.increment.incremental:
        return write_chunks(files, chunks, share)
    key = store_key(files.ckdir)
    base = base_records(key, share.rank, share.increment.base)
    shard = write_chunks(files, chunks, share, base)
    dtypes = {c.key: c.dtype for c in chunks}
    remember(key, shard, share.block_size, dtypes, base)
    return shard


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
