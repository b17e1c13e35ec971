"""Save plans: which rank writes which box. Pure: no torch.distributed, no Ray, no I/O.

Every rank reports the boxes it holds (``LocalShard``); ``create_save_plans``
picks one writer for each distinct box (replicated data is written once),
spreading bytes across ranks, and splits chunks larger than the Arrow limit.
The mirror image of ``load_plan``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import InvalidStateError
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


def create_save_plans(
    shards_by_rank: Sequence[Sequence[LocalShard]], max_chunk_bytes: int = MAX_CHUNK_BYTES
) -> list[SavePlan]:
    """One plan per rank: each distinct (key, box) is written by exactly one holder.

    Raises ``InvalidStateError`` when ranks disagree on a key's dtype or shape.
    """
    meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
    holders: dict[tuple[str, Box], list[int]] = {}
    for rank, shards in enumerate(shards_by_rank):
        for s in shards:
            seen = meta.setdefault(s.key, (s.dtype, s.shape, rank))
            if seen[:2] != (s.dtype, s.shape):
                raise InvalidStateError(
                    f"key {s.key!r}: rank {seen[2]} has dtype {seen[0]} shape {list(seen[1])} but "
                    f"rank {rank} has dtype {s.dtype} shape {list(s.shape)}; every rank must agree"
                )
            if s.box.volume:
                holders.setdefault((s.key, s.box), []).append(rank)
    load = [0] * len(shards_by_rank)
    assigned: list[list[WriteItem]] = [[] for _ in shards_by_rank]
    # Largest first, each to its least-loaded holder: greedy balance, deterministic.
    order = sorted(holders, key=lambda kb: (-kb[1].volume * itemsize(meta[kb[0]][0]), kb[0], kb[1].offsets))
    for key, box in order:
        isz = itemsize(meta[key][0])
        ranks = holders[(key, box)]
        writer = min(ranks, key=lambda r: (load[r], r))
        load[writer] += box.volume * isz
        for piece in split_box(box, isz, max_chunk_bytes):
            assigned[writer].append(WriteItem(key, piece, box))
    return [
        SavePlan(rank, tuple(sorted(items, key=lambda i: (i.key, i.box.offsets))))
        for rank, items in enumerate(assigned)
    ]
