"""A tensor's chunks as rows of a chunk table (``ChunkRows``), each ``ChunkEntry`` built when asked. Pure.

A version-4 manifest read from storage holds its chunks as numpy columns
(``chunk_columns.ChunkColumns``); its tensor entries' ``chunks`` are these views,
so a plan that reads 2 of a key's 4,096 chunks builds those 2 objects, not 4,096.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, overload

if TYPE_CHECKING:
    from .manifest import ChunkEntry


class ChunkSource(Protocol):
    """Where a chunk table's rows come from (``chunk_columns.ChunkColumns``)."""

    def chunk(self, row: int) -> ChunkEntry: ...


class ChunkRows(Sequence["ChunkEntry"]):
    """A tensor's chunks: rows ``lo`` to ``hi`` of a chunk table (a sequence of ``ChunkEntry``)."""

    __slots__ = ("_source", "_lo", "_hi")

    def __init__(self, source: ChunkSource, lo: int, hi: int) -> None:
        self._source, self._lo, self._hi = source, lo, hi

    def __len__(self) -> int:
        return self._hi - self._lo

    @overload
    def __getitem__(self, i: int) -> ChunkEntry: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[ChunkEntry, ...]: ...
    def __getitem__(self, i: int | slice) -> ChunkEntry | tuple[ChunkEntry, ...]:
        if isinstance(i, slice):
            return tuple(self._source.chunk(self._lo + j) for j in range(*i.indices(len(self))))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        return self._source.chunk(self._lo + (i % n))

    def __iter__(self) -> Iterator[ChunkEntry]:
        return map(self._source.chunk, range(self._lo, self._hi))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"ChunkRows(rows {self._lo}:{self._hi})"
