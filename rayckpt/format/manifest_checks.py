"""Is a manifest consistent? Every chunk's bytes and checksums, every tensor's tiling. Pure: numpy, no I/O.

``find_manifest_problems`` screens the chunk columns (``ChunkColumns``) with array
operations and formats a message only for the chunks and keys that fail: a
manifest with nothing wrong costs a few passes over its columns, not a string per
chunk. What the screen cannot decide at once goes to the exact per-chunk and
per-key checks, which write the messages:

- a chunk is *suspect* when any check fails on it, or when its numbers are so large
  that int64 arithmetic could wrap (then Python ints decide);
- a key's chunks *certainly tile* it when its non-empty chunks are slabs along one
  dim (every other dim whole), contiguous from 0 to the end of that dim, or one
  chunk holding the whole tensor, or none for an empty tensor; any other layout
  (2-D grids, overlaps, gaps) goes to ``boxes.find_coverage_problem``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .boxes import Box, find_coverage_problem
from .chunk_columns import ChunkColumns
from .manifest import DTYPES, Manifest, TensorEntry

#: Numbers below this add and multiply (by an itemsize) without wrapping int64.
_SAFE = 2**62


def find_manifest_problems(m: Manifest, columns: ChunkColumns | None = None) -> list[str]:
    """Structural checks: dtypes, chunk sizes, coverage, checksum counts. Pure.

    The problems in manifest key order, and within a key in chunk order, its
    coverage last. ``columns``: the manifest's chunk columns, when the caller has
    them (else built here, a batch of keys at a time, so that the memory the
    checks take stays bounded however large the manifest).
    """
    if columns is None:
        columns = m.columns  # read from a chunk table (version 4); else built below
    if columns is None:
        keys = [k for k, e in m.entries.items() if isinstance(e, TensorEntry)]
        counts = [len(m.entries[k].chunks) for k in keys]  # type: ignore[union-attr]
    else:
        keys, counts = list(columns.keys), columns.counts.tolist()
    problems: list[str] = []
    for start, stop in _batches(counts, BATCH_CHUNKS):
        try:
            cols = ChunkColumns.from_manifest(m, keys[start:stop]) if columns is None else columns.select(start, stop)
            problems += _column_problems(m, cols, _file_sizes(m, cols.files))
        except OverflowError:  # a number past int64 (in a shape, a chunk, a file size): only built in memory
            problems += _object_problems(m, keys[start:stop])
    return problems


#: Chunks checked at once: the checks hold a few numbers per chunk of a batch, so their memory stays
#: bounded for any manifest size.
BATCH_CHUNKS = 1 << 18


def _batches(counts: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive key ranges of at most ``limit`` chunks each (a larger key alone)."""
    out = []
    start, total = 0, 0
    for i, n in enumerate(counts):
        if total + n > limit and i > start:
            out.append((start, i))
            start, total = i, 0
        total += n
    if start < len(counts):
        out.append((start, len(counts)))
    return out


def _column_problems(m: Manifest, cols: ChunkColumns, file_size: np.ndarray) -> list[str]:
    """The problems of the keys of ``cols``: screened on the columns, written for what fails."""
    suspect = _suspect_chunks(cols, file_size, m.block_size)
    unsure = ~_tiled_keys(cols)
    known = cols.key_itemsize > 0
    flagged = ~known | unsure | (np.bincount(cols.key[suspect], minlength=len(cols.keys)) > 0)
    problems: list[str] = []
    for k in np.flatnonzero(flagged).tolist():
        key = cols.keys[k]
        if not known[k]:
            problems.append(f"key {key!r}: unknown dtype {cols.dtypes[k]!r}")
            continue
        first, count = int(cols.first[k]), int(cols.counts[k])
        for row in (first + np.flatnonzero(suspect[first : first + count])).tolist():
            offsets, sizes = cols.box(row)
            file = int(cols.file[row])
            chunk = _StoredChunk(
                key=key,
                offsets=offsets,
                file=cols.files[file],
                byte_offset=int(cols.byte_offset[row]),
                byte_length=int(cols.byte_length[row]),
                volume=math.prod(sizes),
                file_size=int(file_size[file]),
                num_checksums=int(cols.num_checksums[row]),
            )
            problems += _chunk_problems(chunk, int(cols.key_itemsize[k]), m.block_size)
        if unsure[k]:
            boxes = (Box(*map(tuple, cols.box(row))) for row in range(first, first + count))
            problem = find_coverage_problem(cols.shapes[k], boxes)
            if problem:
                problems.append(f"key {key!r}: {problem}")
    return problems


@dataclass(frozen=True, slots=True, kw_only=True)
class _StoredChunk:
    """One chunk as the manifest records it, and its file's recorded size (Python ints: exact)."""

    key: str
    offsets: Sequence[int]
    file: str
    byte_offset: int
    byte_length: int
    volume: int
    file_size: int
    num_checksums: int


def _chunk_problems(c: _StoredChunk, isz: int, block_size: int) -> list[str]:
    """What is wrong with one chunk."""
    key, offsets, file, byte_offset, byte_length = c.key, c.offsets, c.file, c.byte_offset, c.byte_length
    volume, file_size, num_checksums = c.volume, c.file_size, c.num_checksums
    out = []
    where = f"key {key!r} chunk {list(offsets)} in file {file!r}"
    if byte_offset < 0:
        out.append(f"{where}: negative byte_offset {byte_offset}")
    if byte_length != volume * isz:
        out.append(f"{where}: byte_length {byte_length} != {volume} elements x {isz} bytes")
    if byte_offset + byte_length > file_size:
        out.append(
            f"{where}: bytes [{byte_offset}, {byte_offset + byte_length}) lie past the file's recorded size {file_size}"
        )
    want = -(-byte_length // block_size) if byte_length else 0
    if num_checksums != want:
        out.append(f"{where}: {num_checksums} checksums for {want} blocks")
    return out


def _object_problems(m: Manifest, keys: Sequence[str]) -> list[str]:
    """The same checks on the ``ChunkEntry`` objects of tensor ``keys``, one by one."""
    problems: list[str] = []
    sizes = {f.path: f.size for f in m.files}
    for key in keys:
        e = m.tensor(key)
        if e.dtype not in DTYPES:
            problems.append(f"key {key!r}: unknown dtype {e.dtype!r}")
            continue
        isz = DTYPES[e.dtype][0]
        for c in e.chunks:
            chunk = _StoredChunk(
                key=key,
                offsets=c.box.offsets,
                file=c.file,
                byte_offset=c.byte_offset,
                byte_length=c.byte_length,
                volume=c.box.volume,
                file_size=sizes.get(c.file, 0),
                num_checksums=len(c.checksums),
            )
            problems += _chunk_problems(chunk, isz, m.block_size)
        problem = find_coverage_problem(e.shape, (c.box for c in e.chunks))
        if problem:
            problems.append(f"key {key!r}: {problem}")
    return problems


def _file_sizes(m: Manifest, files: Sequence[str]) -> np.ndarray:
    """The recorded size of each of ``files`` (0 for one the manifest does not list)."""
    sizes = {f.path: f.size for f in m.files}
    return np.array([sizes.get(name, 0) for name in files], np.int64)


def _suspect_chunks(cols: ChunkColumns, file_size: np.ndarray, block_size: int) -> np.ndarray:
    """Per chunk: might a check fail on it? (Exact where False.)"""
    if not 0 < block_size < _SAFE:
        return np.ones(cols.num_chunks, bool)
    bo, bl = cols.byte_offset, cols.byte_length
    isz = cols.key_itemsize[cols.key]
    volume, approx = cols.volumes()
    # Past _SAFE the int64 sums and products below could wrap: Python ints decide those chunks.
    approx *= isz
    suspect = approx >= _SAFE
    del approx
    suspect |= (bo < 0) | (bo >= _SAFE) | (bl <= -_SAFE) | (bl >= _SAFE)
    volume *= isz
    suspect |= bl != volume
    del volume, isz
    end = bo + bl
    suspect |= end > file_size[cols.file]
    del end
    suspect |= cols.num_checksums != -(-bl // block_size)
    return suspect


def _tiled_keys(cols: ChunkColumns) -> np.ndarray:
    """Per key: do its non-empty chunks certainly tile its shape exactly once? (False: not sure.)"""
    n, nkeys = cols.num_chunks, len(cols.keys)
    key, key_ndim = cols.key, cols.key_ndim
    shape_first = np.cumsum(key_ndim) - key_ndim
    # Per chunk: non-empty (an empty one covers nothing wherever it lies, as in find_coverage_problem),
    # odd (its ndim is not its tensor's, or a number is negative), its number of partial dims (dims
    # it covers only part of), and for a chunk with one that dim and the range it covers along it.
    nonempty = np.ones(n, bool)
    odd = np.zeros(n, bool)
    num_partial = np.zeros(n, np.int16)
    axis = np.zeros(n, np.int16)
    lo = np.zeros(n, np.int64)
    hi = np.zeros(n, np.int64)
    for d in np.flatnonzero(np.bincount(cols.ndim)).tolist():
        rows, offsets, sizes = cols.boxes_with_ndim(d)
        nonempty[rows] = sizes.all(axis=1)
        k = key[rows]
        odd[rows] = (key_ndim[k] != d) | (offsets < 0).any(axis=1) | (sizes < 0).any(axis=1)
        if d == 0:
            continue
        if not np.all(key_ndim[k] == d):
            fits = np.flatnonzero(key_ndim[k] == d)
            rows, offsets, sizes, k = rows[fits], offsets[fits], sizes[fits], k[fits]
        # The shape of each key of d dims (zeros for the others), and one dim at a time.
        shape = np.zeros((nkeys, d), np.int64)
        of_d = np.flatnonzero(key_ndim == d)
        shape[of_d] = cols.key_shape[shape_first[of_d][:, None] + np.arange(d)]
        count = np.zeros(len(rows), np.int16)
        for j in range(d):
            partial = (offsets[:, j] != 0) | (sizes[:, j] != shape[k, j])
            count += partial
            # The partial dim of a chunk with one (one with more is not a slab: undecided).
            hit = np.flatnonzero(partial)
            at = rows[hit]
            axis[at] = j
            lo[at] = offsets[hit, j]
            hi[at] = lo[at] + sizes[hit, j]  # a wrap (past 2**63) passes no check below
        num_partial[rows] = count

    def per_key(mask: np.ndarray) -> np.ndarray:
        return np.bincount(key[mask], minlength=nkeys)

    unsure = per_key(nonempty & (odd | (num_partial > 1))) > 0
    count = per_key(nonempty)
    whole = per_key(nonempty & ~odd & (num_partial == 0))
    key_of_dim = np.repeat(np.arange(nkeys), key_ndim)
    empty_key = np.bincount(key_of_dim[cols.key_shape == 0], minlength=nkeys) > 0
    tiled = ((whole == 1) & (count == 1)) | ((count == 0) & empty_key)
    slabs = np.flatnonzero(nonempty & ~odd & (num_partial == 1))
    tiled |= (whole == 0) & (count > 0) & _slabs_tile(cols, key[slabs], axis[slabs], lo[slabs], hi[slabs], shape_first)
    return tiled & ~unsure


def _slabs_tile(
    cols: ChunkColumns, k: np.ndarray, d: np.ndarray, lo: np.ndarray, hi: np.ndarray, shape_first: np.ndarray
) -> np.ndarray:
    """Per key: are its slabs (key ``k``, along dim ``d``, covering ``[lo, hi)``; in key order) all
    along one dim, and contiguous from 0 to that dim's end?"""
    nkeys = len(cols.keys)
    head = np.ones(len(k), bool)
    head[1:] = k[1:] != k[:-1]
    key_axis = np.zeros(nkeys, np.int64)
    key_axis[k[head]] = d[head]
    bad = d != key_axis[k]
    # A key's chunks are usually stored in order already; sort only when they are not.
    if np.any(~head[1:] & (lo[1:] < lo[:-1])):
        order = np.lexsort((lo, k))
        k, lo, hi, bad = k[order], lo[order], hi[order], bad[order]
    tail = np.ones(len(k), bool)
    tail[:-1] = head[1:]
    bad |= head & (lo != 0)
    bad[1:] |= ~head[1:] & (lo[1:] != hi[:-1])
    bad |= tail & (hi != cols.key_shape[shape_first[k] + key_axis[k]])
    return np.bincount(k[bad], minlength=nkeys) == 0
