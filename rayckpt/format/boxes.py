"""N-d box math for tensors stored in row-major order. Pure: stdlib only.

A *box* is the part of a tensor's global index space that a shard or a chunk
covers: ``offsets[d] <= i[d] < offsets[d] + sizes[d]`` for every dim ``d``.
A 0-dim tensor has the empty box ``Box((), ())`` of volume 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"box offsets {self.offsets} and sizes {self.sizes} differ in rank")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.sizes):
            raise ValueError(f"box offsets {self.offsets} and sizes {self.sizes} must be >= 0")

    @staticmethod
    def full(shape: Sequence[int]) -> Box:
        return Box((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def volume(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def contains(self, other: Box) -> bool:
        return all(
            o <= p and p + q <= o + s for o, s, p, q in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )

    def relative_to(self, outer: Box) -> Box:
        """This box with offsets measured from ``outer``'s corner."""
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.sizes)

    def to_slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or ``None`` when it is empty."""
    if a.ndim != b.ndim:
        raise ValueError(f"cannot intersect boxes of rank {a.ndim} and {b.ndim}")
    offsets = []
    sizes = []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo = max(ao, bo)
        hi = min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    if a.volume == 0 or b.volume == 0:
        return None
    return Box(tuple(offsets), tuple(sizes))


def row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    return tuple(strides)


@dataclass(frozen=True, slots=True)
class Runs:
    """Where a sub-box lies inside the row-major storage of an outer box.

    ``count`` runs of ``length`` elements; run ``i`` starts at element
    ``start + i * stride``. ``span`` is the element count from the first run's
    start to the last run's end.
    """

    start: int
    length: int
    count: int
    stride: int

    @property
    def span(self) -> int:
        if self.count == 0:
            return 0
        return (self.count - 1) * self.stride + self.length


def contiguous_runs(outer: Box, inner: Box) -> Runs:
    """Describe ``inner`` (inside ``outer``) as evenly spaced contiguous runs.

    Trailing dims that ``inner`` covers fully merge into one run; e.g. a dim-0
    slab of a chunk is a single run.  Only regular spacing is representable, so a
    sub-box spanning several partial leading dims is described by the runs of its
    innermost partial dim and the caller reads their span.
    """
    if not outer.contains(inner):
        raise ValueError(f"box {inner} is not inside {outer}")
    rel = inner.relative_to(outer)
    strides = row_major_strides(outer.sizes)
    start = sum(o * s for o, s in zip(rel.offsets, strides))
    if inner.volume == 0:
        return Runs(start, 0, 0, 0)
    # m: first dim from which everything to the right is fully covered.
    m = outer.ndim
    while m > 0 and inner.sizes[m - 1] == outer.sizes[m - 1]:
        m -= 1
    if m == 0:
        return Runs(start, inner.volume, 1, inner.volume)
    length = inner.sizes[m - 1] * strides[m - 1]
    leading = inner.sizes[: m - 1]
    # Runs over the partial dims left of m-1 are evenly spaced only when at most one
    # of them has size > 1; otherwise describe the whole span as one "run".
    multi = [d for d, s in enumerate(leading) if s > 1]
    if not multi:
        return Runs(start, length, 1, length)
    if len(multi) == 1:
        d = multi[0]
        return Runs(start, length, leading[d], strides[d])
    last = sum((o + s - 1) * st for o, s, st in zip(rel.offsets, inner.sizes, strides)) + 1
    return Runs(start, last - start, 1, last - start)


def split_box(box: Box, itemsize: int, max_bytes: int) -> list[Box]:
    """Split ``box`` into row-major-contiguous pieces of at most ``max_bytes``.

    Splits along the first dim whose slices still exceed the limit, recursing
    into a single slice only when one slice alone is too large.
    """
    if box.volume * itemsize <= max_bytes or box.ndim == 0:
        return [box]
    d = 0
    while d < box.ndim and box.sizes[d] == 1:
        d += 1
    if d == box.ndim:
        return [box]
    slice_bytes = math.prod(box.sizes[d + 1 :]) * itemsize
    if slice_bytes > max_bytes:
        pieces: list[Box] = []
        for i in range(box.sizes[d]):
            offs = list(box.offsets)
            sizes = list(box.sizes)
            offs[d] += i
            sizes[d] = 1
            pieces.extend(split_box(Box(tuple(offs), tuple(sizes)), itemsize, max_bytes))
        return pieces
    per = max(1, max_bytes // slice_bytes)
    pieces = []
    for lo in range(0, box.sizes[d], per):
        offs = list(box.offsets)
        sizes = list(box.sizes)
        offs[d] += lo
        sizes[d] = min(per, box.sizes[d] - lo)
        pieces.append(Box(tuple(offs), tuple(sizes)))
    return pieces


def find_coverage_problem(shape: Sequence[int], boxes: Iterable[Box]) -> str | None:
    """Say how ``boxes`` fail to tile ``shape`` exactly once, or ``None`` if they do.

    Empty boxes are ignored.  Checks bounds, pairwise overlap and total volume
    (disjoint boxes inside the tensor whose volumes add up cover it).
    """
    full = Box.full(shape)
    nonempty = [b for b in boxes if b.volume > 0]
    for b in nonempty:
        if b.ndim != full.ndim or not full.contains(b):
            return f"chunk {_fmt(b)} lies outside the tensor of shape {tuple(shape)}"
    if full.ndim == 0:
        if len(nonempty) > 1:
            return f"{len(nonempty)} chunks of a 0-dim tensor overlap"
        return None if nonempty else "chunks cover 0 of 1 elements: a gap"
    nonempty.sort(key=lambda b: b.offsets)
    if _is_dim0_tiling(nonempty):
        # Sorted dim-0 slabs: overlap or gap shows as a mismatch of neighbours.
        for a, b in zip(nonempty, nonempty[1:]):
            if b.offsets[0] < a.ends[0]:
                return f"chunks {_fmt(a)} and {_fmt(b)} overlap"
    else:
        for i, a in enumerate(nonempty):
            for b in nonempty[i + 1 :]:
                if b.offsets[0] >= a.ends[0]:
                    break
                if intersect(a, b) is not None:
                    return f"chunks {_fmt(a)} and {_fmt(b)} overlap"
    covered = sum(b.volume for b in nonempty)
    if covered != full.volume:
        return f"chunks cover {covered} of {full.volume} elements: a gap"
    return None


def _is_dim0_tiling(boxes: list[Box]) -> bool:
    if not boxes or boxes[0].ndim == 0:
        return False
    rest = boxes[0].sizes[1:]
    return all(b.sizes[1:] == rest and not any(b.offsets[1:]) for b in boxes)


def _fmt(b: Box) -> str:
    return f"offsets={list(b.offsets)} sizes={list(b.sizes)}"
