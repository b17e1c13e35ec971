"""Save planning on columns: which rank writes each distinct box, without a Python object per box.

Each rank sends its shards as a ``ShardLayout`` (its tensor table once, its
boxes as one numpy array); ``assign_writers`` (one rank, for all) finds each
box's holders (a hash of every row shows when each box has one holder, as with
FSDP's dim-0 shards: then no sort and no balancing) and picks the writers as the
per-box planner before it did (``tests/helpers/save_plan_reference.py``):
largest boxes first, each to its least-loaded holder, ties to the lower rank.
The one tie that planner broke by input order (two boxes of a key at the same
offsets, of different sizes and equal bytes: no sharding makes them) is broken
by sizes here. Pure: numpy, no I/O.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from ..errors import InvalidStateError
from ..format.manifest import itemsize
from .save_plan import MAX_CHUNK_BYTES, LocalShard, SavePlan, create_own_plan


def create_save_plans(
    shards_by_rank: Sequence[Sequence[LocalShard]], max_chunk_bytes: int = MAX_CHUNK_BYTES
) -> list[SavePlan]:
    """One plan per rank: each distinct (key, box) is written by exactly one holder.

    Raises ``InvalidStateError`` when ranks disagree on a key's dtype or shape.
    The work is ``assign_writers`` on the ranks' ``ShardLayout``s (columns), then
    ``create_own_plan`` for each rank: what a save does across processes, here in one.
    """
    layouts = [ShardLayout.from_shards(shards) for shards in shards_by_rank]
    written = assign_writers(layouts).written
    return [create_own_plan(r, shards, written[r], max_chunk_bytes) for r, shards in enumerate(shards_by_rank)]


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """One rank's shards as columns: what it sends to the planner (no Python object per shard).

    ``table`` lists the (key, dtype, shape) the rank holds, in first-seen order,
    as compressed JSON; ranks with the same table (most: every FSDP rank holds
    every key) are decoded once, found by ``table_hash``. The columns take the
    smallest integer type that holds them.
    """

    table: bytes
    #: Digest of the table's JSON.
    table_hash: bytes
    #: Per shard: its entry in ``table``.
    entry: np.ndarray
    #: Per shard: its box's offsets then sizes, ``ndim`` columns each (``ndim``: the table's largest).
    boxes: np.ndarray

    @staticmethod
    def from_shards(shards: Sequence[LocalShard]) -> ShardLayout:
        entries: dict[tuple[str, str, tuple[int, ...]], int] = {}
        index = [entries.setdefault((s.key, s.dtype, tuple(s.shape)), len(entries)) for s in shards]
        ndim = max((len(e[2]) for e in entries), default=0)
        ndim = max([ndim, *(s.box.ndim for s in shards)])
        pad = [((0,) * (ndim - b.ndim), (1,) * (ndim - b.ndim)) for b in (s.box for s in shards)]
        # Padded dims: offset 0, size 1 (the volume is unchanged).
        rows = [(*s.box.offsets, *o, *s.box.sizes, *z) for s, (o, z) in zip(shards, pad)]
        boxes = np.asarray(rows, dtype=np.int64).reshape(len(shards), 2 * ndim)
        if not boxes.size or boxes.max() < 2**31:
            boxes = boxes.astype(np.int32)
        entry = np.asarray(index, dtype=np.uint16 if len(entries) <= 2**16 else np.int32)
        table = json.dumps([[k, d, list(shape)] for k, d, shape in entries], separators=(",", ":")).encode()
        return ShardLayout(zlib.compress(table, 1), digest(table), entry, boxes)

    @property
    def ndim(self) -> int:
        return self.boxes.shape[1] // 2

    def digest(self) -> bytes:
        """What identifies this layout (equal for equal shards, in order)."""
        shape = f"{self.entry.dtype} {self.boxes.dtype} {self.boxes.shape}".encode()
        return digest(self.table_hash, self.entry.tobytes(), self.boxes.tobytes(), shape)


def digest(*parts: bytes) -> bytes:
    """A 16-byte digest of ``parts``: their count and lengths, then their bytes, so no two sequences
    run together. XXH3-128 (layouts are compared within one job, by the same code: no adversary),
    three C-speed updates whatever the count: rank 0 digests every rank's layout hash on each
    save, so the cost must not grow with a Python-level update per part."""
    h = xxhash.xxh3_128()
    h.update(len(parts).to_bytes(8, "little"))
    h.update(np.fromiter(map(len, parts), np.int64, len(parts)).astype("<i8").tobytes())
    h.update(b"".join(parts))
    return h.digest()


@dataclass(frozen=True, slots=True)
class Assignment:
    """``assign_writers``'s answer: the tensors, and which of its shards each rank writes."""

    #: Every key's (dtype, global shape), in the order ranks first report them.
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    #: Per rank: the indices of its shards it writes (ascending, into its ``ShardLayout``).
    written: list[np.ndarray]


def assign_writers(layouts: Sequence[ShardLayout]) -> Assignment:
    """Pick one writer for each distinct (key, box): the least-loaded holder, largest boxes first.

    On columns, one row per shard: (key id, offsets, sizes), then rank and shard
    index. When no two rows hold the same box (FSDP's dim-0 shards; seen from
    one sort of a 64-bit hash of each row) every holder writes what it holds.
    Otherwise the rows are sorted to find each box's holders and the greedy
    balance loops over the replicated boxes only (``_balance``).
    """
    tensors, entry_key, key_bytes = _tensors(layouts)
    world = len(layouts)
    ndim = max((lay.ndim for lay in layouts), default=0)
    per_rank = [_box_columns(lay, entry_key[lay.table_hash], ndim) for lay in layouts]
    nonempty = [np.prod(box[1 + ndim :], axis=0) > 0 for box in per_rank]  # empty boxes are not written
    hashes = np.concatenate([_hash(box[:, keep]) for box, keep in zip(per_rank, nonempty)] or [np.empty(0, np.uint64)])
    hashes.sort()
    if not (hashes[1:] == hashes[:-1]).any():
        # Every box has one holder, which writes it. (Equal boxes hash equal: distinct hashes prove it.)
        return Assignment(tensors, [np.flatnonzero(keep) for keep in nonempty])
    # Rows: key id, offsets, sizes, rank, shard index; a column per nonempty shard.
    parts = [np.vstack((box, np.full(box.shape[1], r), np.arange(box.shape[1]))) for r, box in enumerate(per_rank)]
    cols = np.concatenate([part[:, keep] for part, keep in zip(parts, nonempty)], axis=1)
    del per_rank, parts
    # Sort by (key, offsets, sizes, rank, shard): a box's holders are adjacent, ranks ascending.
    cols = cols[:, np.lexsort(cols[::-1])]
    box = cols[: 1 + 2 * ndim]
    new_box = np.ones(cols.shape[1], dtype=bool)
    new_box[1:] = (box[:, 1:] != box[:, :-1]).any(axis=0)
    new_holder = new_box.copy()
    new_holder[1:] |= cols[-2, 1:] != cols[-2, :-1]
    cols, new_box = cols[:, new_holder], new_box[new_holder]  # a rank holding a box twice holds it once
    writers = cols[:, _balance(cols, np.flatnonzero(new_box), ndim, key_bytes, world)]
    writers = writers[:, np.lexsort((writers[-1], writers[-2]))]
    bounds = np.searchsorted(writers[-2], np.arange(world + 1))
    return Assignment(tensors, [writers[-1, bounds[r] : bounds[r + 1]] for r in range(world)])


def _box_columns(lay: ShardLayout, entry_key: np.ndarray, ndim: int) -> np.ndarray:
    """A rank's shards as columns of (key id, offsets, sizes), ``ndim`` dims (missing ones: offset 0, size 1)."""
    n, d = len(lay.entry), lay.ndim
    box = np.empty((1 + 2 * ndim, n), dtype=np.int64)
    box[0] = entry_key[lay.entry]
    box[1 : 1 + ndim] = 0
    box[1 + ndim :] = 1
    box[1 : 1 + d] = lay.boxes[:, :d].T
    box[1 + ndim : 1 + ndim + d] = lay.boxes[:, d:].T
    return box


def _hash(box: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each column."""
    h = np.full(box.shape[1], 0x9E3779B97F4A7C15, dtype=np.uint64)
    for row in box:
        h ^= row.astype(np.uint64)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(31)
    return h


def _tensors(
    layouts: Sequence[ShardLayout],
) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[bytes, np.ndarray], np.ndarray]:
    """Every key's dtype and shape (checked to agree); per table, its entries' key ids (keys in
    sorted order); per key id, its item size in bytes."""
    meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
    tables: dict[bytes, list[tuple[str, str, tuple[int, ...]]]] = {}
    for rank, lay in enumerate(layouts):
        if lay.table_hash in tables:
            continue  # the same table as a lower rank's: checked there
        entries = [(k, d, tuple(shape)) for k, d, shape in json.loads(zlib.decompress(lay.table))]
        tables[lay.table_hash] = entries
        for key, dtype, shape in entries:
            seen = meta.setdefault(key, (dtype, shape, rank))
            if seen[:2] != (dtype, shape):
                raise InvalidStateError(
                    f"key {key!r}: rank {seen[2]} has dtype {seen[0]} shape {list(seen[1])} but "
                    f"rank {rank} has dtype {dtype} shape {list(shape)}; every rank must agree"
                )
    ids = {k: i for i, k in enumerate(sorted(meta))}  # key ids in key order: sorting ids sorts keys
    entry_key = {h: np.asarray([ids[e[0]] for e in entries], dtype=np.int64) for h, entries in tables.items()}
    key_bytes = np.asarray([itemsize(meta[k][0]) for k in sorted(meta)], dtype=np.int64)
    return {k: (d, s) for k, (d, s, _) in meta.items()}, entry_key, key_bytes


def _balance(cols: np.ndarray, starts: np.ndarray, ndim: int, key_bytes: np.ndarray, world: int) -> np.ndarray:
    """The greedy balance: for each box (columns ``starts[g]`` on, one per holder), its writer's column.

    Boxes go largest first (then by key, offsets), each to its least-loaded
    holder (then the lowest rank). Only replicated boxes need the Python loop: a
    holder's load from the single-holder boxes before a box in that order comes
    from one cumulative sum.
    """
    nboxes = len(starts)
    first = cols[:, starts]
    nbytes = np.prod(first[1 + ndim : 1 + 2 * ndim], axis=0) * key_bytes[first[0]]
    # Greedy order: bytes descending, then key, then offsets (the first key of lexsort is the last).
    order = np.lexsort((*first[ndim:0:-1], first[0], -nbytes))
    pos = np.empty(nboxes, dtype=np.int64)
    pos[order] = np.arange(nboxes)
    counts = np.diff(np.append(starts, cols.shape[1]))
    box_of_row = np.repeat(np.arange(nboxes), counts)
    rank = cols[-2]
    single = counts == 1
    s_key = rank[starts[single]] * nboxes + pos[single]
    s_order = np.argsort(s_key)
    s_key, s_cum = s_key[s_order], np.concatenate(([0], np.cumsum(nbytes[single][s_order])))
    multi_rows = np.flatnonzero(~single[box_of_row])
    query = rank[multi_rows] * nboxes + pos[box_of_row[multi_rows]]
    before = s_cum[np.searchsorted(s_key, query)] - s_cum[np.searchsorted(s_key, rank[multi_rows] * nboxes)]
    pre = np.zeros(cols.shape[1], dtype=np.int64)
    pre[multi_rows] = before
    writer = starts.copy()  # single-holder boxes: their one column
    load = [0] * world
    pre_list, row_rank = pre.tolist(), rank.tolist()
    start_list, count_list, bytes_list = starts.tolist(), counts.tolist(), nbytes.tolist()
    for g in order[~single[order]].tolist():
        s = start_list[g]
        best = min(range(s, s + count_list[g]), key=lambda r: (pre_list[r] + load[row_rank[r]], row_rank[r]))
        load[row_rank[best]] += bytes_list[g]
        writer[g] = best
    return writer
