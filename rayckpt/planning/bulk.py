"""Load plans for every target rank at once, vectorized with numpy (FSDP2 targets).

``load_plan.create_load_plan`` plans one rank with per-item dataclasses, whose cost
grows with saved ranks x tensors, and planning every rank that way multiplies it by
the target ranks. When every one of M target ranks holds, for each key,
``dim0_boxes(shape, M)[rank]`` (FSDP2's ``torch.chunk`` on dim 0), the plans of
all ranks follow from a few numpy passes over a columnar copy of the manifest's
chunks (``ChunkTable``).
``BulkPlan.for_rank`` then gives exactly the ``LoadPlan`` that
``create_load_plan`` gives for that rank.

Pure: numpy, no torch.distributed, no Ray, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..format.boxes import Box
from ..format.manifest import Manifest, itemsize
from .chunk_table import DIM0, OTHER, SCALAR, SCALAR_BOX, ChunkTable, RankRows, dim0_item_bounds
from .load_plan import (
    ChunkIndex,
    FileRead,
    LoadPlan,
    ReadItem,
    TensorRequest,
    check_requests,
    create_load_plans,
    dim0_boxes,
    read_span,
)

__all__ = ["DIM0", "OTHER", "SCALAR", "BulkPlan", "ChunkTable", "TensorSpec", "create_dim0_plans"]

#: What every target rank holds of a key: ``(key, dtype, global shape)``.
TensorSpec = tuple[str, str, tuple[int, ...]]


@dataclass(frozen=True, eq=False, kw_only=True)
class BulkPlan:
    """The read plans of all ``world_size`` target ranks, held as numpy columns.

    ``for_rank`` builds one rank's ``LoadPlan``; the per-rank arrays
    (``needed_bytes``, ``read_bytes``, ``num_reads``, ``num_items``) summarize
    every rank without building any.
    """

    table: ChunkTable
    world_size: int
    #: Keys the targets asked for that the checkpoint lacks (only with strict=False).
    missing: tuple[str, ...]
    #: Per rank: payload bytes its targets need.
    needed_bytes: np.ndarray
    #: Per rank: bytes its reads cover (block-aligned, so >= needed_bytes).
    read_bytes: np.ndarray
    #: Per rank: number of ranged reads and of items (chunk pieces) in them.
    num_reads: np.ndarray
    num_items: np.ndarray
    # Items of rank r are _item_row[_item_first[r]:_item_first[r + 1]] (table rows), in plan order;
    # its reads are _read_*[_read_of_rank[r]:_read_of_rank[r + 1]]; read q serves the items from
    # _read_item[q] to the next read's first item.
    _item_row: np.ndarray
    _item_first: np.ndarray
    _read_item: np.ndarray
    _read_offset: np.ndarray
    _read_length: np.ndarray
    _read_of_rank: np.ndarray
    # Per key, for rebuilding items: each rank's rows of it, and its spec.
    _rows: RankRows
    _specs: dict[int, TensorSpec]
    #: Items of OTHER keys, planned per rank: (rank, table row) -> item.
    _other_items: dict[tuple[int, int], ReadItem]
    #: Set when the plans were built by the per-item planner instead (see ``create_dim0_plans``).
    _plans: tuple[LoadPlan, ...] | None = None

    @property
    def per_item(self) -> bool:
        """True when the plans were built by the per-item planner (see ``create_dim0_plans``)."""
        return self._plans is not None

    @property
    def num_items_total(self) -> int:
        return int(self.num_items.sum())

    @property
    def nbytes(self) -> int:
        """Memory held by the plan's arrays (the table's not included)."""
        arrays = (self.needed_bytes, self.read_bytes, self.num_reads, self.num_items, self._item_row)
        more = (self._item_first, self._read_item, self._read_offset, self._read_length, self._read_of_rank)
        return sum(a.nbytes for a in arrays + more)

    def for_rank(self, rank: int) -> LoadPlan:
        """Rank ``rank``'s plan: equal to ``create_load_plan`` for its ``dim0_boxes`` requests."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is outside the target world of {self.world_size} ranks")
        if self._plans is not None:
            return self._plans[rank]
        t = self.table
        p0, p1 = int(self._item_first[rank]), int(self._item_first[rank + 1])
        rows = self._item_row[p0:p1]
        k = t.key[rows]
        first, count, lo, hi = dim0_item_bounds(
            rank,
            t.start[rows],
            t.rows[rows],
            t.key_rows[k],
            t.key_row_bytes[k],
            RankRows(self._rows.per[k], self._rows.step[k]),
        )
        kinds = t.key_kind.tolist()
        entries = t.manifest.entries
        items: list[ReadItem] = []
        columns = (rows, k, t.index[rows], first, count, lo, hi)
        for row, kid, j, f, n, lo_, hi_ in zip(*(c.tolist() for c in columns)):
            kind = kinds[kid]
            if kind == OTHER:
                items.append(self._other_items[(rank, row)])
                continue
            key, _, shape = self._specs[kid]
            box = SCALAR_BOX if kind == SCALAR else Box((f,) + (0,) * (len(shape) - 1), (n,) + shape[1:])
            items.append(ReadItem(key=key, chunk=entries[key].chunks[j], box=box, lo=lo_, hi=hi_))  # type: ignore[union-attr]
        reads = []
        q0, q1 = int(self._read_of_rank[rank]), int(self._read_of_rank[rank + 1])
        bounds = self._read_item[q0 : q1 + 1].tolist()
        if len(bounds) == q1 - q0:
            bounds.append(p1)
        for q, (i0, i1) in enumerate(zip(bounds, bounds[1:])):
            mine = items[i0 - p0 : i1 - p0]
            offset, length = int(self._read_offset[q0 + q]), int(self._read_length[q0 + q])
            reads.append(FileRead(mine[0].chunk.file, offset, length, tuple(mine)))
        return LoadPlan(tuple(reads), int(self.needed_bytes[rank]), self.missing)

    @property
    def all_dim0(self) -> bool:
        """Every item is of a DIM0 or SCALAR key (no per-rank planned item): ``rank_rows`` tells all."""
        return self._plans is None and not self._other_items

    def rank_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(item_row, item_first, read_item, read_offset, read_length, read_of_rank)``: every rank's items
        as table rows (rank r's at ``item_first[r]:item_first[r + 1]``, in plan order; ``dim0_item_bounds``
        gives the rest) and every read's first item, offset and length (rank r's at
        ``read_of_rank[r]:read_of_rank[r + 1]``). No per-item object; only when ``all_dim0``."""
        if not self.all_dim0:
            raise ValueError("this plan has items planned per rank; use for_rank")
        reads = (self._read_item, self._read_offset, self._read_length, self._read_of_rank)
        return (self._item_row, self._item_first, *reads)


def create_dim0_plans(
    manifest: Manifest,
    specs: Iterable[TensorSpec],
    world_size: int,
    value_keys: Iterable[str] = (),
    strict: bool = True,
    table: ChunkTable | None = None,
) -> BulkPlan:
    """Plan the loads of all ``world_size`` ranks, rank r holding ``dim0_boxes(shape, world_size)[r]`` of each spec.

    ``BulkPlan.for_rank(r)`` equals ``create_load_plan`` for rank r's requests
    (same reads, items, order, needed bytes, missing keys); validation raises the
    same ``IncompatibleStateError``. Pass the manifest's cached ``table`` to skip
    building one. Keys whose chunks are not dim-0 slabs are planned per rank with
    ``load_plan.ChunkIndex``. Two cases fall back to ``create_load_plans`` for every
    rank (correct, not fast): a key asked for twice, and chunks whose byte ranges
    overlap inside a file (never written by rayckpt).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    specs = [(k, dtype, tuple(shape)) for k, dtype, shape in specs]
    value_keys = tuple(value_keys)
    full = [TensorRequest(k, dtype, shape, Box.full(shape)) for k, dtype, shape in specs]
    missing = tuple(check_requests(manifest, full, value_keys, strict))
    if table is None:
        table = ChunkTable.from_manifest(manifest)
    elif table.manifest is not manifest:
        raise ValueError("table was built from another manifest; build it with ChunkTable.from_manifest(manifest)")
    if len({k for k, _, _ in specs}) < len(specs):
        return _per_item(table, specs, world_size, value_keys, strict, missing)

    m = world_size
    t = table
    skip = set(missing)
    wanted = _wanted(t, specs, skip)
    kind = np.full(len(t.keys), -1, np.int8)
    ids = np.fromiter(wanted, np.int64, len(wanted))
    kind[ids] = t.key_kind[ids]
    per = np.where(kind == SCALAR, 0, -(-t.key_rows // m))
    rows_of = RankRows(per=per, step=np.where(kind == SCALAR, 1, per))

    counts, first_rank, end = _rank_ranges(t, kind, per, m)
    other = _plan_other(t, wanted, kind, m)
    if other:
        np.add.at(counts, np.fromiter((row for row, _, _ in other), np.int64, len(other)), 1)
    item_row, rank, span_start, span_end = _spans(t, counts, first_rank, end, rows_of, manifest.block_size)
    other_items = _place_other(other, counts, rank, span_start, span_end)

    # A stable sort on the rank keeps each rank's items in table-row, (file, byte_offset), order.
    order = np.argsort(rank.astype(np.uint16 if m <= 2**16 else np.int64), kind="stable")
    num_items = np.bincount(rank, minlength=m)
    del rank
    item_first = np.zeros(m + 1, np.int64)
    np.cumsum(num_items, out=item_first[1:])
    item_row = item_row[order]
    reads = _merge(t.file[item_row], span_start[order], span_end[order], item_first)
    if reads is None:
        return _per_item(table, specs, m, value_keys, strict, missing)
    read_item, read_offset, read_length = reads
    read_of_rank = np.searchsorted(read_item, item_first)
    covered = np.zeros(len(read_length) + 1, np.int64)
    np.cumsum(read_length, out=covered[1:])
    return BulkPlan(
        table=table,
        world_size=m,
        missing=missing,
        needed_bytes=_needed_bytes(specs, skip, m),
        read_bytes=covered[read_of_rank[1:]] - covered[read_of_rank[:-1]],
        num_reads=np.diff(read_of_rank),
        num_items=num_items,
        _item_row=item_row,
        _item_first=item_first,
        _read_item=read_item,
        _read_offset=read_offset,
        _read_length=read_length,
        _read_of_rank=read_of_rank,
        _rows=rows_of,
        _specs=wanted,
        _other_items=other_items,
    )


def _wanted(t: ChunkTable, specs: Sequence[TensorSpec], skip: set[str]) -> dict[int, TensorSpec]:
    """Table key id -> spec, for every asked-for key with elements that the checkpoint has."""
    key_ids = {k: i for i, k in enumerate(t.keys)}
    wanted: dict[int, TensorSpec] = {}
    for k, dtype, shape in specs:
        if k not in skip and math.prod(shape):
            itemsize(dtype)  # raises like create_load_plan does for an unknown dtype
            wanted[key_ids[k]] = (k, dtype, shape)
    return wanted


def _place_other(
    other: list[tuple[int, int, tuple[int, int, ReadItem]]],
    counts: np.ndarray,
    rank: np.ndarray,
    span_start: np.ndarray,
    span_end: np.ndarray,
) -> dict[tuple[int, int], ReadItem]:
    """Put the per-rank planned items into their slots of the item arrays (in place); return them by (rank, row)."""
    other_items: dict[tuple[int, int], ReadItem] = {}
    if other:
        # A row's items are its ranks in order: the vectorized ones, or these.
        other.sort(key=lambda o: (o[0], o[1]))
        rows = np.fromiter((row for row, _, _ in other), np.int64, len(other))
        at = np.cumsum(counts)[rows] - counts[rows] + np.arange(len(other)) - np.searchsorted(rows, rows)
        for i, (row, r, (start, end, item)) in zip(at.tolist(), other):
            rank[i] = r
            span_start[i] = start
            span_end[i] = end
            other_items[(r, row)] = item
    return other_items


def _rank_ranges(t: ChunkTable, kind: np.ndarray, per: np.ndarray, m: int) -> tuple[np.ndarray, ...]:
    """Per table row: how many target ranks' boxes overlap the chunk (consecutive ranks; DIM0 and
    SCALAR keys only), the first of them, and the chunk's end row (clamped to the key's rows)."""
    row_kind = kind[t.key]
    dim0 = row_kind == DIM0
    end = np.minimum(t.start + t.rows, t.key_rows[t.key])
    every = bool(dim0.all())  # the usual case: no row to leave out, no copy to make
    rows = slice(None) if every else np.flatnonzero(dim0)
    start, stop = t.start[rows], end[rows]
    div = np.maximum(per, 1)[t.key[rows]]
    first = start // div
    count = stop - 1
    count //= div
    count -= first - 1
    count[stop <= start] = 0
    if every:
        return count, first, end
    counts = np.zeros(t.num_chunks, np.int64)
    first_rank = np.zeros(t.num_chunks, np.int64)
    counts[rows] = count
    first_rank[rows] = first
    counts[row_kind == SCALAR] = m
    return counts, first_rank, end


def _spans(
    t: ChunkTable, counts: np.ndarray, first: np.ndarray, end: np.ndarray, rows_of: RankRows, bs: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (chunk, rank) item in table-row order: its row, rank, and block-aligned byte span in the file."""
    per, step = rows_of.per, rows_of.step
    ends = np.cumsum(counts)
    total = int(ends[-1]) if len(ends) else 0
    item_row = np.repeat(np.arange(t.num_chunks, dtype=np.int32), counts)
    rank = np.arange(total) - np.repeat(ends - counts - first, counts)

    def each(column: np.ndarray) -> np.ndarray:
        return np.repeat(column, counts)

    # The rows the rank needs of the chunk, as bytes [lo, hi) from the chunk's first byte: the
    # rank's rows [a, a + step) within the chunk's [start, end).
    key = t.key
    per_item = each(per[key])
    a = rank * per_item
    hi = a + (per_item if np.array_equal(per, step) else each(step[key]))
    del per_item
    np.minimum(hi, each(end), out=hi)
    start = each(t.start)
    lo = np.maximum(start, a, out=a)
    row_bytes = each(t.key_row_bytes[key])
    lo -= start
    lo *= row_bytes
    hi -= start
    hi *= row_bytes
    del start, row_bytes
    # Widened to whole checksum blocks, never past the chunk's end: what create_load_plan reads.
    base = each(t.byte_offset)
    lo //= bs
    lo *= bs
    lo += base
    hi = -hi
    hi //= bs
    hi *= -bs
    np.minimum(hi, each(t.byte_length), out=hi)
    hi += base
    return item_row, rank, lo, hi


def _merge(
    file: np.ndarray, start: np.ndarray, end: np.ndarray, item_first: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Coalesce each rank's spans into reads: first item, offset and length of every read.

    The spans of a rank must rise: by file id, or by start within a file, with ends not
    falling. Then this order is the one ``load_plan``'s stable sort on (file, start, end)
    gives, and its merge (``start <= current end``) only looks at the previous span.
    Returns ``None`` when they do not (chunks overlapping inside a file).
    """
    total = len(file)
    new_rank = np.zeros(total, bool)
    new_rank[item_first[:-1][item_first[:-1] < item_first[1:]]] = True
    same_file = ~new_rank[1:] & (file[1:] == file[:-1])
    rising = new_rank[1:] | (file[1:] > file[:-1]) | (same_file & (start[1:] > start[:-1]))
    if not (rising.all() and np.all(~same_file | (end[1:] >= end[:-1]))):
        return None
    del rising, new_rank
    new_read = np.ones(total, bool)
    new_read[1:] = ~same_file | (start[1:] > end[:-1])
    read_item = np.flatnonzero(new_read)
    read_last = np.empty_like(read_item)
    read_last[:-1] = read_item[1:] - 1
    read_last[-1:] = total - 1
    return read_item, start[read_item], end[read_last] - start[read_item]


def _needed_bytes(specs: Sequence[TensorSpec], skip: set[str], world_size: int) -> np.ndarray:
    """Per rank: payload bytes of its boxes, summed over the specs."""
    # Ranks [0, q) hold `per` rows of a key, rank q the rest: a difference array over ranks.
    diff = [0] * (world_size + 1)
    for key, dtype, shape in specs:
        if key in skip or not math.prod(shape):
            continue
        if not shape:
            diff[0] += itemsize(dtype)
            diff[world_size] -= itemsize(dtype)
            continue
        rows = shape[0]
        row_bytes = math.prod(shape[1:]) * itemsize(dtype)
        per = -(-rows // world_size)
        q, rest = divmod(rows, per)
        diff[0] += per * row_bytes
        diff[q] -= per * row_bytes
        if rest:
            diff[q] += rest * row_bytes
            diff[q + 1] -= rest * row_bytes
    return np.cumsum(np.array(diff[:world_size], np.int64))


def _plan_other(
    t: ChunkTable, wanted: dict[int, TensorSpec], kind: np.ndarray, world_size: int
) -> list[tuple[int, int, tuple[int, int, ReadItem]]]:
    """(table row, rank, (span start, span end, item)) for the OTHER keys, planned per rank like ``load_plan``."""
    keys = [k for k in wanted if kind[k] == OTHER]
    if not keys:
        return []
    row_of = np.empty(t.num_chunks, np.int64)
    row_of[t.key_first[t.key] + t.index] = np.arange(t.num_chunks)
    index = ChunkIndex(t.manifest)
    bs = t.manifest.block_size
    out = []
    for k in keys:
        key, dtype, shape = wanted[k]
        isz = itemsize(dtype)
        entry = t.manifest.tensor(key)
        position = {id(c): j for j, c in enumerate(entry.chunks)}
        first = int(t.key_first[k])
        for rank, box in enumerate(dim0_boxes(shape, world_size)):
            if not box.volume:
                continue
            for chunk, common in index.overlapping(key, box):
                row = int(row_of[first + position[id(chunk)]])
                out.append((row, rank, read_span(key, chunk, common, isz, bs)))
    return out


def _per_item(
    table: ChunkTable,
    specs: Sequence[TensorSpec],
    world_size: int,
    value_keys: tuple[str, ...],
    strict: bool,
    missing: tuple[str, ...],
) -> BulkPlan:
    """Every rank planned by ``load_plan.create_load_plans``: the exact, slow path."""
    boxes = {k: dim0_boxes(shape, world_size) for k, _, shape in specs}
    requests = [[TensorRequest(k, dtype, shape, boxes[k][r]) for k, dtype, shape in specs] for r in range(world_size)]
    plans = tuple(create_load_plans(table.manifest, requests, value_keys, strict))
    none = np.zeros(0, np.int64)
    return BulkPlan(
        table=table,
        world_size=world_size,
        missing=missing,
        needed_bytes=np.array([p.needed_bytes for p in plans], np.int64),
        read_bytes=np.array([p.read_bytes for p in plans], np.int64),
        num_reads=np.array([len(p.reads) for p in plans], np.int64),
        num_items=np.array([sum(len(r.items) for r in p.reads) for p in plans], np.int64),
        _item_row=none,
        _item_first=none,
        _read_item=none,
        _read_offset=none,
        _read_length=none,
        _read_of_rank=none,
        _rows=RankRows(per=none, step=none),
        _specs={},
        _other_items={},
        _plans=plans,
    )
