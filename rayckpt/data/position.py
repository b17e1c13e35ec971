"""A job's place in its data, global rather than per rank, and how it is split among any number of ranks.

An epoch of a map-style dataset of ``length`` samples is one permutation of its
indices (``permutation``: seeded by ``seed + epoch`` when shuffled, as
``DistributedSampler`` does). A ``DataPosition`` says which of the permutation's
offsets the whole job has consumed: every offset below ``consumed``, and the few
above it in ``extras`` (where ranks were not in step: uneven remainders, a rank a
batch ahead). What is left (``remaining``) is split among ``M`` ranks by striping,
rank ``r`` taking every ``M``-th offset from the ``r``-th; with ``drop_last`` the
tail that does not split evenly is dropped. Each rank reports a ``RankShare`` (the
position it started from and how many of its samples it consumed); ``combine``
turns every rank's share into the new global position, whatever ``M`` was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import DataPositionError

#: The fields of a position as the manifest's ``data_position`` stores them.
FIELDS = ("dataset", "length", "epoch", "seed", "shuffle", "drop_last", "consumed", "extras", "world_size")


@dataclass(frozen=True, slots=True, kw_only=True)
class DataPosition:
    """Where the whole job is in one epoch: which offsets of its permutation were consumed."""

    #: What the dataset is (with ``length``, its fingerprint): a position is resumed only into the same one.
    dataset: str
    length: int
    epoch: int = 0
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    #: Every offset of the epoch's permutation below this one was consumed.
    consumed: int = 0
    #: Offsets at or above ``consumed`` that were consumed too, ascending.
    extras: tuple[int, ...] = ()
    #: The worker count that consumed up to here (0: none yet, a fresh epoch).
    world_size: int = 0

    def __post_init__(self) -> None:
        where = f"data position of {self.dataset!r}"
        for name in ("length", "epoch", "seed", "consumed", "world_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise DataPositionError(f"{where}: {name} must be a whole number >= 0, got {value!r}")
        if self.consumed > self.length:
            raise DataPositionError(f"{where}: consumed {self.consumed} is past the length {self.length}")
        extras = self.extras
        if any(type(e) is not int for e in extras) or list(extras) != sorted(set(extras)):
            raise DataPositionError(f"{where}: extras must be ascending whole numbers, got {list(extras)!r}")
        if extras and (extras[0] <= self.consumed or extras[-1] >= self.length):
            raise DataPositionError(
                f"{where}: extras must lie above consumed ({self.consumed}) and below the length "
                f"({self.length}), got {list(extras)!r}"
            )

    @property
    def fingerprint(self) -> str:
        """The dataset's identity and length, as errors name it."""
        return f"{self.dataset!r} of {self.length} samples"

    @property
    def complete(self) -> bool:
        """Whether nothing of the epoch is left (a drop_last tail counts as consumed)."""
        return self.consumed >= self.length

    def left(self) -> int:
        """How many offsets of the epoch are not consumed."""
        return self.length - self.consumed - len(self.extras)

    def to_json(self) -> dict[str, Any]:
        return {name: list(self.extras) if name == "extras" else getattr(self, name) for name in FIELDS}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> DataPosition:
        """The position a manifest's ``data_position`` (or a rank's share) holds; ``where`` names it in errors."""
        if not isinstance(doc, dict) or set(doc) != set(FIELDS):
            got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
            raise DataPositionError(f"{where}: a data position has the fields {list(FIELDS)}, got {got}")
        if type(doc["shuffle"]) is not bool or type(doc["drop_last"]) is not bool or type(doc["dataset"]) is not str:
            raise DataPositionError(f"{where}: dataset must be a string, shuffle and drop_last booleans: {doc}")
        if not isinstance(doc["extras"], list):
            raise DataPositionError(f"{where}: extras must be a list, got {doc['extras']!r}")
        fields = {**doc, "extras": tuple(doc["extras"])}
        try:
            return cls(**fields)
        except DataPositionError as exc:
            raise DataPositionError(f"{where}: {exc}") from None


def split_count(position: DataPosition, world_size: int) -> int:
    """How many of the remaining offsets ``world_size`` ranks consume between them (drop_last: a multiple)."""
    left = position.left()
    return left - left % world_size if position.drop_last else left


def share_count(position: DataPosition, rank: int, world_size: int) -> int:
    """How many samples rank ``rank`` of ``world_size`` gets of what is left of the epoch."""
    total = split_count(position, world_size)
    return max(0, (total - rank + world_size - 1) // world_size)


def remaining_offset(position: DataPosition, index: int) -> int:
    """The ``index``-th offset (from 0) of the permutation not yet consumed."""
    offset = position.consumed + index
    for extra in position.extras:
        if extra > offset:
            break
        offset += 1
    return offset


@dataclass(frozen=True, slots=True, kw_only=True)
class RankShare:
    """One rank's part of a position: the position its share was split from, and how much of it it consumed."""

    base: DataPosition
    rank: int
    world_size: int
    #: Samples of its share this rank consumed (counted as the loader handed them out).
    taken: int

    def to_json(self) -> dict[str, Any]:
        return {"base": self.base.to_json(), "rank": self.rank, "world_size": self.world_size, "taken": self.taken}

    @classmethod
    def from_json(cls, doc: dict[str, Any], where: str) -> RankShare:
        try:
            base = DataPosition.from_json(doc["base"], where)
            return cls(base=base, rank=int(doc["rank"]), world_size=int(doc["world_size"]), taken=int(doc["taken"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise DataPositionError(f"{where}: not a rank's data share ({exc!r}): {doc!r}") from None


def combine(shares: Sequence[RankShare]) -> DataPosition:
    """The job's position from every rank's share, rank order (``shares[r]`` is rank ``r``'s).

    Raises ``DataPositionError`` when the ranks did not split the same position among
    the same world size (a rank in another epoch), naming the ranks that differ.
    """
    world = len(shares)
    first = shares[0]
    for r, share in enumerate(shares):
        if share.rank != r or share.world_size != world:
            raise DataPositionError(
                f"rank {r}'s data share says rank {share.rank} of {share.world_size}, in a save by {world} ranks: "
                "give every rank a sampler made with its own rank and the job's world size"
            )
        if share.base != first.base:
            raise DataPositionError(
                f"the ranks are at different data positions: rank 0 in epoch {first.base.epoch} "
                f"({first.base.fingerprint}), rank {r} in epoch {share.base.epoch} ({share.base.fingerprint}); "
                "every rank must call set_epoch alike and start its epochs at the same step"
            )
    base = first.base
    taken = [s.taken for s in shares]
    counts = [share_count(base, r, world) for r in range(world)]
    for r in range(world):
        if not 0 <= taken[r] <= counts[r]:
            raise DataPositionError(f"rank {r} consumed {taken[r]} samples of a share of {counts[r]}")
    if taken == counts:  # the epoch is through on every rank (a drop_last tail with it)
        return replace(base, consumed=base.length, extras=(), world_size=world)
    # The first offset nobody consumed; everything before it was, by some rank or earlier.
    first_free = min(taken[r] * world + r for r in range(world) if taken[r] < counts[r])
    beyond = [r + world * j for r in range(world) for j in range(max(0, (first_free - r) // world + 1), taken[r])]
    consumed = remaining_offset(base, first_free)
    extras = {remaining_offset(base, i) for i in beyond} | {e for e in base.extras if e > consumed}
    return replace(base, consumed=consumed, extras=tuple(sorted(extras)), world_size=world)
