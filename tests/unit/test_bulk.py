"""Pure unit tests for rayckpt.bulk_plan: every rank's bulk plan equals the per-item planner's.

Manifests are built like tests/test_planner.py builds them (``build``: chunks laid out
in fake files), from save plans of random N -> M reshards.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rayckpt.errors import IncompatibleStateError
from rayckpt.format.boxes import Box
from rayckpt.format.manifest import ChunkEntry, FileEntry, Manifest, TensorEntry, itemsize
from rayckpt.planning import bulk as bulk_plan
from rayckpt.planning.bulk import create_dim0_plans
from rayckpt.planning.chunk_table import DIM0, OTHER, SCALAR, ChunkTable
from rayckpt.planning.load_plan import TensorRequest, create_load_plan, dim0_boxes
from rayckpt.planning.rank_slice import create_rank_slices
from rayckpt.planning.save_columns import create_save_plans
from rayckpt.planning.save_plan import LocalShard
from tests.helpers.planning import Tensor, build


def requests_of(specs, world_size: int, rank: int) -> list[TensorRequest]:
    return [TensorRequest(k, dtype, shape, dim0_boxes(shape, world_size)[rank]) for k, dtype, shape in specs]


def assert_same_plans(m: Manifest, specs, world_size: int, value_keys=(), strict: bool = True):
    """``for_rank`` and the per-rank arrays agree with ``create_load_plan`` on every rank."""
    bulk = create_dim0_plans(m, specs, world_size, value_keys, strict)
    for r in range(world_size):
        plan = create_load_plan(m, requests_of(specs, world_size, r), value_keys, strict)
        assert bulk.for_rank(r) == plan, f"rank {r} of {world_size}"
        assert bulk.needed_bytes[r] == plan.needed_bytes
        assert bulk.read_bytes[r] == plan.read_bytes
        assert bulk.num_reads[r] == len(plan.reads)
        assert bulk.num_items[r] == sum(len(x.items) for x in plan.reads)
    # A load without Ray sends each rank its slice of the same plan: it builds the same LoadPlan.
    slices = create_rank_slices(m, specs, world_size, value_keys, strict)
    assert (slices is None) == (not bulk.all_dim0)
    for r, part in enumerate(slices or ()):
        assert part.plan([tuple(s) for s in specs]) == bulk.for_rank(r), f"slice of rank {r} of {world_size}"
    return bulk


def placed_by_save_plans(key: str, dtype: str, shape, boxes_by_rank, max_chunk: int = 2**31, one_file=False):
    """(chunk box, file) of each piece the save planner writes, file per writer or one file."""
    shards = [[LocalShard(key, dtype, shape, b)] for b in boxes_by_rank]
    plans = create_save_plans(shards, max_chunk_bytes=max_chunk)
    return [(i.box, "all.arrow" if one_file else f"r{p.rank}.arrow") for p in plans for i in p.items]


# ---------------------------------------------------------------------------
# Purity


def test_bulk_plan_imports_no_torch_or_ray():
    script = (
        "import sys, types\n"
        "pkg = types.ModuleType('rayckpt'); pkg.__path__ = [sys.argv[1]]; sys.modules['rayckpt'] = pkg\n"
        "import rayckpt.planning.bulk\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'pyarrow'))\n"
        "assert not heavy, heavy\n"
        "print('PURE')\n"
    )
    pkg_dir = os.path.dirname(os.path.dirname(bulk_plan.__file__))
    proc = subprocess.run([sys.executable, "-c", script, pkg_dir], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "PURE"


# ---------------------------------------------------------------------------
# Exact plans


def test_4_to_3_exact_reads():
    # (10, 4) float32 saved by 4 ranks (rows 3, 3, 3, 1), 16 bytes a row, 2 rows a block
    shape = (10, 4)
    placed = [(b, f"shard-{r}.arrow") for r, b in enumerate(dim0_boxes(shape, 4))]
    m, _ = build({"w": Tensor("float32", shape, placed)}, 32)
    bulk = assert_same_plans(m, [("w", "float32", shape)], 3)
    assert [(r.file, r.offset, r.length) for r in bulk.for_rank(1).reads] == [
        ("shard-1.arrow", 64, 48),
        ("shard-2.arrow", 64, 32),
    ]
    assert bulk.needed_bytes.tolist() == [64, 64, 32]
    assert bulk.read_bytes.tolist() == [80, 80, 32]
    assert not bulk.per_item


def test_merges_across_keys_in_one_file():
    # two keys back to back in one file: a rank asking for both reads them at once
    a = placed_by_save_plans("a", "float32", (4, 2), dim0_boxes((4, 2), 2), one_file=True)
    b = placed_by_save_plans("b", "int64", (4,), dim0_boxes((4,), 2), one_file=True)
    m, _ = build({"a": Tensor("float32", (4, 2), a), "b": Tensor("int64", (4,), b)}, 8)
    bulk = assert_same_plans(m, [("b", "int64", (4,)), ("a", "float32", (4, 2))], 1)
    assert [(r.offset, r.length, [i.key for i in r.items]) for r in bulk.for_rank(0).reads] == [
        (64, 64, ["a", "a", "b", "b"])
    ]


def test_more_target_ranks_than_rows():
    shape = (3, 2)
    m, _ = build({"w": Tensor("float32", shape, placed_by_save_plans("w", "float32", shape, dim0_boxes(shape, 2)))}, 4)
    bulk = assert_same_plans(m, [("w", "float32", shape)], 5)
    assert bulk.num_reads.tolist() == [1, 1, 1, 0, 0]
    assert bulk.for_rank(4).reads == ()


def test_fallback_keys_grid_columns_and_0dim():
    grid = [Box((0, 0), (2, 3)), Box((0, 3), (2, 2)), Box((2, 0), (3, 3)), Box((2, 3), (3, 2))]
    columns = [Box((0, 0), (6, 1)), Box((0, 1), (6, 2))]
    t = {
        "grid": Tensor("float32", (5, 5), [(b, f"r{i % 2}.arrow") for i, b in enumerate(grid)]),
        "step": Tensor("int64", (), [(Box((), ()), "r0.arrow")]),
        "w": Tensor("bfloat16", (7, 3), placed_by_save_plans("w", "bfloat16", (7, 3), dim0_boxes((7, 3), 2))),
        "cols": Tensor("int64", (6, 3), [(b, f"r{i}.arrow") for i, b in enumerate(columns)]),
    }
    m, _ = build(t, 4, pad=3)
    table = ChunkTable.from_manifest(m)
    kinds = dict(zip(table.keys, table.key_kind.tolist()))
    assert kinds == {"grid": OTHER, "step": SCALAR, "w": DIM0, "cols": OTHER}
    specs = [("step", "int64", ()), ("w", "bfloat16", (7, 3)), ("cols", "int64", (6, 3)), ("grid", "float32", (5, 5))]
    for world_size in (1, 2, 3, 4, 7):
        bulk = assert_same_plans(m, specs, world_size)
        assert not bulk.per_item
    # every rank reads the 0-dim tensor
    for r in range(4):
        assert "step" in {i.key for read in bulk.for_rank(r).reads for i in read.items}


def test_unsorted_and_split_chunks():
    # chunks stored out of dim-0 order, and split at 2 rows (max_chunk_bytes) into more chunks
    shape = (9, 2)
    placed = placed_by_save_plans("w", "int64", shape, dim0_boxes(shape, 3), max_chunk=2 * 2 * 8)
    m, _ = build({"w": Tensor("int64", shape, placed[::-1])}, 16)
    assert len(m.tensor("w").chunks) == 6
    assert ChunkTable.from_manifest(m).key_kind.tolist() == [DIM0]
    assert_same_plans(m, [("w", "int64", shape)], 4)


@pytest.mark.parametrize("key_order", [True, False], ids=["files-in-key-order", "files-in-other-order"])
def test_table_rows_are_in_file_and_offset_order(key_order):
    # A writer lays a file out in key order (the manifest's): the table orders by file alone;
    # laid out otherwise, it sorts by offset too. Either way: (file, byte_offset) order.
    specs = [(k, "float32", (6, 2)) for k in ("a", "b", "c")]
    m, _ = build(
        {k: Tensor("float32", s, [(b, f"r{r}.arrow") for r, b in enumerate(dim0_boxes(s, 3))]) for k, _, s in specs}, 4
    )
    if not key_order:  # the manifest lists the keys in another order than the files hold them
        m = dataclasses.replace(m, entries=dict(reversed(m.entries.items())))
    t = ChunkTable.from_manifest(m)
    pairs = list(zip(t.file.tolist(), t.byte_offset.tolist()))
    assert pairs == sorted(pairs) and len(set(pairs)) == 9
    assert [m.tensor(t.keys[k]).chunks[j].byte_offset for k, j in zip(t.key, t.index)] == t.byte_offset.tolist()
    assert_same_plans(m, specs, 2)


def test_overlapping_bytes_use_the_per_item_planner():
    # two keys whose chunks alias the same bytes: not what rayckpt writes, still planned exactly
    box = Box((0, 0), (4, 2))
    chunk = ChunkEntry(box=box, file="f.arrow", byte_offset=0, byte_length=32, checksums=(0,))
    entries = {"a": TensorEntry("float32", (4, 2), (chunk,)), "b": TensorEntry("float32", (4, 2), (chunk,))}
    m = Manifest(save_id="t", world_size=1, block_size=64, entries=entries, files=(FileEntry("f.arrow", 32, 0),))
    bulk = assert_same_plans(m, [("a", "float32", (4, 2)), ("b", "float32", (4, 2))], 3)
    assert bulk.per_item


def hand_built(chunks_by_key: dict[str, tuple[str, tuple, list[Box]]], block_size: int = 8) -> Manifest:
    """Chunks back to back in one file, no checks: for manifests rayckpt never writes."""
    entries, pos = {}, 0
    for key, (dtype, shape, boxes) in chunks_by_key.items():
        chunks = []
        for b in boxes:
            n = b.volume * itemsize(dtype)
            chunks.append(
                ChunkEntry(box=b, file="f.arrow", byte_offset=pos, byte_length=n, checksums=(0,) * -(-n // block_size))
            )
            pos += n
        entries[key] = TensorEntry(dtype, shape, tuple(chunks))
    return Manifest(
        save_id="t", world_size=1, block_size=block_size, entries=entries, files=(FileEntry("f.arrow", pos, 0),)
    )


def test_overlapping_rows_are_planned_per_item():
    # dim-0 slabs that overlap (rows 0-3 and 2-5): ChunkIndex's bisect decides what is read
    m = hand_built({"w": ("float32", (6, 2), [Box((0, 0), (4, 2)), Box((2, 0), (4, 2))])})
    assert ChunkTable.from_manifest(m).key_kind.tolist() == [OTHER]
    for world_size in (1, 2, 3, 4):
        assert not assert_same_plans(m, [("w", "float32", (6, 2))], world_size).per_item


def test_0dim_key_with_a_1d_chunk_raises_like_the_planner():
    m = hand_built({"step": ("int64", (), [Box((0,), (1,))])})
    assert ChunkTable.from_manifest(m).key_kind.tolist() == [OTHER]
    with pytest.raises(Exception) as planner_error:
        create_load_plan(m, requests_of([("step", "int64", ())], 2, 0))
    with pytest.raises(type(planner_error.value)):
        create_dim0_plans(m, [("step", "int64", ())], 2)


def test_nothing_to_read():
    m, _ = build({}, 8, values={"step": 3})
    assert assert_same_plans(m, [], 3, value_keys=("step",)).for_rank(2).reads == ()
    # a tensor without chunks (a gap, malformed): nothing to read, the bytes still needed
    bulk = assert_same_plans(hand_built({"w": ("float32", (4, 2), [])}), [("w", "float32", (4, 2))], 3)
    assert bulk.num_reads.tolist() == [0, 0, 0] and bulk.needed_bytes.tolist() == [16, 16, 0]


def test_duplicate_specs_use_the_per_item_planner():
    shape = (6, 2)
    m, _ = build({"w": Tensor("float32", shape, placed_by_save_plans("w", "float32", shape, dim0_boxes(shape, 2)))}, 8)
    bulk = assert_same_plans(m, [("w", "float32", shape), ("w", "float32", shape)], 2)
    assert bulk.per_item


def test_table_from_another_manifest_and_rank_out_of_range():
    shape = (4,)
    m, _ = build({"w": Tensor("int64", shape, [(Box((0,), (4,)), "r0.arrow")])}, 8)
    other, _ = build({"w": Tensor("int64", shape, [(Box((0,), (4,)), "r0.arrow")])}, 8)
    with pytest.raises(ValueError, match="another manifest"):
        create_dim0_plans(m, [("w", "int64", shape)], 2, table=ChunkTable.from_manifest(other))
    bulk = create_dim0_plans(m, [("w", "int64", shape)], 2, table=ChunkTable.from_manifest(m))
    with pytest.raises(IndexError, match="rank 2"):
        bulk.for_rank(2)


# ---------------------------------------------------------------------------
# Validation: the same errors as the per-item planner


@pytest.fixture
def small():
    shape = (10, 4)
    placed = [(b, f"shard-{r}.arrow") for r, b in enumerate(dim0_boxes(shape, 2))]
    return build({"w": Tensor("float32", shape, placed)}, 16, values={"step": 7})[0]


@pytest.mark.parametrize(
    "specs, value_keys, fragments",
    [
        ([("w", "float32", (10, 4)), ("gone", "float32", (3,))], (), ["1 key(s)", "'gone'", "strict=False"]),
        ([("w", "float32", (10, 4))], ("extra",), ["1 key(s)", "'extra'"]),
        ([("w", "bfloat16", (10, 4))], (), ["'w'", "checkpoint dtype float32 != target dtype bfloat16"]),
        ([("w", "float32", (10, 5))], (), ["'w'", "checkpoint shape [10, 4] != target shape [10, 5]"]),
        ([("step", "int64", ())], (), ["'step': target is a tensor but the checkpoint holds a value"]),
    ],
)
def test_errors_match_the_planner(small, specs, value_keys, fragments):
    with pytest.raises(IncompatibleStateError) as bulk_error:
        create_dim0_plans(small, specs, 3, value_keys)
    with pytest.raises(IncompatibleStateError) as planner_error:
        create_load_plan(small, requests_of(specs, 3, 0), value_keys)
    assert str(bulk_error.value) == str(planner_error.value)
    for f in fragments:
        assert f in str(bulk_error.value)


def test_missing_not_strict(small):
    specs = [("gone", "float32", (3,)), ("w", "float32", (10, 4))]
    bulk = assert_same_plans(small, specs, 3, value_keys=("step", "extra"), strict=False)
    assert bulk.missing == ("gone", "extra")
    assert bulk.for_rank(2).missing == ("gone", "extra")
    assert bulk.needed_bytes.tolist() == [4 * 16, 4 * 16, 2 * 16]


# ---------------------------------------------------------------------------
# Property test: random N -> M dim-0 reshards


@st.composite
def saved_key(draw, key: str):
    ndim = draw(st.integers(1, 3))
    shape = (draw(st.integers(0, 12)),) + tuple(draw(st.sampled_from([1, 2, 3, 4, 0])) for _ in range(ndim - 1))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "int64"]))
    nsave = draw(st.integers(1, 9))
    rep = draw(st.integers(1, 2))  # HSDP-like replicas: each box held by `rep` ranks, written once
    boxes = dim0_boxes(shape, nsave) * rep
    # small chunk limits split chunks further (a 1-row slab splits along dim 1: not dim-0 any more)
    max_chunk = draw(st.sampled_from([2**31, 2**31, itemsize(dtype) * 8, itemsize(dtype) * 3]))
    return key, dtype, shape, boxes, max_chunk


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_bulk_equals_per_item_property(data):
    draw = data.draw
    names = draw(st.permutations(["a", "b", "c", "d"][: draw(st.integers(1, 4))]))
    saved = [draw(saved_key(k)) for k in names]
    one_file = draw(st.booleans())
    chunks = []
    for key, dtype, shape, boxes, max_chunk in saved:
        for box, file in placed_by_save_plans(key, dtype, shape, boxes, max_chunk, one_file):
            chunks.append((key, box, file))
    extras = draw(st.sets(st.sampled_from(["step", "grid"])))
    if "step" in extras:
        chunks.append(("step", Box((), ()), "r0.arrow"))
    if "grid" in extras:
        cells = [Box((0, 0), (3, 2)), Box((0, 2), (3, 1)), Box((3, 0), (2, 3))]
        chunks += [("grid", b, f"r{i}.arrow") for i, b in enumerate(cells)]
    chunks = draw(st.permutations(chunks))  # random layout in the files, random chunk order per key
    meta = {key: (dtype, shape) for key, dtype, shape, _, _ in saved}
    meta.update({"step": ("int64", ()), "grid": ("bfloat16", (5, 3))})
    keys = draw(st.permutations([k for k in names] + sorted(extras)))  # random manifest key order
    tensors = {k: Tensor(*meta[k], [(b, f) for key, b, f in chunks if key == k]) for k in keys}
    block_size = draw(st.sampled_from([1, 4, 64, 65536]))
    m, _ = build(tensors, block_size, pad=draw(st.integers(0, 5)), header=draw(st.integers(0, 16)))

    specs = [(k, *meta[k]) for k in draw(st.permutations(keys))]
    world_size = draw(st.integers(1, 9))
    bulk = assert_same_plans(m, specs, world_size)
    assert not bulk.per_item
    kinds = ChunkTable.from_manifest(m).key_kind.tolist()
    event(f"kinds {sorted(set(kinds))}")
    merged = any(len(r.items) > 1 for p in range(world_size) for r in bulk.for_rank(p).reads)
    event("reads merge items" if merged else "no read merges items")


# ---------------------------------------------------------------------------
# The benchmark, at a tiny size


def test_bench_plan_smoke(tmp_path, capsys):
    from benchmarks.micro.plan import main

    argv = ["--saved-ranks", "8", "--tensors", "10", "--target-ranks", "6", "--repeats", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    with open(tmp_path / "bench_plan.json") as f:
        report = json.load(f)
    res = report["results"]
    assert {"chunk_table", "bulk_plan", "for_rank"} <= set(res)
    for name in ("chunk_table", "bulk_plan", "for_rank"):
        assert set(res[name]["wall"]) >= {"median", "min", "max", "values"}
        assert res[name]["peak_extra_rss"] >= 0
    assert res["bulk_plan"]["items"] > 0 and not res["bulk_plan"]["per_item_path"]
    assert report["manifest"]["chunks"] == 80
    assert (tmp_path / "bench_plan.md").exists()
    assert "| create_dim0_plans, all 6 target ranks |" in capsys.readouterr().out
