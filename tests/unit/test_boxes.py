"""Pure unit tests for rayckpt.boxes: box math, contiguous runs, splitting, coverage."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayckpt.format.boxes import (
    Box,
    Runs,
    contiguous_runs,
    find_coverage_problem,
    intersect,
    row_major_strides,
    split_box,
)


def B(offsets, sizes) -> Box:
    return Box(tuple(offsets), tuple(sizes))


def positions(outer: Box, inner: Box) -> list[int]:
    """Row-major element positions of ``inner`` inside ``outer``'s storage, by brute force."""
    strides = row_major_strides(outer.sizes)
    ranges = [range(o - p, o - p + s) for o, s, p in zip(inner.offsets, inner.sizes, outer.offsets)]
    return sorted(sum(i * st for i, st in zip(idx, strides)) for idx in itertools.product(*ranges))


def run_elements(r: Runs) -> list[int]:
    return [r.start + i * r.stride + j for i in range(r.count) for j in range(r.length)]


# ---------------------------------------------------------------------------
# Box


def test_box_rejects_rank_mismatch_and_negatives():
    with pytest.raises(ValueError, match="differ in rank"):
        B((0,), (1, 2))
    with pytest.raises(ValueError, match=">= 0"):
        B((-1, 0), (1, 2))
    with pytest.raises(ValueError, match=">= 0"):
        B((0, 0), (1, -2))


def test_box_properties():
    b = B((2, 1), (3, 4))
    assert b.ndim == 2
    assert b.volume == 12
    assert b.ends == (5, 5)
    assert b.to_slices() == (slice(2, 5), slice(1, 5))
    assert b.relative_to(B((1, 1), (9, 9))) == B((1, 0), (3, 4))
    assert Box.full((4, 5)) == B((0, 0), (4, 5))
    assert Box.full(()) == Box((), ())
    assert Box.full(()).volume == 1
    assert B((0, 0), (0, 5)).volume == 0
    assert B((0, 0), (10, 10)).contains(b)
    assert not B((0, 0), (4, 10)).contains(b)
    assert not B((3, 0), (10, 10)).contains(b)


@pytest.mark.parametrize(
    "a, b, expected",
    [
        # overlapping 2-d boxes
        (B((0, 0), (4, 4)), B((2, 1), (4, 2)), B((2, 1), (2, 2))),
        # one inside the other
        (B((0, 0), (10, 10)), B((3, 4), (2, 2)), B((3, 4), (2, 2))),
        # touching edges do not intersect (half-open)
        (B((0, 0), (2, 4)), B((2, 0), (2, 4)), None),
        # disjoint in the second dim only
        (B((0, 0), (4, 2)), B((0, 2), (4, 2)), None),
        # 1-d
        (B((3,), (5,)), B((0,), (4,)), B((3,), (1,))),
        # 0-dim boxes always meet
        (Box((), ()), Box((), ()), Box((), ())),
        # an empty box meets nothing, even when its offsets lie inside the other
        (B((0, 0), (4, 4)), B((1, 1), (0, 2)), None),
        (B((1, 1), (2, 0)), B((0, 0), (4, 4)), None),
    ],
)
def test_intersect(a, b, expected):
    assert intersect(a, b) == expected
    assert intersect(b, a) == expected


def test_intersect_rank_mismatch():
    with pytest.raises(ValueError, match="rank"):
        intersect(B((0,), (1,)), B((0, 0), (1, 1)))


def test_row_major_strides():
    assert row_major_strides((4, 5, 6)) == (30, 6, 1)
    assert row_major_strides((7,)) == (1,)
    assert row_major_strides(()) == ()


# ---------------------------------------------------------------------------
# contiguous_runs


@pytest.mark.parametrize(
    "outer, inner, expected",
    [
        # dim-0 slab of a chunk: one run
        (B((0, 0), (10, 4)), B((3, 0), (5, 4)), Runs(12, 20, 1, 20)),
        # dim-0 slab of a 3-d chunk that itself starts at row 4
        (B((4, 0, 0), (6, 2, 3)), B((5, 0, 0), (2, 2, 3)), Runs(6, 12, 1, 12)),
        # the whole box
        (B((2, 0), (3, 4)), B((2, 0), (3, 4)), Runs(0, 12, 1, 12)),
        # Shard(1) column block of a (6, 8) tensor: one run per row
        (B((0, 0), (6, 8)), B((0, 2), (6, 3)), Runs(2, 3, 6, 8)),
        # column block of a sub-range of rows
        (B((0, 0), (6, 8)), B((1, 4), (3, 4)), Runs(12, 4, 3, 8)),
        # a single row's partial columns: one run
        (B((0, 0), (6, 8)), B((2, 3), (1, 4)), Runs(19, 4, 1, 4)),
        # one partial leading dim + full trailing dim in 3-d
        (B((0, 0, 0), (4, 5, 6)), B((1, 1, 0), (2, 2, 6)), Runs(36, 12, 2, 30)),
        # two partial leading dims (sizes > 1) -> one run covering the whole span
        # first element (1,1,1) at 37, last (2,2,3) at 75
        (B((0, 0, 0), (4, 5, 6)), B((1, 1, 1), (2, 2, 3)), Runs(37, 39, 1, 39)),
        # partial leading dims of size 1 do not count as "several"
        (B((0, 0, 0), (4, 5, 6)), B((1, 1, 1), (1, 3, 2)), Runs(37, 2, 3, 6)),
        # 0-dim tensor: one element
        (Box((), ()), Box((), ()), Runs(0, 1, 1, 1)),
        # 1-d
        (B((10,), (10,)), B((13,), (4,)), Runs(3, 4, 1, 4)),
    ],
)
def test_contiguous_runs(outer, inner, expected):
    runs = contiguous_runs(outer, inner)
    assert runs == expected
    got = positions(outer, inner)
    assert set(got) <= set(run_elements(runs))
    assert runs.start == got[0]
    assert runs.start + runs.span == got[-1] + 1


def test_contiguous_runs_empty_inner():
    runs = contiguous_runs(B((0, 0), (4, 4)), B((2, 0), (0, 4)))
    assert runs.count == 0 and runs.length == 0 and runs.span == 0
    assert runs.start == 8


def test_contiguous_runs_rejects_outside():
    with pytest.raises(ValueError, match="not inside"):
        contiguous_runs(B((0, 0), (4, 4)), B((3, 0), (2, 4)))


@st.composite
def box_and_subbox(draw, min_ndim=0):
    ndim = draw(st.integers(min_ndim, 4))
    sizes = [draw(st.integers(1, 5)) for _ in range(ndim)]
    offsets = [draw(st.integers(0, 3)) for _ in range(ndim)]
    outer = B(offsets, sizes)
    lo = [draw(st.integers(0, s - 1)) for s in sizes]
    sub = [draw(st.integers(1, s - a)) for s, a in zip(sizes, lo)]
    inner = B([o + a for o, a in zip(offsets, lo)], sub)
    return outer, inner


@settings(max_examples=200, deadline=None)
@given(box_and_subbox())
def test_contiguous_runs_property(case):
    outer, inner = case
    runs = contiguous_runs(outer, inner)
    got = positions(outer, inner)
    elems = run_elements(runs)
    # the runs cover every element, start at the first and span to the last
    assert set(got) <= set(elems)
    assert runs.start == got[0]
    assert runs.start + runs.span == got[-1] + 1
    assert runs.count >= 1 and runs.length >= 1
    if runs.count > 1:
        # evenly spaced runs are exact: no element outside the box, no overlap
        assert runs.stride >= runs.length
        assert sorted(elems) == got
    if len(elems) == len(got):
        assert sorted(elems) == got


# ---------------------------------------------------------------------------
# split_box


def check_split(box: Box, itemsize: int, max_bytes: int) -> list[Box]:
    pieces = split_box(box, itemsize, max_bytes)
    # pieces tile the box exactly
    rel = [p.relative_to(box) for p in pieces]
    assert find_coverage_problem(box.sizes, rel) is None
    assert sum(p.volume for p in pieces) == box.volume
    # each piece is row-major contiguous inside the box, and the pieces follow each
    # other in row-major order (so a writer streams the local tensor front to back)
    pos = 0
    for p in pieces:
        assert box.contains(p)
        assert p.volume * itemsize <= max_bytes
        if not p.volume:
            continue
        runs = contiguous_runs(box, p)
        assert runs.count == 1 and runs.length == p.volume
        assert runs.start == pos
        pos += p.volume
    return pieces


@pytest.mark.parametrize(
    "box, itemsize, max_bytes, expected",
    [
        # fits: unchanged
        (B((0, 0), (10, 4)), 4, 160, [B((0, 0), (10, 4))]),
        # 3 rows of 16 bytes per piece, last piece is the remainder
        (
            B((0, 0), (10, 4)),
            4,
            48,
            [B((0, 0), (3, 4)), B((3, 0), (3, 4)), B((6, 0), (3, 4)), B((9, 0), (1, 4))],
        ),
        # offsets of the box are kept
        (B((5, 2), (4, 2)), 4, 20, [B((5, 2), (2, 2)), B((7, 2), (2, 2))]),
        # one row alone is too big: rows are split into column pieces
        (
            B((0, 0), (2, 5)),
            4,
            12,
            [B((0, 0), (1, 3)), B((0, 3), (1, 2)), B((1, 0), (1, 3)), B((1, 3), (1, 2))],
        ),
        # leading size-1 dims are skipped
        (B((3, 0, 0), (1, 4, 2)), 1, 4, [B((3, 0, 0), (1, 2, 2)), B((3, 2, 0), (1, 2, 2))]),
        # 0-dim and empty boxes are never split
        (Box((), ()), 8, 1, [Box((), ())]),
        (B((0, 0), (0, 100)), 4, 4, [B((0, 0), (0, 100))]),
        # a single element larger than the limit cannot be split
        (B((0, 0), (1, 1)), 8, 4, [B((0, 0), (1, 1))]),
    ],
)
def test_split_box(box, itemsize, max_bytes, expected):
    assert split_box(box, itemsize, max_bytes) == expected
    if max_bytes >= itemsize:
        check_split(box, itemsize, max_bytes)


@settings(max_examples=200, deadline=None)
@given(box_and_subbox(min_ndim=1), st.sampled_from([1, 2, 4, 8]), st.integers(0, 200))
def test_split_box_property(case, itemsize, extra):
    _, box = case
    check_split(box, itemsize, itemsize + extra)


# ---------------------------------------------------------------------------
# find_coverage_problem


def dim0(shape, rows):
    out, lo = [], 0
    for r in rows:
        out.append(B((lo,) + (0,) * (len(shape) - 1), (r,) + tuple(shape[1:])))
        lo += r
    return out


@pytest.mark.parametrize(
    "shape, boxes",
    [
        ((10, 4), dim0((10, 4), [3, 3, 3, 1])),
        ((10, 4), list(reversed(dim0((10, 4), [3, 3, 3, 1])))),
        ((10,), dim0((10,), [10])),
        # 2x2 grid (Shard(0) x Shard(1))
        ((4, 6), [B((0, 0), (2, 3)), B((0, 3), (2, 3)), B((2, 0), (2, 3)), B((2, 3), (2, 3))]),
        # column blocks (Shard(1))
        ((4, 6), [B((0, 0), (4, 2)), B((0, 2), (4, 4))]),
        # irregular tiling
        ((3, 3), [B((0, 0), (1, 3)), B((1, 0), (2, 1)), B((1, 1), (2, 2))]),
        # empty boxes are ignored, even with offsets past the end
        ((10, 4), dim0((10, 4), [4, 0, 6]) + [B((10, 0), (0, 4)), B((50, 50), (0, 0))]),
        # empty tensor: nothing to cover
        ((0, 4), []),
        ((0, 4), [B((0, 0), (0, 4))]),
        # 0-dim tensor with one chunk
        ((), [Box((), ())]),
    ],
)
def test_coverage_ok(shape, boxes):
    assert find_coverage_problem(shape, boxes) is None


@pytest.mark.parametrize(
    "shape, boxes, fragments",
    [
        # dim-0 slabs that overlap
        ((10, 4), dim0((10, 4), [5, 5])[:1] + [B((4, 0), (6, 4))], ["overlap", "offsets=[4, 0] sizes=[6, 4]"]),
        # same slab twice
        ((10, 4), dim0((10, 4), [5, 5]) + [B((5, 0), (5, 4))], ["overlap", "offsets=[5, 0] sizes=[5, 4]"]),
        # grid boxes overlapping in the middle
        (
            (4, 4),
            [B((0, 0), (2, 2)), B((1, 1), (2, 2)), B((0, 2), (4, 2)), B((2, 0), (2, 2))],
            ["overlap", "offsets=[1, 1] sizes=[2, 2]"],
        ),
        # gap between dim-0 slabs
        ((10, 4), [B((0, 0), (3, 4)), B((5, 0), (5, 4))], ["cover 32 of 40 elements", "gap"]),
        # a missing grid cell
        ((4, 6), [B((0, 0), (2, 3)), B((0, 3), (2, 3)), B((2, 0), (2, 3))], ["cover 18 of 24", "gap"]),
        # nothing covers a non-empty tensor
        ((3,), [], ["cover 0 of 3", "gap"]),
        ((), [], ["cover 0 of 1", "gap"]),
        # out of bounds
        ((10, 4), dim0((10, 4), [8]) + [B((8, 0), (3, 4))], ["offsets=[8, 0] sizes=[3, 4]", "outside", "(10, 4)"]),
        ((10, 4), [B((0, 1), (10, 4))], ["outside"]),
        # wrong rank
        ((10, 4), [B((0,), (40,))], ["outside"]),
    ],
)
def test_coverage_problem(shape, boxes, fragments):
    problem = find_coverage_problem(shape, boxes)
    assert problem is not None
    for f in fragments:
        assert f in problem


def test_coverage_overlap_beats_equal_volume():
    # an overlap plus a gap of the same size: the volumes add up, the overlap is named
    boxes = [B((0, 0), (2, 2)), B((1, 0), (2, 2)), B((0, 2), (4, 2))]
    assert sum(b.volume for b in boxes) == 16
    problem = find_coverage_problem((4, 4), boxes)
    assert problem is not None and "overlap" in problem
    problem = find_coverage_problem((3, 4), [B((0, 0), (2, 4)), B((1, 0), (1, 4))])
    assert problem is not None and "overlap" in problem


def test_coverage_0dim_two_chunks_overlap():
    problem = find_coverage_problem((), [Box((), ()), Box((), ())])
    assert problem is not None and "overlap" in problem


@st.composite
def grid(draw, shape):
    """A random grid partition of ``shape`` into boxes."""
    cuts = []
    for n in shape:
        inner = draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=3)) if n > 1 else []
        pts = sorted(set(inner) | {0, n})
        cuts.append(list(zip(pts, pts[1:])) or [(0, 0)])
    return [B([a for a, _ in cell], [b - a for a, b in cell]) for cell in itertools.product(*cuts)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=3).flatmap(lambda s: st.tuples(st.just(s), grid(s))))
def test_coverage_property(case):
    shape, boxes = case
    assert find_coverage_problem(shape, boxes) is None
    nonempty = [b for b in boxes if b.volume]
    if nonempty:
        # dropping a box leaves a gap; duplicating one makes an overlap
        assert "gap" in find_coverage_problem(shape, nonempty[1:])
        assert "overlap" in find_coverage_problem(shape, boxes + [nonempty[-1]])
