"""The tensor chunks of a manifest as numpy columns (``ChunkColumns``). Pure: numpy, no I/O.

One row per chunk, the rows of a key contiguous and in ``TensorEntry.chunks``
order, the keys in manifest order. Validation (``manifest_checks``) and the bulk
planner's ``ChunkTable`` work on these columns instead of walking the
``ChunkEntry`` objects. The columns are what a per-chunk table on storage holds
(key, box offsets and sizes, file id, byte offset and length, checksums), so a
reader of such a table can build them without any per-chunk Python object.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from .boxes import Box
from .manifest import DTYPES, ChunkEntry, Manifest, TensorEntry

if TYPE_CHECKING:
    from .shard_file import WrittenChunk


@dataclass(frozen=True, eq=False, kw_only=True)
class ChunkColumns:
    """Every tensor chunk of one manifest, a numpy array per field (int64 unless said)."""

    #: Tensor keys in manifest order; ``dtypes``, ``shapes`` and ``counts`` follow it.
    keys: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    #: Per key: its number of chunks (its rows follow the previous key's).
    counts: np.ndarray
    #: File names the ``file`` column indexes (the manifest's files first, in its order).
    files: tuple[str, ...]
    #: Per chunk: file id (int32), byte offset and length in the file, number of block checksums.
    file: np.ndarray
    byte_offset: np.ndarray
    byte_length: np.ndarray
    num_checksums: np.ndarray
    #: Per chunk: number of dims of its box.
    ndim: np.ndarray
    #: Every chunk's box offsets and sizes back to back, ``ndim`` values each (row ``i`` at
    #: ``flat_first[i]``); never negative, as in a ``Box`` (a reader of a stored table checks it).
    offsets: np.ndarray
    sizes: np.ndarray
    #: Every chunk's block checksums back to back (uint64; row ``i``'s at ``checksum_first[i]``).
    #: ``None`` where not needed (columns built only to check a manifest).
    checksums: np.ndarray | None = None

    @classmethod
    def from_manifest(
        cls, manifest: Manifest, keys: Sequence[str] | None = None, checksums: bool = False
    ) -> ChunkColumns:
        """The columns of ``keys`` (tensor keys; default: all of them, in manifest order).

        A manifest read from a chunk table (version 4), or made by ``create_manifest``,
        has them already, checksums included: returned as they are when every key is
        asked for. Otherwise one pass over the chunks
        per column, at C speed (``np.fromiter`` over ``attrgetter``); ``checksums``
        also gathers the block checksums. Raises ``OverflowError`` when a value does
        not fit in int64 (possible only in a manifest built in memory: decoding
        refuses such values).
        """
        if keys is None and manifest.columns is not None:
            return manifest.columns  # type: ignore[no-any-return]
        if keys is None:
            keys = [k for k, e in manifest.entries.items() if isinstance(e, TensorEntry)]
        entries: list[TensorEntry] = [manifest.entries[k] for k in keys]  # type: ignore[misc]
        counts = np.fromiter(map(len, map(attrgetter("chunks"), entries)), np.int64, len(entries))
        fields = _chunk_fields(
            [f.path for f in manifest.files],
            lambda: chain.from_iterable(map(attrgetter("chunks"), entries)),
            int(counts.sum()),
            checksums,
        )
        return cls(
            keys=tuple(keys),
            dtypes=tuple(e.dtype for e in entries),
            shapes=tuple(e.shape for e in entries),
            counts=counts,
            **fields,
        )

    @classmethod
    def from_chunks(
        cls,
        keys: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[tuple[int, ...]],
        files: Sequence[str],
        chunks: Sequence[WrittenChunk],
    ) -> ChunkColumns:
        """The columns (with checksums) of ``chunks`` as ranks report them, in any order: the rows of a
        key together in ``keys`` order, a key's rows by box offsets (stable), as ``create_manifest`` orders
        them. ``files`` first in the file names. Raises ``KeyError`` naming a key not in ``keys``."""
        ids = {k: i for i, k in enumerate(keys)}
        n = len(chunks)
        key = np.fromiter(map(ids.__getitem__, map(attrgetter("key"), chunks)), np.int32, n)
        fields = _chunk_fields(files, lambda: iter(chunks), n, True)
        ndim, offsets, num_checksums = fields["ndim"], fields["offsets"], fields["num_checksums"]
        width = int(ndim.max(initial=0))
        padded = np.full((n, width), -1, np.int64)  # shorter boxes sort first, as shorter tuples do
        rows = np.repeat(np.arange(n), ndim)
        padded[rows, np.arange(len(offsets)) - np.repeat(np.cumsum(ndim) - ndim, ndim)] = offsets
        order = np.lexsort([padded[:, d] for d in reversed(range(width))] + [key])
        for name in ("file", "byte_offset", "byte_length", "num_checksums", "ndim"):
            fields[name] = fields[name][order]
        fields["offsets"], fields["sizes"] = (_gather(ndim, order, fields[f]) for f in ("offsets", "sizes"))
        fields["checksums"] = _gather(num_checksums, order, fields["checksums"])
        return cls(
            keys=tuple(keys),
            dtypes=tuple(dtypes),
            shapes=tuple(shapes),
            counts=np.bincount(key, minlength=len(keys)).astype(np.int64),
            **fields,
        )

    @property
    def num_chunks(self) -> int:
        return len(self.file)

    def select(self, start: int, stop: int) -> ChunkColumns:
        """The columns of keys ``start`` to ``stop`` (their rows are contiguous: views, no copy)."""
        lo = int(self.first[start]) if start < len(self.keys) else self.num_chunks
        hi = lo + int(self.counts[start:stop].sum())
        flo = int(self.flat_first[lo]) if lo < self.num_chunks else len(self.offsets)
        fhi = flo + int(self.ndim[lo:hi].sum())
        return ChunkColumns(
            keys=self.keys[start:stop],
            dtypes=self.dtypes[start:stop],
            shapes=self.shapes[start:stop],
            counts=self.counts[start:stop],
            files=self.files,
            file=self.file[lo:hi],
            byte_offset=self.byte_offset[lo:hi],
            byte_length=self.byte_length[lo:hi],
            num_checksums=self.num_checksums[lo:hi],
            ndim=self.ndim[lo:hi],
            offsets=self.offsets[flo:fhi],
            sizes=self.sizes[flo:fhi],
            checksums=None if self.checksums is None else self.checksums[self._checksum_range(lo, hi)],
        )

    def _checksum_range(self, lo: int, hi: int) -> slice:
        start = int(self.checksum_first[lo]) if lo < self.num_chunks else len(self.checksums)  # type: ignore[arg-type]
        return slice(start, start + int(self.num_checksums[lo:hi].sum()))

    def chunk(self, row: int) -> ChunkEntry:
        """Row ``row`` as a ``ChunkEntry`` (a manifest read from a chunk table builds its chunks here)."""
        if self.checksums is None:
            raise ValueError("these chunk columns hold no checksums")
        offsets, sizes = self.box(row)
        lo = int(self.checksum_first[row])
        return ChunkEntry(
            box=Box(tuple(offsets), tuple(sizes)),
            file=self.files[int(self.file[row])],
            byte_offset=int(self.byte_offset[row]),
            byte_length=int(self.byte_length[row]),
            checksums=tuple(self.checksums[lo : lo + int(self.num_checksums[row])].tolist()),
        )

    @cached_property
    def key(self) -> np.ndarray:
        """Per chunk: its key id (int32, into ``keys``)."""
        return np.repeat(np.arange(len(self.keys), dtype=np.int32), self.counts)

    @cached_property
    def first(self) -> np.ndarray:
        """Per key: its first row."""
        return np.cumsum(self.counts) - self.counts

    @cached_property
    def checksum_first(self) -> np.ndarray:
        """Per chunk: where its block checksums start in ``checksums``."""
        return np.cumsum(self.num_checksums) - self.num_checksums

    @cached_property
    def flat_first(self) -> np.ndarray:
        """Per chunk: where its box starts in ``offsets`` and ``sizes``."""
        return np.cumsum(self.ndim) - self.ndim

    @cached_property
    def key_ndim(self) -> np.ndarray:
        return np.fromiter(map(len, self.shapes), np.int64, len(self.shapes))

    @cached_property
    def key_shape(self) -> np.ndarray:
        """Every key's shape back to back (key ``k``'s at ``cumsum(key_ndim)[k] - key_ndim[k]``)."""
        return np.fromiter(chain.from_iterable(self.shapes), np.int64, int(self.key_ndim.sum()))

    @cached_property
    def key_itemsize(self) -> np.ndarray:
        """Per key: bytes per element, 0 for a dtype rayckpt does not know."""
        return np.fromiter((DTYPES[d][0] if d in DTYPES else 0 for d in self.dtypes), np.int64, len(self.dtypes))

    def box(self, row: int) -> tuple[list[int], list[int]]:
        """Offsets and sizes of one chunk's box, as Python ints."""
        lo = int(self.flat_first[row])
        hi = lo + int(self.ndim[row])
        return self.offsets[lo:hi].tolist(), self.sizes[lo:hi].tolist()

    def boxes_with_ndim(self, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows whose box has ``d`` dims, and their offsets and sizes as (rows, d) arrays."""
        rows = np.flatnonzero(self.ndim == d)
        if len(rows) == self.num_chunks:  # every box has d dims: views, no copy
            return rows, self.offsets.reshape(len(rows), d), self.sizes.reshape(len(rows), d)
        at = self.flat_first[rows][:, None] + np.arange(d)
        return rows, self.offsets[at], self.sizes[at]

    def volumes(self) -> tuple[np.ndarray, np.ndarray]:
        """Per chunk: element count (int64; wraps past 2**63) and the same in float64 (never wraps)."""
        volume = np.ones(self.num_chunks, np.int64)
        approx = np.ones(self.num_chunks, np.float64)
        for d in np.flatnonzero(np.bincount(self.ndim)).tolist():
            if d:
                rows, _, sizes = self.boxes_with_ndim(d)
                volume[rows] = sizes.prod(axis=1)
                approx[rows] = sizes.prod(axis=1, dtype=np.float64)
        return volume, approx


def _chunk_fields(known: Sequence[str], chunks: Callable[[], Iterator[Any]], n: int, checksums: bool) -> dict[str, Any]:
    """The per-chunk columns of ``n`` chunks (``ChunkEntry`` or ``WrittenChunk``: ``chunks()`` iterates
    them afresh), one pass per column at C speed (``np.fromiter`` over ``attrgetter``)."""

    def column(field: str) -> np.ndarray:
        return np.fromiter(map(attrgetter(field), chunks()), np.int64, n)

    def lengths(field: str) -> np.ndarray:
        return np.fromiter(map(len, map(attrgetter(field), chunks())), np.int64, n)

    def flat(field: str, count: int, dtype: type = np.int64) -> np.ndarray:
        return np.fromiter(chain.from_iterable(map(attrgetter(field), chunks())), dtype, count)

    files, file = _file_ids(known, lambda: map(attrgetter("file"), chunks()), n)
    ndim = lengths("box.sizes")
    num_checksums = lengths("checksums")
    return {
        "files": files,
        "file": file,
        "byte_offset": column("byte_offset"),
        "byte_length": column("byte_length"),
        "num_checksums": num_checksums,
        "ndim": ndim,
        "offsets": flat("box.offsets", int(ndim.sum())),
        "sizes": flat("box.sizes", int(ndim.sum())),
        "checksums": flat("checksums", int(num_checksums.sum()), np.uint64) if checksums else None,
    }


def _gather(lengths: np.ndarray, order: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The variable-length rows of ``values`` (row ``i`` holds ``lengths[i]``) in row order ``order``."""
    first = np.cumsum(lengths) - lengths
    taken = lengths[order]
    starts = np.repeat(first[order] - (np.cumsum(taken) - taken), taken)
    return values[starts + np.arange(int(taken.sum()))]


def _file_ids(known: Sequence[str], names: Callable[[], Iterator[str]], n: int) -> tuple[tuple[str, ...], np.ndarray]:
    """The file names (``known``, then any other a chunk names, by first use) and each chunk's file id."""
    ids = {name: i for i, name in enumerate(dict.fromkeys(known))}

    try:
        file = np.fromiter(map(ids.__getitem__, names()), np.int32, n)
    except KeyError:  # a chunk names a file the manifest does not list (decoding refuses those)
        for name in dict.fromkeys(names()):
            ids.setdefault(name, len(ids))
        file = np.fromiter(map(ids.__getitem__, names()), np.int32, n)
    return tuple(ids), file
