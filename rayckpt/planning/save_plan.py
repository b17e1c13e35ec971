"""Save plans: which rank writes which box. Pure: no torch.distributed, no Ray, no I/O.

Every rank reports the boxes it holds (``LocalShard``); one rank picks a
writer for each distinct box (replicated data is written once, bytes spread
across ranks: ``save_columns.assign_writers``, on numpy columns), and each rank
turns its part into its own plan (``create_own_plan``), splitting chunks larger
than the Arrow limit. ``save_columns.create_save_plans`` does all of it in one
process. The mirror image of ``load_plan``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..format.boxes import Box, split_box
from ..format.manifest import itemsize

#: Arrow arrays are addressed with 32-bit lengths in many readers: stay under 2 GiB.
MAX_CHUNK_BYTES = 2**31 - 64


@dataclass(frozen=True, slots=True)
class LocalShard:
    """A rank's piece of a tensor: what it holds, not yet what it writes."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    box: Box


@dataclass(frozen=True, slots=True)
class WriteItem:
    key: str
    #: Global box to write; lies inside ``local``.
    box: Box
    #: The rank's whole local box, to slice ``box`` out of the local tensor.
    local: Box


@dataclass(frozen=True, slots=True)
class SavePlan:
    rank: int
    items: tuple[WriteItem, ...]

    def nbytes(self, dtypes: Mapping[str, str]) -> int:
        return sum(i.box.volume * itemsize(dtypes[i.key]) for i in self.items)


def create_own_plan(
    rank: int, shards: Sequence[LocalShard], written: Sequence[int], max_chunk_bytes: int = MAX_CHUNK_BYTES
) -> SavePlan:
    """A rank's plan from the indices of its shards it writes (``Assignment.written``): each
    written box, split in pieces of at most ``max_chunk_bytes``, sorted by key and offsets."""
    items: list[WriteItem] = []
    for i in written:
        s = shards[int(i)]
        items.extend(WriteItem(s.key, piece, s.box) for piece in split_box(s.box, itemsize(s.dtype), max_chunk_bytes))
    return SavePlan(rank, tuple(sorted(items, key=lambda i: (i.key, i.box.offsets))))
