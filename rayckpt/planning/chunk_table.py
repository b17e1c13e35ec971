"""The tensor chunks of one manifest as numpy columns (``ChunkTable``), for bulk planning.

Built once per manifest and reused for every plan of it (the MetadataActor caches
it next to the manifest). Pure: numpy, no torch.distributed, no Ray, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..format.boxes import Box
from ..format.chunk_columns import ChunkColumns
from ..format.manifest import Manifest

#: Key kinds. DIM0: the non-empty chunks are disjoint dim-0 slabs (whole trailing
#: dims), planned vectorized. SCALAR: a 0-dim tensor, every rank reads every chunk.
#: OTHER: anything else (Shard(1) columns, 2-D grids, malformed chunks), planned
#: per rank with ``load_plan.ChunkIndex``.
DIM0, SCALAR, OTHER = 0, 1, 2

SCALAR_BOX = Box((), ())


@dataclass(frozen=True, eq=False, kw_only=True)
class ChunkTable:
    """The tensor chunks of one manifest as numpy columns, rows sorted by (file, byte_offset).

    Built once per manifest (``from_manifest``, from its ``ChunkColumns``) and
    reused for every plan of that manifest; the MetadataActor would cache it next
    to the manifest.
    """

    manifest: Manifest
    #: Tensor keys in manifest order; the ``key`` column indexes this.
    keys: tuple[str, ...]
    #: Shard file names, sorted, so file ids compare like the names do.
    files: tuple[str, ...]
    #: Per key: DIM0, SCALAR or OTHER.
    key_kind: np.ndarray
    #: Per key: ``shape[0]``; 1 for a 0-dim tensor (one row of one element).
    key_rows: np.ndarray
    #: Per key: bytes of one dim-0 row, ``prod(shape[1:]) * itemsize`` (0 for an unknown dtype).
    key_row_bytes: np.ndarray
    #: Per key: position of its first chunk in the manifest-order concatenation of all chunks.
    key_first: np.ndarray
    #: Per chunk: key id and position in ``TensorEntry.chunks``.
    key: np.ndarray
    index: np.ndarray
    #: Per chunk: file id (into ``files``).
    file: np.ndarray
    #: Per chunk: first dim-0 row and dim-0 size (0 and 1 for a 0-dim chunk).
    start: np.ndarray
    rows: np.ndarray
    byte_offset: np.ndarray
    byte_length: np.ndarray

    @property
    def num_chunks(self) -> int:
        return len(self.key)

    @property
    def nbytes(self) -> int:
        """Memory held by the columns."""
        return sum(getattr(self, f).nbytes for f in _COLUMNS)

    @classmethod
    def from_manifest(cls, manifest: Manifest, columns: ChunkColumns | None = None) -> ChunkTable:
        """The table of ``manifest``, from its chunk columns (built here unless given)."""
        cols = ChunkColumns.from_manifest(manifest) if columns is None else columns
        kind, start, rows = _shape_columns(cols)
        files, file = _sorted_files(cols)
        # Rows in (file, byte_offset) order: a stable sort on the rank then puts each rank's items
        # in the order of its reads.
        order, file, byte_offset = _file_order(file, cols.byte_offset, len(files))
        key = cols.key[order]
        return cls(
            manifest=manifest,
            keys=cols.keys,
            files=files,
            key_kind=kind,
            key_rows=np.fromiter((s[0] if s else 1 for s in cols.shapes), np.int64, len(cols.shapes)),
            key_row_bytes=np.fromiter(
                (math.prod(s[1:]) * int(isz) for s, isz in zip(cols.shapes, cols.key_itemsize)),
                np.int64,
                len(cols.shapes),
            ),
            key_first=cols.first,
            key=key,
            index=(order - cols.first[key]).astype(np.int32),
            file=file,
            start=start[order],
            rows=rows[order],
            byte_offset=byte_offset,
            byte_length=cols.byte_length[order],
        )


_COLUMNS = (
    "key_kind",
    "key_rows",
    "key_row_bytes",
    "key_first",
    "key",
    "index",
    "file",
    "start",
    "rows",
    "byte_offset",
    "byte_length",
)


def _sorted_files(cols: ChunkColumns) -> tuple[tuple[str, ...], np.ndarray]:
    """The file names the chunks use, sorted, and each chunk's id among them."""
    used = np.flatnonzero(np.bincount(cols.file, minlength=len(cols.files)))
    names = [cols.files[i] for i in used.tolist()]
    order = sorted(range(len(names)), key=names.__getitem__)
    remap = np.zeros(len(cols.files), np.int32)
    remap[used[order]] = np.arange(len(order), dtype=np.int32)
    return tuple(names[i] for i in order), remap[cols.file]


def _file_order(file: np.ndarray, offset: np.ndarray, num_files: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows in (file, offset) order (stable), and the file and offset columns in it.

    A file's chunks usually come in offset order already (each rank writes its
    file front to back): then a stable counting sort on the file id gives that
    order without comparing offsets; otherwise a lexsort does.
    """
    order = np.argsort(file.astype(np.uint16) if num_files <= 2**16 else file, kind="stable")
    f, off = file[order], offset[order]
    if np.all((f[1:] != f[:-1]) | (off[1:] >= off[:-1])):
        return order, f, off
    order = np.lexsort((offset, file))
    return order, file[order], offset[order]


def _shape_columns(cols: ChunkColumns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per key its kind; per chunk its first dim-0 row and dim-0 size."""
    n, nkeys = cols.num_chunks, len(cols.keys)
    key, key_ndim, ndim = cols.key, cols.key_ndim, cols.ndim
    flat_off, flat_size, flat_first = cols.offsets, cols.sizes, cols.flat_first
    ndim_ok = ndim == key_ndim[key]
    start = np.zeros(n, np.int64)
    rows = np.ones(n, np.int64)
    nonempty = np.ones(n, bool)
    not_slab = np.zeros(n, bool)
    # One dim at a time over the chunks that have it (all of them, usually: no copy to make).
    shape_first = np.cumsum(key_ndim) - key_ndim
    for d in range(int(ndim.max()) if n else 0):
        has = ndim > d
        every = bool(has.all())
        at = flat_first if every else flat_first[has]
        if d:
            at = at + d
        off, size = flat_off[at], flat_size[at]
        where = slice(None) if every else has
        if d == 0:
            start[where] = off
            rows[where] = size
            nonempty[where] = size > 0
            continue
        nonempty[where] &= size > 0
        # A dim-0 slab has offsets[d] == 0 and sizes[d] == shape[d] (keys with more than d dims).
        dim_d = np.full(nkeys, -1, np.int64)
        long = np.flatnonzero(key_ndim > d)
        dim_d[long] = cols.key_shape[shape_first[long] + d]
        not_slab[where] |= (off != 0) | (size != dim_d[key if every else key[has]])
    not_slab &= ndim_ok

    def any_per_key(mask: np.ndarray) -> np.ndarray:
        # A key's rows are contiguous: reduce each key's run of the mask.
        out = np.zeros(nkeys, bool)
        has = np.flatnonzero(cols.counts)
        if len(has):
            out[has] = np.logical_or.reduceat(mask, cols.first[has])
        return out

    bad_ndim = any_per_key(~ndim_ok)
    dim0 = (key_ndim > 0) & ~bad_ndim & ~any_per_key(nonempty & not_slab) & any_per_key(nonempty)
    dim0[dim0] &= _disjoint_rows(key, start, rows, nonempty & dim0[key], nkeys)[dim0]
    kind = np.full(nkeys, OTHER, np.int8)
    kind[dim0] = DIM0
    kind[(key_ndim == 0) & ~bad_ndim] = SCALAR
    return kind, start, rows


def _disjoint_rows(key: np.ndarray, start: np.ndarray, rows: np.ndarray, mask: np.ndarray, nkeys: int) -> np.ndarray:
    """Per key: do the masked chunks' dim-0 ranges overlap nowhere?"""
    if mask.all():  # the usual case: no copy to make
        k, lo, hi = key, start, start + rows
    else:
        idx = np.flatnonzero(mask)
        k, lo = key[idx], start[idx]
        hi = lo + rows[idx]
    # Chunks are usually stored in dim-0 order already (no neighbour starting before its
    # predecessor ends means sorted and disjoint); sort only when they are not.
    overlap = (k[1:] == k[:-1]) & (lo[1:] < hi[:-1])
    if not overlap.any():
        return np.ones(nkeys, bool)
    order = np.lexsort((lo, k))
    k, lo, hi = k[order], lo[order], hi[order]
    overlap = (k[1:] == k[:-1]) & (lo[1:] < hi[:-1])
    return np.bincount(k[1:][overlap], minlength=nkeys) == 0


@dataclass(frozen=True, slots=True)
class RankRows:
    """Rank r's box of key k: rows [r * per[k], min(r * per[k] + step[k], rows)); per = step = ceil(rows / m),
    or per = 0 and step = 1 for a 0-dim key (every rank gets its only "row")."""

    per: np.ndarray
    step: np.ndarray


def dim0_item_bounds(
    rank: int, start: np.ndarray, rows: np.ndarray, key_rows: np.ndarray, row_bytes: np.ndarray, rows_of: RankRows
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What rank ``rank`` reads of chunks (dim-0 ``start``, ``rows``) of keys (``key_rows``,
    ``row_bytes``, and ``rows_of`` as in ``create_dim0_plans``, each chunk's key's): first row,
    row count, and the byte range [lo, hi) from the chunk's first byte."""
    a = rank * rows_of.per
    first = np.maximum(start, a)
    last = np.minimum(start + rows, np.minimum(a + rows_of.step, key_rows))
    return first, last - first, (first - start) * row_bytes, (last - start) * row_bytes
