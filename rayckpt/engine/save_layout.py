"""How a save's ranks agree on its plan: small collectives, one planner, a cached plan.

Each rank's *layout* is what its plan depends on: its shards (keys, dtypes,
global shapes, boxes), its plain values' keys and its keys' paths. A save
starts with one gather to rank 0 of a small header per rank (its layout's
hash, the hash its cached plan was made for, its node, its plain values) and
one scatter back (the save id, whether the cached plans hold, the nodes).
When every rank's layout is the one its cached plan was made for (the same
hashes on every rank, in rank order), every rank reuses its cached plan and
rank 0 its cached tensors and paths: nothing more is sent. Otherwise each rank
sends its layout (``planning.save_columns.ShardLayout``: proportional to its
own shards) to rank 0, which plans every rank's writes once
(``assign_writers``) and sends each rank only its own part
(``coordinator.plan_at_root``). Only rank 0 (the committer) learns every
tensor and path; the others hold the save's ids.

The cache holds one plan per process group (keyed by the group and its world
size) in this process; plans depend on the layouts only, so one made for a
save to one location serves saves to any other.
"""

from __future__ import annotations

import math
import pickle
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidStateError, PeerLostError, SaveFailedError
from ..format.manifest import itemsize
from ..format.paths import Path
from ..format.shard_file import DEFAULT_BLOCK_SIZE, auto_block_size
from ..format.values import encode_value
from ..planning import save_plan
from ..planning.save_columns import ShardLayout, assign_writers, digest
from ..planning.save_plan import LocalShard, SavePlan, create_own_plan
from .coordinator import Coordinator, ProcessGroupCoordinator, plan_at_root
from .increments import Increment
from .state import FlatState, flatten

#: Counts of this process's save plans: made ("planned") and reused from the cache ("cached").
PLAN_STATS = {"planned": 0, "cached": 0}


@dataclass(frozen=True, slots=True)
class RankLayout:
    """What one rank sends to the planner when the plans are not cached."""

    shards: ShardLayout
    #: Compressed pickle of (plain value keys, paths), decoded on rank 0 once per distinct ``names_hash``.
    names: bytes
    names_hash: bytes

    @property
    def hash(self) -> bytes:
        return digest(self.shards.digest(), self.names_hash, str(save_plan.MAX_CHUNK_BYTES).encode())


def rank_layout(flat: FlatState, shards: Sequence[LocalShard]) -> RankLayout:
    value_keys = tuple(flat.values)
    # repr, not pickle, identifies the names: a pickle's bytes depend on which equal strings are one object.
    names_hash = digest(repr((value_keys, tuple(flat.paths.items()))).encode())
    names = zlib.compress(pickle.dumps((value_keys, flat.paths), protocol=pickle.HIGHEST_PROTOCOL), 1)
    return RankLayout(ShardLayout.from_shards(shards), names, names_hash)


@dataclass(frozen=True, slots=True)
class CachedPlan:
    """A process's plan for one process group, and the layouts it was made for."""

    #: Digest of every rank's layout hash, in rank order.
    layouts: bytes
    plan: SavePlan
    #: Rank 0 only (empty elsewhere): every tensor's (dtype, shape), every key's path.
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    paths: dict[str, Path]


_CACHE: dict[tuple[Any, ...], CachedPlan] = {}


def clear_plan_cache() -> None:
    _CACHE.clear()


def _group_key(coord: Coordinator) -> tuple[Any, ...]:
    """Which process group ``coord`` runs on, its size and this rank.

    A ``ProcessGroupCoordinator``'s group; another coordinator's ``group``
    attribute; else its type (``LocalCoordinator``: a world of one). An id reused
    by a later group cannot mislead: a cached plan serves only the layouts it
    was made for.
    """
    if isinstance(coord, ProcessGroupCoordinator):
        import torch.distributed as dist

        group = coord._group if coord._group is not None else dist.distributed_c10d._get_default_group()
    else:
        group = getattr(coord, "group", None)
    ident = id(group) if group is not None else type(coord).__qualname__
    return (ident, coord.world_size, coord.rank)


@dataclass(frozen=True, slots=True, kw_only=True)
class Header:
    """What a rank sends at the start of every save."""

    layout: bytes
    #: ``CachedPlan.layouts`` of this rank's cached plan (None: none).
    cached: bytes | None
    node: str
    values: dict[str, Any]
    #: Bytes of every tensor this rank holds a piece of, at its global shape (for the block size).
    state_bytes: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class AgreedPlan:
    """A save's plan on one rank, after the collectives."""

    save_id: str
    previous: str | None
    plan: SavePlan
    #: Rank 0's decision on sharing with an earlier save (``increments``), the same on every rank.
    increment: Increment
    #: The nodes the ranks run on (each once, sorted).
    nodes: tuple[str, ...]
    #: Rank 0 only (empty elsewhere): what the committer needs.
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    values: dict[str, Any]
    paths: dict[str, Path]
    #: Whether the cached plan was used.
    cached: bool
    flat: FlatState
    #: Digest of every rank's layout hash, in rank order: equal digests, equal tensors and paths.
    layouts: bytes = b""
    #: The save's checksum block size: the caller's, else rank 0's ``auto_block_size`` pick.
    block_size: int = DEFAULT_BLOCK_SIZE


def agree_on_plan(
    coord: Coordinator,
    state_dict: dict[str, Any] | FlatState,
    node: str,
    claim: Callable[[], tuple[str, str | None, Increment]],
    block_size: int | None = None,
) -> AgreedPlan:
    """Flatten this rank's state and agree on the save's plan (collective; see the module).

    ``claim``: rank 0's new save id, the save it replaces (it claims the
    location) and its ``Increment``; called on rank 0 only, before anything is shared. ``block_size``:
    the checksum block size (rank 0's is used); None: rank 0 picks it from the
    largest state any rank holds (``auto_block_size``), the same on every rank.
    """
    key = _group_key(coord)
    local: dict[str, Any] = {}

    def header() -> Header:
        flat = flatten(state_dict)
        shards = [LocalShard(t.key, t.dtype, t.shape, box) for t in flat.tensors.values() for box in t.boxes()]
        local.update(flat=flat, shards=shards, layout=rank_layout(flat, shards))
        if coord.rank == 0:
            local["ids"] = claim()
        cached = _CACHE.get(key)
        values = {k: encode_value(v.value, k) for k, v in flat.values.items()}
        nbytes = sum(math.prod(t.shape) * itemsize(t.dtype) for t in flat.tensors.values())
        return Header(
            layout=local["layout"].hash,
            cached=cached.layouts if cached else None,
            node=node,
            values=values,
            state_bytes=nbytes,
        )

    root: dict[str, Any] = {}  # rank 0: what it learns from the headers

    def decide(headers: list[Header]) -> list[tuple[str, str | None, Increment, bytes | None, tuple[str, ...], int]]:
        layouts = digest(*(h.layout for h in headers))
        hit = all(h.cached == layouts for h in headers)
        root.update(layouts=layouts, values=[h.values for h in headers])
        save_id, previous, increment = local["ids"]
        nodes = tuple(sorted({h.node for h in headers}))
        block = block_size or auto_block_size(max(h.state_bytes for h in headers))
        return [(save_id, previous, increment, layouts if hit else None, nodes, block)] * coord.world_size

    phase = "save (collecting state)"
    agreed = plan_at_root(coord, phase, header, decide, SaveFailedError, PeerLostError)
    save_id, previous, increment, hit, nodes, block = agreed
    flat: FlatState = local["flat"]
    cached = _CACHE.get(key)
    if hit is not None and cached is not None and cached.layouts == hit:
        PLAN_STATS["cached"] += 1
        values = _merge_values(root["values"], cached.tensors) if coord.rank == 0 else {}
        tensors, paths = dict(cached.tensors), dict(cached.paths)
        return AgreedPlan(
            save_id=save_id,
            previous=previous,
            increment=increment,
            plan=cached.plan,
            nodes=nodes,
            tensors=tensors,
            values=values,
            paths=paths,
            cached=True,
            flat=flat,
            layouts=hit,
            block_size=block,
        )

    def plan(layouts: list[RankLayout]) -> list[tuple[bytes, bytes]]:
        assignment = assign_writers([lay.shards for lay in layouts])
        root.update(tensors=assignment.tensors, paths=_merge_paths(layouts))
        root["merged"] = _merge_values(root["values"], assignment.tensors)
        # Each rank's part: which of its shards it writes, one bit per shard.
        return [
            (root["layouts"], _bits(written, len(lay.shards.entry)))
            for written, lay in zip(assignment.written, layouts, strict=True)
        ]

    phase = "save (planning)"
    layouts, written = plan_at_root(coord, phase, lambda: local["layout"], plan, SaveFailedError, PeerLostError)
    shards = local["shards"]
    mine = np.flatnonzero(np.unpackbits(np.frombuffer(written, dtype=np.uint8), count=len(shards)))
    own = create_own_plan(coord.rank, shards, mine.tolist(), save_plan.MAX_CHUNK_BYTES)
    tensors, paths = root.get("tensors", {}), root.get("paths", {})
    _CACHE[key] = CachedPlan(layouts, own, tensors, paths)
    PLAN_STATS["planned"] += 1
    merged = root.get("merged", {})
    return AgreedPlan(
        save_id=save_id,
        previous=previous,
        increment=increment,
        plan=own,
        nodes=nodes,
        tensors=tensors,
        values=merged,
        paths=paths,
        cached=False,
        flat=flat,
        layouts=layouts,
        block_size=block,
    )


def _bits(indices: np.ndarray, n: int) -> bytes:
    mask = np.zeros(n, dtype=bool)
    mask[indices] = True
    return np.packbits(mask).tobytes()


def _merge_values(per_rank: Sequence[dict[str, Any]], tensors: dict[str, Any]) -> dict[str, Any]:
    """Replicated plain values: the lowest rank that has a key wins."""
    merged: dict[str, Any] = {}
    for values in per_rank:
        for k, v in values.items():
            if k in tensors:
                raise InvalidStateError(f"key {k!r} is a tensor on one rank and a plain value on another")
            merged.setdefault(k, v)
    return merged


def _merge_paths(layouts: Sequence[RankLayout]) -> dict[str, Path]:
    """Every key's path: the lowest rank's wins, keys in the order the highest rank first names
    them (as when every rank's paths were merged); each distinct set of names is decoded once."""
    decoded: dict[bytes, dict[str, Path]] = {}
    for lay in layouts:  # ascending, each set at its lowest rank: setdefault keeps the lowest rank's path
        if lay.names_hash not in decoded:
            decoded[lay.names_hash] = pickle.loads(zlib.decompress(lay.names))[1]
    chosen: dict[str, Path] = {}
    for paths in decoded.values():
        for k, p in paths.items():
            chosen.setdefault(k, p)
    order: dict[str, None] = {}
    for h in dict.fromkeys(lay.names_hash for lay in reversed(layouts)):
        order.update(dict.fromkeys(decoded[h]))
    return {k: chosen[k] for k in order}
