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

``PlanAgreement`` runs these steps on one rank; the plans are kept in a
``PlanCache`` its caller holds (one plan per process group).
"""

from __future__ import annotations

import math
import pickle
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..data.loaders import share_of
from ..data.position import RankShare, combine
from ..errors import DataPositionError, InvalidStateError, PeerLostError, SaveFailedError
from ..format.manifest import itemsize
from ..format.paths import Path
from ..format.shard_file import DEFAULT_BLOCK_SIZE, auto_block_size
from ..format.values import encode_value
from ..planning import save_plan
from ..planning.save_columns import ShardLayout, assign_writers, digest
from ..planning.save_plan import LocalShard, SavePlan, create_own_plan
from .coordinator import Coordinator, ProcessGroupCoordinator, plan_at_root
from .increments import Increment
from .state import FlatState, flat_of


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
    #: Rank 0 only (empty elsewhere): what the committer learned by planning.
    root: RootPlan


@dataclass(frozen=True, slots=True)
class PlanCounts:
    """How many save plans a ``PlanCache`` made (``planned``) and reused (``cached``)."""

    planned: int = 0
    cached: int = 0


class PlanCache:
    """Save plans, one per process group (keyed by the group, its world size and the rank), kept while
    the layouts repeat; plans depend on the layouts only, so one made for a save to one location
    serves saves to any other. Held by whoever runs the saves (``engine.save.PROCESS_PLANS`` for
    ``rayckpt.save`` and the Ray saves of a process); any thread may use it."""

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], CachedPlan] = {}
        self._counts = PlanCounts()
        self._lock = threading.Lock()

    def get(self, coord: Coordinator) -> CachedPlan | None:
        return self._plans.get(_group_key(coord))

    def reused(self) -> None:
        with self._lock:
            self._counts = PlanCounts(self._counts.planned, self._counts.cached + 1)

    def keep(self, coord: Coordinator, cached: CachedPlan) -> None:
        """Keep the plan just made for ``coord``'s group (replacing the one it had)."""
        with self._lock:
            self._plans[_group_key(coord)] = cached
            self._counts = PlanCounts(self._counts.planned + 1, self._counts.cached)

    def counts(self) -> PlanCounts:
        return self._counts

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()


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


@dataclass(frozen=True, slots=True)
class SaveIds:
    """Rank 0's claim on a save's location: the new save's id, the save it replaces, its ``Increment``."""

    save_id: str
    previous: str | None
    increment: Increment


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
    #: This rank's share of the job's data position (None: the save was given no ``data``).
    data: RankShare | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """Rank 0's answer to the headers, the same for every rank."""

    ids: SaveIds
    #: The nodes the ranks run on (each once, sorted).
    nodes: tuple[str, ...]
    block_size: int
    #: Digest of every rank's layout when every rank's cached plan was made for them (None: plan again).
    cached: bytes | None
    #: The job's data position, every rank's share combined (``rayckpt.data.combine``); None: none saved.
    data_position: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Share:
    """What rank 0's planner sends one rank: every rank's layouts digest, and which of its shards it writes."""

    layouts: bytes
    #: One bit per shard of the rank, in its order.
    written: bytes


@dataclass(frozen=True, slots=True)
class RootPlan:
    """What the committer (rank 0) needs beyond its own plan; empty on the other ranks."""

    #: Every tensor's (dtype, shape).
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    #: Every rank's plain values, merged (``_merge_values``).
    values: dict[str, Any] = field(default_factory=dict)
    #: Every key's path.
    paths: dict[str, Path] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LocalLayout:
    """This rank's state flattened, its shards and the layout it sends."""

    flat: FlatState
    shards: tuple[LocalShard, ...]
    layout: RankLayout


@dataclass(frozen=True, slots=True, kw_only=True)
class AgreedPlan:
    """A save's plan on one rank, after the collectives."""

    ids: SaveIds
    plan: SavePlan
    #: The nodes the ranks run on (each once, sorted).
    nodes: tuple[str, ...]
    #: Rank 0 only (empty elsewhere): what the committer needs.
    root: RootPlan
    #: Whether the cached plan was used.
    cached: bool
    flat: FlatState
    #: Digest of every rank's layout hash, in rank order: equal digests, equal tensors and paths.
    layouts: bytes = b""
    #: The save's checksum block size: the caller's, else rank 0's ``auto_block_size`` pick.
    block_size: int = DEFAULT_BLOCK_SIZE
    #: The manifest's ``data_position`` (None: the save was given no ``data``).
    data_position: dict[str, Any] | None = None


class PlanAgreement:
    """One save's planning on one rank, in the order its steps run (collective; see the module).

    1. ``local_header`` (every rank): flatten the state, make the rank's layout and header;
       rank 0 first claims the save (``claim``).
    2. ``decide`` (rank 0, on every header): the save's ids, nodes and block size, and whether
       every rank's cached plan holds. When it does, each rank takes its cached plan (``_reuse``).
    3. ``plan_writes`` (rank 0, on every rank's layout): who writes what; each rank gets its ``Share``.
    4. ``own_plan`` (every rank): its plan from its share, kept in ``plans``.

    Args:
        coord: How the ranks agree.
        plans: The cache the plan is taken from and kept in.
        node: Where this rank runs (the Ray node id), sent to rank 0.
        claim: Rank 0's claim on the location, called on rank 0 only, before anything is shared.
        block_size: The checksum block size (rank 0's is used); None: rank 0 picks it from the
            largest state any rank holds (``auto_block_size``).
        data: The job's place in its data (``rayckpt.data.share_of``): each rank's share goes with
            its header and rank 0 combines them in ``decide``; None: no data position.
    """

    def __init__(
        self,
        coord: Coordinator,
        plans: PlanCache,
        *,
        node: str,
        claim: Callable[[], SaveIds],
        block_size: int | None,
        data: Any = None,
    ) -> None:
        self.coord = coord
        self.data = data
        self.plans = plans
        self.node = node
        self.claim = claim
        self.block_size = block_size
        self._local: LocalLayout | None = None
        self._ids: SaveIds | None = None  # rank 0
        self._values: list[dict[str, Any]] = []  # rank 0: every rank's plain values
        self._layouts = b""  # rank 0: every rank's layouts digest
        self._root = RootPlan()

    def agree(self, state_dict: dict[str, Any] | FlatState) -> AgreedPlan:
        """Run the steps on ``state_dict`` (every rank calls it)."""
        header = lambda: self.local_header(state_dict)  # noqa: E731
        decision = plan_at_root(self.coord, "save (collecting state)", header, self.decide, *_ERRORS)
        cached = self.plans.get(self.coord)
        if decision.cached is not None and cached is not None and cached.layouts == decision.cached:
            return self._reuse(decision, cached)
        share = plan_at_root(self.coord, "save (planning)", self._layout, self.plan_writes, *_ERRORS)
        return self.own_plan(decision, share)

    def local_header(self, state_dict: dict[str, Any] | FlatState) -> Header:
        data = None if self.data is None else share_of(self.data)  # refused before rank 0 claims anything
        flat = flat_of(state_dict)
        shards = tuple(LocalShard(t.key, t.dtype, t.shape, box) for t in flat.tensors.values() for box in t.boxes())
        self._local = LocalLayout(flat, shards, rank_layout(flat, shards))
        if self.coord.rank == 0:
            self._ids = self.claim()
        cached = self.plans.get(self.coord)
        nbytes = sum(math.prod(t.shape) * itemsize(t.dtype) for t in flat.tensors.values())
        return Header(
            layout=self._local.layout.hash,
            cached=cached.layouts if cached else None,
            node=self.node,
            values={k: encode_value(v.value, k) for k, v in flat.values.items()},
            state_bytes=nbytes,
            data=data,
        )

    def decide(self, headers: list[Header]) -> list[Decision]:
        assert self._ids is not None
        self._layouts = digest(*(h.layout for h in headers))
        self._values = [h.values for h in headers]
        hit = all(h.cached == self._layouts for h in headers)
        nodes = tuple(sorted({h.node for h in headers}))
        block = self.block_size or auto_block_size(max(h.state_bytes for h in headers))
        position = data_position([h.data for h in headers])
        cached = self._layouts if hit else None
        decision = Decision(ids=self._ids, nodes=nodes, block_size=block, cached=cached, data_position=position)
        return [decision] * self.coord.world_size

    def plan_writes(self, layouts: list[RankLayout]) -> list[Share]:
        assignment = assign_writers([lay.shards for lay in layouts])
        values = _merge_values(self._values, assignment.tensors)
        self._root = RootPlan(assignment.tensors, values, _merge_paths(layouts))
        return [
            Share(self._layouts, _bits(written, len(lay.shards.entry)))
            for written, lay in zip(assignment.written, layouts, strict=True)
        ]

    def own_plan(self, decision: Decision, share: Share) -> AgreedPlan:
        local = self._local
        assert local is not None
        bits = np.frombuffer(share.written, dtype=np.uint8)
        mine = np.flatnonzero(np.unpackbits(bits, count=len(local.shards)))
        own = create_own_plan(self.coord.rank, list(local.shards), mine.tolist(), save_plan.MAX_CHUNK_BYTES)
        self.plans.keep(self.coord, CachedPlan(share.layouts, own, self._root))
        return self._agreed(decision, own, self._root, cached=False, layouts=share.layouts)

    def _layout(self) -> RankLayout:
        assert self._local is not None
        return self._local.layout

    def _reuse(self, decision: Decision, cached: CachedPlan) -> AgreedPlan:
        self.plans.reused()
        root = RootPlan()
        if self.coord.rank == 0:
            values = _merge_values(self._values, cached.root.tensors)
            root = RootPlan(dict(cached.root.tensors), values, dict(cached.root.paths))
        return self._agreed(decision, cached.plan, root, cached=True, layouts=cached.layouts)

    def _agreed(
        self, decision: Decision, plan: SavePlan, root: RootPlan, *, cached: bool, layouts: bytes
    ) -> AgreedPlan:
        assert self._local is not None
        return AgreedPlan(
            ids=decision.ids,
            plan=plan,
            nodes=decision.nodes,
            root=root,
            cached=cached,
            flat=self._local.flat,
            layouts=layouts,
            block_size=decision.block_size,
            data_position=decision.data_position,
        )


_ERRORS = (SaveFailedError, PeerLostError)


def data_position(shares: Sequence[RankShare | None]) -> dict[str, Any] | None:
    """The manifest's ``data_position`` from every rank's share (None: no rank gave ``data``)."""
    without = [r for r, s in enumerate(shares) if s is None]
    if len(without) == len(shares):
        return None
    if without:
        raise DataPositionError(
            f"rank(s) {without} saved without data= while the others gave their data position: "
            "every rank must pass its sampler or loader"
        )
    return combine([s for s in shares if s is not None]).to_json()


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
