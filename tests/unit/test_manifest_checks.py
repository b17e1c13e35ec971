"""Manifest validation on columns: ``ChunkColumns`` and the vectorized ``find_manifest_problems``.

The reference is the per-chunk implementation the vectorized one replaced
(``reference_problems`` below, kept verbatim): every message and its order must
be the same, on hand-picked cases and on random small manifests.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayckpt.errors import CorruptCheckpointError, SaveFailedError
from rayckpt.format import manifest_checks
from rayckpt.format.boxes import Box, find_coverage_problem
from rayckpt.format.chunk_columns import ChunkColumns
from rayckpt.format.manifest import DTYPES, ChunkEntry, FileEntry, Manifest, TensorEntry, ValueEntry
from rayckpt.format.manifest_checks import find_manifest_problems
from rayckpt.format.manifest_files import encode_manifest_files
from rayckpt.format.shard_file import WrittenChunk
from rayckpt.planning.chunk_table import ChunkTable
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import SaveSpec, WrittenShard, create_manifest, read_manifest


def reference_problems(m: Manifest) -> list[str]:
    """``find_manifest_problems`` before it ran on columns (a message per check, chunk by chunk)."""
    problems: list[str] = []
    sizes = {f.path: f.size for f in m.files}
    for key, e in m.entries.items():
        if not isinstance(e, TensorEntry):
            continue
        if e.dtype not in DTYPES:
            problems.append(f"key {key!r}: unknown dtype {e.dtype!r}")
            continue
        isz = DTYPES[e.dtype][0]
        for c in e.chunks:
            where = f"key {key!r} chunk {list(c.box.offsets)} in file {c.file!r}"
            if c.byte_offset < 0:
                problems.append(f"{where}: negative byte_offset {c.byte_offset}")
            if c.byte_length != c.box.volume * isz:
                problems.append(f"{where}: byte_length {c.byte_length} != {c.box.volume} elements x {isz} bytes")
            if c.byte_offset + c.byte_length > sizes.get(c.file, 0):
                problems.append(
                    f"{where}: bytes [{c.byte_offset}, {c.byte_offset + c.byte_length}) lie past the "
                    f"file's recorded size {sizes.get(c.file, 0)}"
                )
            want = -(-c.byte_length // m.block_size) if c.byte_length else 0
            if len(c.checksums) != want:
                problems.append(f"{where}: {len(c.checksums)} checksums for {want} blocks")
        problem = find_coverage_problem(e.shape, (c.box for c in e.chunks))
        if problem:
            problems.append(f"key {key!r}: {problem}")
    return problems


BLOCK = 16


def B(offsets, sizes) -> Box:
    return Box(tuple(offsets), tuple(sizes))


def build(tensors: dict, block_size: int = BLOCK, sizes: dict | None = None, values: bool = True) -> Manifest:
    """``tensors``: key -> (dtype, shape, boxes or chunk dicts); each chunk right unless a dict overrides a field."""
    pos: dict[str, int] = {"a.arrow": 0, "b.arrow": 0}
    entries: dict = {}
    for i, (key, (dtype, shape, chunks)) in enumerate(tensors.items()):
        out = []
        for j, c in enumerate(chunks):
            c = dict(c) if isinstance(c, dict) else {"box": c}
            file = c.get("file", "ab"[(i + j) % 2] + ".arrow")
            n = c["box"].volume * DTYPES.get(dtype, (4,))[0]
            length = c.get("byte_length", n)
            offset = c.get("byte_offset", pos.get(file, 0))
            pos[file] = max(pos.get(file, 0), offset + length)
            sums = c["checksums"] if "checksums" in c else (7,) * -(-length // block_size)
            out.append(ChunkEntry(box=c["box"], file=file, byte_offset=offset, byte_length=length, checksums=sums))
        entries[key] = TensorEntry(dtype, tuple(shape), tuple(out))
        if values:
            entries[f"{key}.note"] = ValueEntry(i)
    sizes = {**{f: n for f, n in pos.items() if f in ("a.arrow", "b.arrow")}, **(sizes or {})}
    files = tuple(FileEntry(f, n, r) for r, (f, n) in enumerate(sorted(sizes.items())))
    return Manifest(save_id="s", world_size=2, block_size=block_size, entries=entries, files=files)


def same_as_reference(m: Manifest) -> list[str]:
    """The problems of ``m``, checked equal to the reference's: in one batch, in batches of 2 chunks
    (keys split over batches, a larger key alone), and from given columns (sliced per batch)."""
    want = reference_problems(m)
    assert find_manifest_problems(m) == want
    try:
        cols = ChunkColumns.from_manifest(m)
    except OverflowError:
        cols = None
    saved = manifest_checks.BATCH_CHUNKS
    manifest_checks.BATCH_CHUNKS = 2
    try:
        assert find_manifest_problems(m) == want
        if cols is not None:
            assert find_manifest_problems(m, cols) == want
    finally:
        manifest_checks.BATCH_CHUNKS = saved
    if cols is not None:
        assert find_manifest_problems(m, cols) == want
    return want


@pytest.fixture
def columns_only(monkeypatch):
    """Fail if a check falls back to the ChunkEntry objects; count the per-key coverage fallbacks."""
    calls = []

    def no_objects(*args):  # pragma: no cover - a failure
        raise AssertionError("the object path ran")

    def counted(shape, boxes):
        calls.append(tuple(shape))
        return find_coverage_problem(shape, boxes)

    monkeypatch.setattr(manifest_checks, "_object_problems", no_objects)
    monkeypatch.setattr(manifest_checks, "find_coverage_problem", counted)
    return calls


def slabs(shape, cuts, axis=0):
    edges = [0, *cuts, shape[axis]]
    out = []
    for lo, hi in zip(edges, edges[1:]):
        offsets = [0] * len(shape)
        sizes = list(shape)
        offsets[axis], sizes[axis] = lo, hi - lo
        out.append(B(offsets, sizes))
    return out


# ---------------------------------------------------------------------------
# Each problem through the columns, exact text


def test_good_layouts_are_decided_on_columns_without_the_fallback(columns_only):
    m = build(
        {
            "rows": ("float32", (6, 4), slabs((6, 4), [2, 3])),
            "cols": ("bfloat16", (3, 8), slabs((3, 8), [5], axis=1)),
            "deep": ("int64", (2, 3, 4), slabs((2, 3, 4), [1], axis=2)),
            "whole": ("bool", (3, 2, 2), [Box.full((3, 2, 2))]),
            "scalar": ("int64", (), [Box((), ())]),
            "empty": ("float32", (0, 4), []),
            "empty with a chunk": ("float32", (5, 0), [B((0, 0), (5, 0))]),
            "with an empty chunk": ("float32", (4,), [B((0,), (4,)), B((9,), (0,))]),
            "unsorted": ("float32", (6,), [B((3,), (3,)), B((0,), (3,))]),
        }
    )
    assert find_manifest_problems(m) == [] == reference_problems(m)
    assert columns_only == []


def test_each_chunk_problem_has_the_reference_text(columns_only):
    w = slabs((6, 4), [3])
    m = build(
        {
            "w": (
                "float32",
                (6, 4),
                [
                    {"box": w[0], "byte_offset": -16, "checksums": (1, 2)},
                    {"box": w[1], "byte_length": 40, "checksums": (1,)},
                ],
            ),
            "past": ("float32", (2,), [{"box": B((0,), (2,)), "byte_offset": 1000}]),
            "ghost": ("float32", (2,), [{"box": B((0,), (2,)), "file": "ghost.arrow", "byte_offset": 0}]),
            "bad": ("float128", (2,), [B((0,), (2,))]),
        },
        sizes={"a.arrow": 200, "b.arrow": 200},
    )
    assert same_as_reference(m) == [
        "key 'w' chunk [0, 0] in file 'a.arrow': negative byte_offset -16",
        "key 'w' chunk [0, 0] in file 'a.arrow': 2 checksums for 3 blocks",
        "key 'w' chunk [3, 0] in file 'b.arrow': byte_length 40 != 12 elements x 4 bytes",
        "key 'w' chunk [3, 0] in file 'b.arrow': 1 checksums for 3 blocks",
        "key 'past' chunk [0] in file 'b.arrow': bytes [1000, 1008) lie past the file's recorded size 200",
        "key 'ghost' chunk [0] in file 'ghost.arrow': bytes [0, 8) lie past the file's recorded size 0",
        "key 'bad': unknown dtype 'float128'",
    ]
    assert columns_only == []


def test_coverage_problems_go_to_the_fallback_in_key_order(columns_only):
    grid = [B((0, 0), (2, 2)), B((0, 2), (2, 2)), B((2, 0), (2, 2)), B((2, 2), (2, 2))]
    m = build(
        {
            "gap": ("float32", (6, 4), slabs((6, 4), [3])[:1]),
            "good": ("float32", (6,), slabs((6,), [1, 2])),
            "overlap": ("float32", (6, 4), [B((0, 0), (3, 4)), {"box": B((2, 0), (4, 4)), "checksums": ()}]),
            "grid": ("float32", (4, 4), grid),
            "grid overlap": ("float32", (4, 4), [*grid[:3], B((1, 1), (3, 3))]),
            "outside": ("float32", (4,), [B((0,), (4,)), B((3,), (2,))]),
            "rank": ("float32", (4,), [B((0, 0), (4, 1))]),
            "two scalars": ("int64", (), [Box((), ()), Box((), ())]),
            "no scalar": ("int64", (), []),
            "whole and more": ("float32", (2, 2), [B((0, 0), (2, 2)), B((0, 0), (1, 2))]),
            "two axes": ("float32", (2, 2), [B((0, 0), (1, 2)), B((1, 0), (1, 1)), B((1, 1), (1, 1))]),
            "mixed axes": ("float32", (2, 2), [B((0, 0), (1, 2)), B((0, 1), (2, 1))]),
        }
    )
    assert same_as_reference(m) == [
        "key 'gap': chunks cover 12 of 24 elements: a gap",
        "key 'overlap' chunk [2, 0] in file 'b.arrow': 0 checksums for 4 blocks",
        "key 'overlap': chunks offsets=[0, 0] sizes=[3, 4] and offsets=[2, 0] sizes=[4, 4] overlap",
        "key 'grid overlap': chunks offsets=[0, 0] sizes=[2, 2] and offsets=[1, 1] sizes=[3, 3] overlap",
        "key 'outside': chunk offsets=[3] sizes=[2] lies outside the tensor of shape (4,)",
        "key 'rank': chunk offsets=[0, 0] sizes=[4, 1] lies outside the tensor of shape (4,)",
        "key 'two scalars': 2 chunks of a 0-dim tensor overlap",
        "key 'no scalar': chunks cover 0 of 1 elements: a gap",
        "key 'whole and more': chunks offsets=[0, 0] sizes=[2, 2] and offsets=[0, 0] sizes=[1, 2] overlap",
        "key 'mixed axes': chunks offsets=[0, 0] sizes=[1, 2] and offsets=[0, 1] sizes=[2, 1] overlap",
    ]
    # Only the keys the screen could not decide went to find_coverage_problem: never "good".
    columns_only.clear()
    find_manifest_problems(m)
    assert (6,) not in columns_only and len(columns_only) == 11


def test_numbers_past_int64_take_the_object_path_with_the_same_text():
    m = build({"w": ("float32", (4,), [{"box": B((0,), (4,)), "byte_offset": 2**63}])}, sizes={"a.arrow": 0})
    with pytest.raises(OverflowError):
        ChunkColumns.from_manifest(m)
    assert same_as_reference(m) == [
        f"key 'w' chunk [0] in file 'a.arrow': bytes [{2**63}, {2**63 + 16}) lie past the file's recorded size 0"
    ]
    huge = build({"w": ("float32", (4,), [B((0,), (4,))]), "v": ("float32", (2**64,), [])})
    assert same_as_reference(huge) == [f"key 'v': chunks cover 0 of {2**64} elements: a gap"]


def test_numbers_that_could_wrap_int64_are_checked_exactly(columns_only):
    # Each value fits int64, but their sum or product would not: Python ints decide these chunks.
    big, none = 2**62 + 8, {"checksums": ()}
    m = build(
        {
            "sum": ("float32", (4,), [{"box": B((0,), (4,)), "byte_offset": 2**63 - 8}]),
            "product": ("float64", (2**61, 4), [{"box": B((0, 0), (2**61, 4)), "byte_offset": 0, "byte_length": 0}]),
            "length": ("float32", (4,), [{"box": B((0,), (4,)), "byte_offset": 0, "byte_length": big, **none}]),
        },
        sizes={"a.arrow": 2**63 - 1, "b.arrow": 2**63 - 1},
    )
    problems = same_as_reference(m)
    assert len(problems) == 4 and "elements x 8 bytes" in problems[1]


def test_batches_of_keys_hold_at_most_the_limit_a_larger_key_alone():
    assert manifest_checks._batches([3, 0, 1, 5, 1], 4) == [(0, 3), (3, 4), (4, 5)]
    assert manifest_checks._batches([1, 1, 1], 4) == [(0, 3)]
    assert manifest_checks._batches([], 4) == []


def test_a_block_size_past_int64_arithmetic_checks_every_chunk_exactly(columns_only):
    w = [*slabs((6, 4), [3])[:1], {"box": B((3, 0), (3, 4)), "checksums": ()}]
    m = build({"w": ("float32", (6, 4), w)}, block_size=2**62)
    assert same_as_reference(m) == ["key 'w' chunk [3, 0] in file 'b.arrow': 0 checksums for 1 blocks"]


# ---------------------------------------------------------------------------
# Random small manifests: the same problems, in the same order, as the reference


@st.composite
def tilings(draw, shape):
    """Boxes that tile ``shape``: a grid of cuts per dim (one box, slabs or a true grid)."""
    if not shape:
        return [Box((), ())]
    edges = []
    for n in shape:
        cuts = draw(st.sets(st.integers(1, n - 1), max_size=3)) if n > 1 else set()
        edges.append([0, *sorted(cuts), n])
    boxes = [B((), ())]
    for e in edges:
        boxes = [B((*b.offsets, lo), (*b.sizes, hi - lo)) for b in boxes for lo, hi in zip(e, e[1:])]
    return boxes


@st.composite
def damaged(draw, shape):
    boxes = draw(tilings(shape))
    for _ in range(draw(st.integers(0, 2))):
        how = draw(st.sampled_from(["drop", "dup", "shift", "resize", "empty", "rank", "shuffle", "nothing"]))
        i = draw(st.integers(0, max(0, len(boxes) - 1)))
        if how == "drop" and boxes:
            del boxes[i]
        elif how == "dup" and boxes:
            boxes.insert(draw(st.integers(0, len(boxes))), boxes[i])
        elif how in ("shift", "resize") and boxes and shape:
            d = draw(st.integers(0, len(shape) - 1))
            b = boxes[i]
            lst = list(b.offsets if how == "shift" else b.sizes)
            lst[d] = max(0, lst[d] + draw(st.sampled_from([-1, 1, 2])))
            boxes[i] = B(lst, b.sizes) if how == "shift" else B(b.offsets, lst)
        elif how == "empty":
            boxes.insert(i, B([draw(st.integers(0, 9)) for _ in shape[:-1]] + [0], [1] * max(0, len(shape) - 1) + [0]))
        elif how == "rank":
            boxes.insert(i, B([0] * (len(shape) + 1), [1] * (len(shape) + 1)))
        elif how == "shuffle":
            boxes = draw(st.permutations(boxes))
    return boxes


@st.composite
def manifests(draw):
    tensors = {}
    for k in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(["float32", "int64", "bool", "bfloat16", "float128"]))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        chunks = []
        for box in draw(damaged(shape)):
            c: dict = {"box": box}
            fault = draw(st.sampled_from([None] * 6 + ["byte_offset", "byte_length", "checksums", "file"]))
            if fault == "byte_offset":
                c["byte_offset"] = draw(st.integers(-20, 300))
            elif fault == "byte_length":
                c["byte_length"] = draw(st.integers(-20, 300))
            elif fault == "checksums":
                c["checksums"] = (1,) * draw(st.integers(0, 4))
            elif fault == "file":
                c["file"] = "ghost.arrow"
            chunks.append(c)
        tensors[f"k{k}"] = (dtype, shape, chunks)
    block_size = draw(st.integers(1, 40))
    shrink = draw(st.sampled_from([{}, {"a.arrow": 8}, {"b.arrow": 0}]))
    return build(tensors, block_size=block_size, sizes=shrink, values=draw(st.booleans()))


@settings(max_examples=250, deadline=None, derandomize=True)
@given(m=manifests())
def test_random_manifests_have_the_reference_problems(m):
    same_as_reference(m)


# ---------------------------------------------------------------------------
# The columns, and the ChunkTable built from them


def test_columns_of_a_manifest():
    m = build(
        {
            "w": ("float32", (4, 2), [B((0, 0), (2, 2)), {"box": B((2, 0), (2, 2)), "file": "ghost.arrow"}]),
            "s": ("int64", (), [{"box": Box((), ()), "file": "b.arrow"}]),
            "x": ("float128", (3,), []),
        }
    )
    cols = ChunkColumns.from_manifest(m)
    assert cols.keys == ("w", "s", "x") and cols.dtypes == ("float32", "int64", "float128")
    assert cols.shapes == ((4, 2), (), (3,))
    assert cols.files == ("a.arrow", "b.arrow", "ghost.arrow")  # the listed files, then the others
    assert cols.counts.tolist() == [2, 1, 0] and cols.key.tolist() == [0, 0, 1] and cols.first.tolist() == [0, 2, 3]
    assert cols.file.tolist() == [0, 2, 1]
    assert cols.byte_offset.tolist() == [0, 0, 0] and cols.byte_length.tolist() == [16, 16, 8]
    assert cols.num_checksums.tolist() == [1, 1, 1]
    assert cols.ndim.tolist() == [2, 2, 0] and cols.flat_first.tolist() == [0, 2, 4]
    assert cols.offsets.tolist() == [0, 0, 2, 0] and cols.sizes.tolist() == [2, 2, 2, 2]
    assert cols.key_ndim.tolist() == [2, 0, 1] and cols.key_shape.tolist() == [4, 2, 3]
    assert cols.key_itemsize.tolist() == [4, 8, 0]
    assert cols.box(1) == ([2, 0], [2, 2]) and cols.box(2) == ([], [])
    volume, approx = cols.volumes()
    assert volume.tolist() == [4, 4, 1] and approx.tolist() == [4.0, 4.0, 1.0]


def test_the_chunk_table_is_built_from_given_columns():
    m = build(
        {
            "w": ("float32", (6, 4), slabs((6, 4), [2, 3])),
            "c": ("float32", (3, 8), slabs((3, 8), [5], axis=1)),
            "s": ("int64", (), [Box((), ())]),
        }
    )
    cols = ChunkColumns.from_manifest(m)
    a, b = ChunkTable.from_manifest(m), ChunkTable.from_manifest(m, columns=cols)
    assert a.keys == b.keys == ("w", "c", "s") and a.files == b.files == ("a.arrow", "b.arrow")
    for name in ("key_kind", "key_rows", "key_row_bytes", "key_first", "key", "index", "file", "start", "rows"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.key_kind.tolist() == [0, 2, 1]  # DIM0, OTHER, SCALAR


# ---------------------------------------------------------------------------
# The callers: a save refuses, a read says how many problems, both show the first 20 in order


def test_create_and_read_report_problems_in_order_capped_at_20(tmp_path):
    shape = (30, 2)
    boxes = slabs(shape, list(range(1, 30)))
    good = build({"w": ("float32", shape, boxes)})
    bad = build({"w": ("float32", shape, [{"box": b, "checksums": ()} for b in boxes])})
    expected = [f"key 'w' chunk [{i}, 0] in file '{'ab'[i % 2]}.arrow': 0 checksums for 1 blocks" for i in range(30)]
    assert find_manifest_problems(bad) == expected

    spec = SaveSpec(save_id="s", world_size=2, block_size=BLOCK, tensors={"w": ("float32", shape)}, values={})
    shards = [
        WrittenShard(
            r,
            tuple(
                WrittenChunk(
                    key="w", box=c.box, file=c.file, byte_offset=c.byte_offset, byte_length=c.byte_length, checksums=()
                )
                for c in cs
            ),
            files,
        )
        for r, cs, files in (
            (0, bad.tensor("w").chunks[0::2], bad.files[:1]),
            (1, bad.tensor("w").chunks[1::2], bad.files[1:]),
        )
    ]
    with pytest.raises(SaveFailedError) as info:
        create_manifest(spec, shards)
    assert str(info.value) == "refusing to commit an inconsistent checkpoint:\n  " + "\n  ".join(expected[:20])

    ckdir = CheckpointDir.resolve(str(tmp_path))
    ckdir.makedirs()
    for name, data in encode_manifest_files(good):
        ckdir.write_atomic(name, data)
    assert read_manifest(ckdir) == good
    for name, data in encode_manifest_files(bad):
        ckdir.write_atomic(name, data)
    with pytest.raises(CorruptCheckpointError) as info:
        read_manifest(ckdir)
    where = f"{tmp_path}/manifest.json"
    assert str(info.value) == f"{where}: inconsistent manifest (30 problem(s)):\n  " + "\n  ".join(expected[:20])
    assert gc.isenabled()  # paused through decoding and validation, then back
    gc.disable()
    try:
        assert read_manifest(CheckpointDir.resolve(str(tmp_path / "none"))) is None
    except Exception:  # noqa: BLE001 - no manifest there: any error, the collector stays as it was
        assert not gc.isenabled()
    finally:
        gc.enable()
