"""The save planner as it was before it worked on columns (one Python object per box), kept to
check that ``create_save_plans`` gives the same plans."""

from __future__ import annotations

from collections.abc import Sequence

from rayckpt.errors import InvalidStateError
from rayckpt.format.boxes import Box, split_box
from rayckpt.format.manifest import itemsize
from rayckpt.planning.save_plan import MAX_CHUNK_BYTES, LocalShard, SavePlan, WriteItem


def reference_save_plans(
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
