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


@dataclass(frozen=True, eq=False)
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
        key = cols.key
        key_first = cols.first
        index = (np.arange(cols.num_chunks) - np.repeat(key_first, cols.counts)).astype(np.int32)
        kind, start, rows = _shape_columns(cols)
        files, file = _sorted_files(cols)
        byte_offset, byte_length = cols.byte_offset, cols.byte_length
        # Rows in (file, byte_offset) order: a stable sort on the rank then puts each rank's items
        # in the order of its reads.
        order = np.lexsort((byte_offset, file))
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
            key_first=key_first,
            key=key[order],
            index=index[order],
            file=file[order],
            start=start[order],
            rows=rows[order],
            byte_offset=byte_offset[order],
            byte_length=byte_length[order],
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


def _shape_columns(cols: ChunkColumns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per key its kind; per chunk its first dim-0 row and dim-0 size."""
    n, nkeys = cols.num_chunks, len(cols.keys)
    key, ndim, flat_off, flat_size = cols.key, cols.ndim, cols.offsets, cols.sizes
    nflat = len(flat_size)
    # flat_chunk[i] is the chunk of flat element i.
    flat_chunk = np.repeat(np.arange(n), ndim)
    flat_first = cols.flat_first
    dim = np.arange(nflat) - flat_first[flat_chunk]
    has_dims = ndim > 0
    start = np.zeros(n, np.int64)
    rows = np.ones(n, np.int64)
    start[has_dims] = flat_off[flat_first[has_dims]]
    rows[has_dims] = flat_size[flat_first[has_dims]]
    nonempty = np.bincount(flat_chunk[flat_size == 0], minlength=n) == 0

    # A dim-0 slab has offsets[1:] == 0 and sizes[1:] == shape[1:].
    key_ndim = cols.key_ndim
    ndim_ok = ndim == key_ndim[key]
    shape_flat = cols.key_shape
    shape_first = np.cumsum(key_ndim) - key_ndim
    tail = np.flatnonzero(ndim_ok[flat_chunk] & (dim > 0))
    want = shape_flat[shape_first[key[flat_chunk[tail]]] + dim[tail]]
    off_tail = tail[(flat_off[tail] != 0) | (flat_size[tail] != want)]
    not_slab = np.bincount(flat_chunk[off_tail], minlength=n) > 0

    def any_per_key(mask: np.ndarray) -> np.ndarray:
        return np.bincount(key[mask], minlength=nkeys) > 0

    bad_ndim = any_per_key(~ndim_ok)
    dim0 = (key_ndim > 0) & ~bad_ndim & ~any_per_key(nonempty & not_slab) & any_per_key(nonempty)
    dim0[dim0] &= _disjoint_rows(key, start, rows, nonempty & dim0[key], nkeys)[dim0]
    kind = np.full(nkeys, OTHER, np.int8)
    kind[dim0] = DIM0
    kind[(key_ndim == 0) & ~bad_ndim] = SCALAR
    return kind, start, rows


def _disjoint_rows(key: np.ndarray, start: np.ndarray, rows: np.ndarray, mask: np.ndarray, nkeys: int) -> np.ndarray:
    """Per key: do the masked chunks' dim-0 ranges overlap nowhere?"""
    idx = np.flatnonzero(mask)
    k, lo = key[idx], start[idx]
    hi = lo + rows[idx]
    # Chunks are usually stored in dim-0 order already; sort only when they are not.
    if np.any((k[1:] == k[:-1]) & (lo[1:] < hi[:-1])):
        order = np.lexsort((lo, k))
        k, lo, hi = k[order], lo[order], hi[order]
    overlap = (k[1:] == k[:-1]) & (lo[1:] < hi[:-1])
    return np.bincount(k[1:][overlap], minlength=nkeys) == 0
