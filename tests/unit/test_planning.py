"""Pure unit tests for rayckpt.planning (save_plan, load_plan): save plans, N -> M load plans with exact offsets.

Manifests are built by hand: chunks are laid out in fake files whose bytes hold each
element's global row-major index, so a simulated read shows exactly which elements a
plan moves where.
"""

from __future__ import annotations

import ast
import itertools
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import rayckpt
from rayckpt.errors import IncompatibleStateError, InvalidStateError
from rayckpt.format.boxes import Box, contiguous_runs, find_coverage_problem, row_major_strides
from rayckpt.format.manifest import Manifest, itemsize
from rayckpt.planning.load_plan import LoadPlan, TensorRequest, create_load_plan, create_load_plans, dim0_boxes
from rayckpt.planning.save_columns import create_save_plans
from rayckpt.planning.save_plan import LocalShard
from tests.helpers.planning import Tensor, build, value_at

PKG_DIR = os.path.dirname(rayckpt.__file__)


def B(offsets, sizes) -> Box:
    return Box(tuple(offsets), tuple(sizes))


def rows(lo: int, n: int, ncols: int = 4) -> Box:
    return B((lo, 0), (n, ncols))


# ---------------------------------------------------------------------------
# Purity: the planning modules import the standard library only.

PURITY_SCRIPT = r"""
import sys, types
pkg_dir = sys.argv[1]
before = set(sys.modules)
# A bare package: rayckpt/__init__.py (which imports torch) must not run.
pkg = types.ModuleType("rayckpt")
pkg.__path__ = [pkg_dir]
sys.modules["rayckpt"] = pkg
PURE = {"rayckpt.planning.load_plan", "rayckpt.planning.save_plan", "rayckpt.format.boxes", "rayckpt.format.manifest"}
for name in sorted(PURE):
    __import__(name)
loaded = sys.modules["rayckpt.planning.load_plan"].__file__
assert loaded.startswith(pkg_dir), loaded
new = set(sys.modules) - before
assert PURE | {"rayckpt.errors"} <= new, new
assert "rayckpt.engine" not in sys.modules
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "ray", "pyarrow", "numpy"))
assert not heavy, heavy
assert "torch.distributed" not in sys.modules
outside = sorted(
    m for m in new if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "rayckpt"
)
assert not outside, outside
print("PURE")
"""


def test_planning_modules_import_no_torch_ray_or_pyarrow():
    proc = subprocess.run(
        [sys.executable, "-c", PURITY_SCRIPT, PKG_DIR], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "PURE"


PURE_MODULES = (
    "format/boxes",
    "format/manifest",
    "format/file_paths",
    "format/manifest_schema",
    "format/paths",
    "format/values",
    "planning/load_plan",
    "planning/save_plan",
    "errors",
    "redaction",
)


#: Imports outside the standard library a pure module may make inside a function, on first use: the manifest's
#: schema check imports jsonschema only to name what is wrong with a document it refused.
LAZY = {"format/manifest_schema": {"jsonschema"}}


@pytest.mark.parametrize("module", PURE_MODULES)
def test_planning_modules_import_statements_are_stdlib(module):
    with open(os.path.join(PKG_DIR, f"{module}.py")) as f:
        tree = ast.parse(f.read())
    package = ["rayckpt", *module.split("/")[:-1]]
    allowed = {"rayckpt." + m.replace("/", ".") for m in PURE_MODULES}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                assert top in sys.stdlib_module_names or top in LAZY.get(module, ()), alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(package[: len(package) - node.level + 1] + [node.module])
                assert target in allowed, target
            else:
                assert node.module.split(".")[0] in sys.stdlib_module_names, node.module


# ---------------------------------------------------------------------------
# Save plans


def written(plans):
    """(key, piece box, writer rank) for every write item."""
    return sorted((i.key, i.box.offsets, i.box.sizes, p.rank) for p in plans for i in p.items)


def test_dim0_boxes_follow_torch_chunk():
    assert dim0_boxes((10, 4), 4) == [rows(0, 3), rows(3, 3), rows(6, 3), rows(9, 1)]
    assert dim0_boxes((10, 4), 3) == [rows(0, 4), rows(4, 4), rows(8, 2)]
    # more ranks than rows: trailing ranks get empty boxes
    assert dim0_boxes((3, 2), 5) == [rows(0, 1, 2), rows(1, 1, 2), rows(2, 1, 2), rows(3, 0, 2), rows(3, 0, 2)]
    # torch.chunk(6 rows, 4) gives 2, 2, 2 and nothing
    assert [b.sizes[0] for b in dim0_boxes((6,), 4)] == [2, 2, 2, 0]
    assert dim0_boxes((), 3) == [Box((), ())] * 3
    assert dim0_boxes((0, 5), 2) == [rows(0, 0, 5), rows(0, 0, 5)]


def test_save_replicated_tensor_written_once():
    full = Box.full((3, 4))
    shards = [[LocalShard("w", "float32", (3, 4), full), LocalShard("step", "int64", (), Box((), ()))]] * 4
    plans = create_save_plans(shards)
    assert [p.rank for p in plans] == [0, 1, 2, 3]
    items = [(p.rank, i) for p in plans for i in p.items]
    assert sorted(i.key for _, i in items) == ["step", "w"]
    for _, item in items:
        assert item.local == item.box
    # the two keys go to different ranks (least-loaded holder)
    assert len({r for r, _ in items}) == 2
    dtypes = {"w": "float32", "step": "int64"}
    assert sum(p.nbytes(dtypes) for p in plans) == 3 * 4 * 4 + 8


@pytest.mark.parametrize("nkeys, nranks", [(8, 4), (12, 4), (5, 3), (3, 8)])
def test_save_replicated_keys_balanced(nkeys, nranks):
    shards = [[LocalShard(f"k{i:02d}", "float32", (16,), Box.full((16,))) for i in range(nkeys)]] * nranks
    plans = create_save_plans(shards)
    keys = [i.key for p in plans for i in p.items]
    assert sorted(keys) == [f"k{i:02d}" for i in range(nkeys)]
    counts = [len(p.items) for p in plans]
    assert max(counts) - min(counts) <= 1
    assert max(counts) == -(-nkeys // nranks)


def test_save_balance_uneven_sizes():
    # greedy largest-first: the spread of bytes is at most the largest item
    sizes = [100, 90, 80, 70, 60, 50, 40, 30, 20, 10, 5, 1]
    shards = [[LocalShard(f"k{n}", "float32", (n,), Box.full((n,))) for n in sizes]] * 3
    plans = create_save_plans(shards)
    dtypes = {f"k{n}": "float32" for n in sizes}
    loads = [p.nbytes(dtypes) for p in plans]
    assert sum(loads) == 4 * sum(sizes)
    assert max(loads) - min(loads) <= 4 * max(sizes)
    assert len(written(plans)) == len(sizes)


def test_save_hsdp_dedups_to_one_writer_per_shard():
    # 4 ranks on a (replicate=2, shard=2) mesh: rank = rep * 2 + shard
    shape = (6, 4)
    keys = ["a", "b", "c"]
    boxes = dim0_boxes(shape, 2)
    shards = [[LocalShard(k, "float32", shape, boxes[r % 2]) for k in keys] for r in range(4)]
    plans = create_save_plans(shards)
    for k in keys:
        items = [(p.rank, i) for p in plans for i in p.items if i.key == k]
        assert len(items) == 2
        assert sorted(i.box.offsets for _, i in items) == [(0, 0), (3, 0)]
        for rank, item in items:
            # the writer holds that shard
            assert item.box == boxes[rank % 2]
            assert item.local == item.box
    # 6 equal items over 4 ranks: every rank writes something, nobody more than 2
    counts = [len(p.items) for p in plans]
    assert min(counts) >= 1 and max(counts) <= 2


def test_save_sharded_tensor_written_by_each_owner():
    shape = (10, 4)
    boxes = dim0_boxes(shape, 4)
    shards = [[LocalShard("w", "float32", shape, b)] for b in boxes]
    plans = create_save_plans(shards)
    assert [[i.box for i in p.items] for p in plans] == [[b] for b in boxes]


def test_save_empty_shards_write_nothing():
    shape = (2, 3)
    boxes = dim0_boxes(shape, 4)
    shards = [[LocalShard("w", "float32", shape, b)] for b in boxes]
    plans = create_save_plans(shards)
    assert [len(p.items) for p in plans] == [1, 1, 0, 0]


@pytest.mark.parametrize(
    "a, b, fragments",
    [
        (("float32", (4, 4)), ("bfloat16", (4, 4)), ["dtype float32", "dtype bfloat16"]),
        (("float32", (4, 4)), ("float32", (4, 5)), ["shape [4, 4]", "shape [4, 5]"]),
    ],
)
def test_save_disagreement_raises(a, b, fragments):
    shards = [
        [LocalShard("layer.w", a[0], a[1], Box.full(a[1]))],
        [LocalShard("layer.w", a[0], a[1], Box.full(a[1]))],
        [LocalShard("layer.w", b[0], b[1], Box.full(b[1]))],
    ]
    with pytest.raises(InvalidStateError) as info:
        create_save_plans(shards)
    msg = str(info.value)
    assert "'layer.w'" in msg
    assert "rank 0" in msg and "rank 2" in msg
    for f in fragments:
        assert f in msg


def test_save_splits_large_chunks():
    full = Box.full((10, 4))
    plans = create_save_plans([[LocalShard("w", "float32", (10, 4), full)], []], max_chunk_bytes=48)
    assert [i.box for i in plans[0].items] == [rows(0, 3), rows(3, 3), rows(6, 3), rows(9, 1)]
    assert all(i.local == full for i in plans[0].items)
    assert plans[1].items == ()
    # a row (16 bytes) is too big for 8: rows split into halves
    plans = create_save_plans([[LocalShard("w", "float32", (10, 4), full)]], max_chunk_bytes=8)
    pieces = [i.box for i in plans[0].items]
    assert len(pieces) == 20
    assert all(p.volume * 4 <= 8 for p in pieces)
    assert find_coverage_problem((10, 4), pieces) is None


# ---------------------------------------------------------------------------
# Hand-built manifests


def simulate(
    manifest: Manifest, files: dict[str, bytes], requests: list[TensorRequest], plan: LoadPlan, coalesce_gap: int = 0
) -> None:
    """Check a plan's invariants and carry it out on the fake files, element by element."""
    bs = manifest.block_size
    keys = {key: k for k, key in enumerate(manifest.entries)}
    by_key = {r.key: r for r in requests}
    assert plan.needed_bytes == sum(r.box.volume * itemsize(r.dtype) for r in requests if r.key in manifest.entries)
    # sorted by (file, offset), disjoint, and separated by more than the coalesce gap
    order = [(r.file, r.offset) for r in plan.reads]
    assert order == sorted(order)
    for a, b in zip(plan.reads, plan.reads[1:]):
        if a.file == b.file:
            assert b.offset > a.offset + a.length + coalesce_gap
    targets = {r.key: [None] * r.box.volume for r in requests}
    spill = 0
    for read in plan.reads:
        assert read.items and read.length > 0
        data = files[read.file][read.offset : read.offset + read.length]
        assert len(data) == read.length, "read past the end of the file"
        spans = []
        for item in read.items:
            c = item.chunk
            req = by_key[item.key]
            isz = itemsize(req.dtype)
            assert c in manifest.tensor(item.key).chunks
            assert c.file == read.file
            assert c.box.contains(item.box) and req.box.contains(item.box) and item.box.volume > 0
            assert 0 <= item.lo < item.hi <= c.byte_length
            assert read.offset <= c.byte_offset + item.lo
            assert c.byte_offset + item.hi <= read.offset + read.length
            # whole checksum blocks of the chunk, nothing past its end
            start = c.byte_offset + item.lo // bs * bs
            end = c.byte_offset + min(-(-item.hi // bs) * bs, c.byte_length)
            spans.append((start, end))
            spill += (end - start) - (item.hi - item.lo)
            # element by element through row-major strides
            cstrides = row_major_strides(c.box.sizes)
            tstrides = row_major_strides(req.box.sizes)
            got = []
            for idx in itertools.product(*(range(o, o + s) for o, s in zip(item.box.offsets, item.box.sizes))):
                pos = sum((i - o) * s for i, o, s in zip(idx, c.box.offsets, cstrides))
                assert item.lo <= pos * isz and (pos + 1) * isz <= item.hi
                at = c.byte_offset + pos * isz - read.offset
                v = int.from_bytes(data[at : at + isz], "little")
                got.append(v)
                t = sum((i - o) * s for i, o, s in zip(idx, req.box.offsets, tstrides))
                assert targets[item.key][t] is None, f"element {idx} of {item.key!r} filled twice"
                targets[item.key][t] = v
            # the same elements through contiguous_runs, as a run-copying reader would
            runs = contiguous_runs(c.box, item.box)
            assert (runs.start * isz, (runs.start + runs.span) * isz) == (item.lo, item.hi)
            if runs.count * runs.length == item.box.volume:
                via_runs = []
                for n in range(runs.count):
                    at = c.byte_offset + (runs.start + n * runs.stride) * isz - read.offset
                    run = data[at : at + runs.length * isz]
                    via_runs += [int.from_bytes(run[j : j + isz], "little") for j in range(0, len(run), isz)]
                assert via_runs == got
        # the read is exactly the union of its items' block-aligned spans
        spans.sort()
        assert spans[0][0] == read.offset
        assert max(e for _, e in spans) == read.offset + read.length
        if coalesce_gap == 0:
            reach = spans[0][1]
            for s, e in spans[1:]:
                assert s <= reach, "a read covers bytes no item needs"
                reach = max(reach, e)
    for r in requests:
        if r.key not in manifest.entries:
            continue
        shape_strides = row_major_strides(r.shape)
        want = [
            value_at(keys[r.key], sum(i * s for i, s in zip(idx, shape_strides)))
            for idx in itertools.product(*(range(o, o + s) for o, s in zip(r.box.offsets, r.box.sizes)))
        ]
        assert targets[r.key] == want, f"wrong data for {r.key!r}"
    assert plan.read_bytes >= plan.needed_bytes


def summary(plan: LoadPlan):
    return [(r.file, r.offset, r.length, [(i.box, i.lo, i.hi) for i in r.items]) for r in plan.reads]


def load_all(m, files, key, dtype, shape, boxes, **kw):
    plans = []
    for box in boxes:
        reqs = [TensorRequest(key, dtype, shape, box)]
        plan = create_load_plan(m, reqs, **kw)
        simulate(m, files, reqs, plan, kw.get("coalesce_gap", 0))
        plans.append(plan)
    return plans


# ---------------------------------------------------------------------------
# Load plans with exact offsets


def saved_10x4(block_size: int, one_file: bool = False, pad: int = 0):
    """(10, 4) float32 saved dim-0 by 4 ranks: rows 3, 3, 3, 1; 16 bytes a row."""
    placed = [(b, "all.arrow" if one_file else f"shard-{r}.arrow") for r, b in enumerate(dim0_boxes((10, 4), 4))]
    return build({"w": Tensor("float32", (10, 4), placed)}, block_size, pad=pad)


ITEMS_4_TO_3 = [
    [(rows(0, 3), 0, 48), (rows(3, 1), 0, 16)],
    [(rows(4, 2), 16, 48), (rows(6, 2), 0, 32)],
    [(rows(8, 1), 32, 48), (rows(9, 1), 0, 16)],
]


@pytest.mark.parametrize(
    "block_size, reads",
    [
        # one row per block: read exactly the needed rows
        (
            16,
            [
                [("shard-0.arrow", 64, 48), ("shard-1.arrow", 64, 16)],
                [("shard-1.arrow", 80, 32), ("shard-2.arrow", 64, 32)],
                [("shard-2.arrow", 96, 16), ("shard-3.arrow", 64, 16)],
            ],
        ),
        # two rows per block: partial blocks at the ends widen the reads
        (
            32,
            [
                [("shard-0.arrow", 64, 48), ("shard-1.arrow", 64, 32)],
                [("shard-1.arrow", 64, 48), ("shard-2.arrow", 64, 32)],
                [("shard-2.arrow", 96, 16), ("shard-3.arrow", 64, 16)],
            ],
        ),
        # blocks larger than a chunk: whole chunks, never past a chunk's end
        (
            4096,
            [
                [("shard-0.arrow", 64, 48), ("shard-1.arrow", 64, 48)],
                [("shard-1.arrow", 64, 48), ("shard-2.arrow", 64, 48)],
                [("shard-2.arrow", 64, 48), ("shard-3.arrow", 64, 16)],
            ],
        ),
    ],
)
def test_load_4_to_3_exact_offsets(block_size, reads):
    m, files = saved_10x4(block_size)
    targets = dim0_boxes((10, 4), 3)
    plans = load_all(m, files, "w", "float32", (10, 4), targets)
    for rank, plan in enumerate(plans):
        assert [(r.file, r.offset, r.length) for r in plan.reads] == reads[rank]
        assert [(i.box, i.lo, i.hi) for r in plan.reads for i in r.items] == ITEMS_4_TO_3[rank]
        assert plan.needed_bytes == targets[rank].volume * 4
        assert plan.files == tuple(sorted({f for f, _, _ in reads[rank]}))
    if block_size == 16:
        assert all(p.read_bytes == p.needed_bytes for p in plans)
    # the multi-rank entry point gives the same plans
    reqs = [[TensorRequest("w", "float32", (10, 4), b)] for b in targets]
    assert create_load_plans(m, reqs) == plans


def test_load_coalesces_adjacent_chunks_in_one_file():
    # chunks at 64, 112, 160, 208 of one file
    m, files = saved_10x4(16, one_file=True)
    assert [c.byte_offset for c in m.tensor("w").chunks] == [64, 112, 160, 208]
    plans = load_all(m, files, "w", "float32", (10, 4), dim0_boxes((10, 4), 3))
    assert [summary(p) for p in plans] == [
        [("all.arrow", 64, 64, ITEMS_4_TO_3[0])],
        [("all.arrow", 128, 64, ITEMS_4_TO_3[1])],
        [("all.arrow", 192, 32, ITEMS_4_TO_3[2])],
    ]
    # one rank loading everything reads the file's payload in one go
    (full,) = load_all(m, files, "w", "float32", (10, 4), [rows(0, 10)])
    assert [(r.file, r.offset, r.length, len(r.items)) for r in full.reads] == [("all.arrow", 64, 160, 4)]


def test_load_coalesce_gap():
    # 8 filler bytes between chunks: chunks at 64, 120, 176, 232
    m, files = saved_10x4(16, one_file=True, pad=8)
    assert [c.byte_offset for c in m.tensor("w").chunks] == [64, 120, 176, 232]
    target = [dim0_boxes((10, 4), 3)[0]]
    (apart,) = load_all(m, files, "w", "float32", (10, 4), target)
    assert [(r.offset, r.length) for r in apart.reads] == [(64, 48), (120, 16)]
    (apart7,) = load_all(m, files, "w", "float32", (10, 4), target, coalesce_gap=7)
    assert apart7 == apart
    (merged,) = load_all(m, files, "w", "float32", (10, 4), target, coalesce_gap=8)
    assert [(r.offset, r.length, len(r.items)) for r in merged.reads] == [(64, 72, 2)]
    assert merged.read_bytes == merged.needed_bytes + 8


def test_load_reads_sorted_by_file_and_offset():
    # chunks laid out in reverse row order, spread over two files, with filler between
    boxes = dim0_boxes((10, 4), 4)
    placed = [(boxes[3], "b.arrow"), (boxes[2], "a.arrow"), (boxes[1], "b.arrow"), (boxes[0], "a.arrow")]
    m, files = build({"w": Tensor("float32", (10, 4), placed)}, 16, pad=4)
    (plan,) = load_all(m, files, "w", "float32", (10, 4), [rows(0, 10)])
    assert summary(plan) == [
        ("a.arrow", 64, 48, [(rows(6, 3), 0, 48)]),
        ("a.arrow", 116, 48, [(rows(0, 3), 0, 48)]),
        ("b.arrow", 64, 16, [(rows(9, 1), 0, 16)]),
        ("b.arrow", 84, 48, [(rows(3, 3), 0, 48)]),
    ]


def test_load_coalesces_across_keys():
    # two keys interleaved in one file: one rank asking for both reads once
    t = {
        "a": Tensor("float32", (2, 4), [(rows(0, 2), "f.arrow")]),
        "b": Tensor("int64", (3,), [(B((0,), (3,)), "f.arrow")]),
    }
    m, files = build(t, 8)
    reqs = [TensorRequest("b", "int64", (3,), B((0,), (3,))), TensorRequest("a", "float32", (2, 4), rows(0, 2))]
    plan = create_load_plan(m, reqs)
    simulate(m, files, reqs, plan)
    assert [(r.file, r.offset, r.length, [i.key for i in r.items]) for r in plan.reads] == [
        ("f.arrow", 64, 56, ["a", "b"])
    ]
    assert plan.read_bytes == plan.needed_bytes == 56


def test_load_uneven_3_to_2():
    # (7, 3) float32 saved as rows 3, 3, 1; loaded as rows 4, 3; 12 bytes a row
    placed = [(b, f"shard-{r}.arrow") for r, b in enumerate(dim0_boxes((7, 3), 3))]
    m, files = build({"w": Tensor("float32", (7, 3), placed)}, 12)
    plans = load_all(m, files, "w", "float32", (7, 3), dim0_boxes((7, 3), 2))
    assert [summary(p) for p in plans] == [
        [
            ("shard-0.arrow", 64, 36, [(rows(0, 3, 3), 0, 36)]),
            ("shard-1.arrow", 64, 12, [(rows(3, 1, 3), 0, 12)]),
        ],
        [
            ("shard-1.arrow", 76, 24, [(rows(4, 2, 3), 12, 36)]),
            ("shard-2.arrow", 64, 12, [(rows(6, 1, 3), 0, 12)]),
        ],
    ]
    assert all(p.read_bytes == p.needed_bytes for p in plans)


def test_load_more_ranks_than_rows():
    # (3, 2) float32 saved by 5 ranks (two empty), loaded by 5 ranks (two empty)
    shape = (3, 2)
    save = create_save_plans([[LocalShard("w", "float32", shape, b)] for b in dim0_boxes(shape, 5)])
    placed = [(i.box, f"shard-{p.rank}.arrow") for p in save for i in p.items]
    assert len(placed) == 3
    m, files = build({"w": Tensor("float32", shape, placed)}, 8)
    plans = load_all(m, files, "w", "float32", shape, dim0_boxes(shape, 5))
    for r in range(3):
        assert summary(plans[r]) == [(f"shard-{r}.arrow", 64, 8, [(rows(r, 1, 2), 0, 8)])]
    for r in (3, 4):
        assert plans[r].reads == () and plans[r].needed_bytes == 0 and plans[r].read_bytes == 0


def test_load_ignores_empty_chunks_in_manifest():
    placed = [(rows(0, 2, 2), "a.arrow"), (rows(2, 0, 2), "a.arrow"), (rows(2, 1, 2), "b.arrow")]
    m, files = build({"w": Tensor("float32", (3, 2), placed)}, 8)
    plans = load_all(m, files, "w", "float32", (3, 2), dim0_boxes((3, 2), 2))
    assert [summary(p) for p in plans] == [
        [("a.arrow", 64, 16, [(rows(0, 2, 2), 0, 16)])],
        [("b.arrow", 64, 8, [(rows(2, 1, 2), 0, 8)])],
    ]


def test_load_0dim_tensor():
    m, files = build({"step": Tensor("int64", (), [(Box((), ()), "shard-0.arrow")])}, 16)
    plans = load_all(m, files, "step", "int64", (), [Box((), ())] * 3)
    for p in plans:
        assert summary(p) == [("shard-0.arrow", 64, 8, [(Box((), ()), 0, 8)])]
        assert p.needed_bytes == p.read_bytes == 8


def test_load_shard1_columns_as_dim0_rows():
    # (4, 6) float32 saved as two column blocks (Shard(1)): each chunk is (4, 3), 12 bytes a row
    placed = [(B((0, 0), (4, 3)), "shard-0.arrow"), (B((0, 3), (4, 3)), "shard-1.arrow")]
    m, files = build({"w": Tensor("float32", (4, 6), placed)}, 12)
    plans = load_all(m, files, "w", "float32", (4, 6), dim0_boxes((4, 6), 2))
    assert [summary(p) for p in plans] == [
        [
            ("shard-0.arrow", 64, 24, [(B((0, 0), (2, 3)), 0, 24)]),
            ("shard-1.arrow", 64, 24, [(B((0, 3), (2, 3)), 0, 24)]),
        ],
        [
            ("shard-0.arrow", 88, 24, [(B((2, 0), (2, 3)), 24, 48)]),
            ("shard-1.arrow", 88, 24, [(B((2, 3), (2, 3)), 24, 48)]),
        ],
    ]
    assert all(p.read_bytes == p.needed_bytes for p in plans)


def test_load_dim0_rows_as_columns_reads_the_span():
    # (4, 6) float32 saved dim-0 (rows 2, 2; 24 bytes a row), loaded as column blocks:
    # each chunk's part is 2 runs of 3 elements, 6 apart, read as one 9-element span
    placed = [(rows(0, 2, 6), "shard-0.arrow"), (rows(2, 2, 6), "shard-1.arrow")]
    m, files = build({"w": Tensor("float32", (4, 6), placed)}, 4)
    plans = load_all(m, files, "w", "float32", (4, 6), [B((0, 0), (4, 3)), B((0, 3), (4, 3))])
    assert [summary(p) for p in plans] == [
        [
            ("shard-0.arrow", 64, 36, [(B((0, 0), (2, 3)), 0, 36)]),
            ("shard-1.arrow", 64, 36, [(B((2, 0), (2, 3)), 0, 36)]),
        ],
        [
            ("shard-0.arrow", 76, 36, [(B((0, 3), (2, 3)), 12, 48)]),
            ("shard-1.arrow", 76, 36, [(B((2, 3), (2, 3)), 12, 48)]),
        ],
    ]
    assert all(p.read_bytes == 72 and p.needed_bytes == 48 for p in plans)


def test_load_2d_grid_to_dim0():
    # (4, 4) saved as a 2x2 grid, loaded as rows 1..3 (crosses the grid's row boundary)
    cells = [B((0, 0), (2, 2)), B((0, 2), (2, 2)), B((2, 0), (2, 2)), B((2, 2), (2, 2))]
    placed = [(c, f"shard-{i}.arrow") for i, c in enumerate(cells)]
    m, files = build({"w": Tensor("int32", (4, 4), placed)}, 4)
    (plan,) = load_all(m, files, "w", "int32", (4, 4), [rows(1, 2)])
    assert summary(plan) == [
        ("shard-0.arrow", 72, 8, [(B((1, 0), (1, 2)), 8, 16)]),
        ("shard-1.arrow", 72, 8, [(B((1, 2), (1, 2)), 8, 16)]),
        ("shard-2.arrow", 64, 8, [(B((2, 0), (1, 2)), 0, 8)]),
        ("shard-3.arrow", 64, 8, [(B((2, 2), (1, 2)), 0, 8)]),
    ]


# ---------------------------------------------------------------------------
# Strictness and mismatches


@pytest.fixture
def small():
    placed = [(b, f"shard-{r}.arrow") for r, b in enumerate(dim0_boxes((10, 4), 2))]
    return build({"w": Tensor("float32", (10, 4), placed)}, 16, values={"step": 7, "cfg": {"lr": 0.1}})


def req(key="w", dtype="float32", shape=(10, 4), box=None):
    return TensorRequest(key, dtype, shape, box or Box.full(shape))


def test_missing_key_strict(small):
    m, _ = small
    with pytest.raises(IncompatibleStateError) as info:
        create_load_plan(m, [req(), req("model.extra")], value_keys=["step", "extra_value"])
    msg = str(info.value)
    assert "2 key(s)" in msg
    assert "'model.extra'" in msg and "'extra_value'" in msg
    assert "strict=False" in msg
    with pytest.raises(IncompatibleStateError, match="'model.extra'"):
        create_load_plans(m, [[req()], [req("model.extra")]])


def test_missing_keys_listing_is_capped(small):
    m, _ = small
    reqs = [req(f"k{i:02d}") for i in range(25)]
    with pytest.raises(IncompatibleStateError) as info:
        create_load_plan(m, reqs)
    msg = str(info.value)
    assert "25 key(s)" in msg
    assert "'k19'" in msg and "'k20'" not in msg
    assert "and 5 more" in msg


def test_missing_key_not_strict(small):
    m, files = small
    reqs = [req(box=rows(2, 3)), req("model.extra", box=rows(0, 1))]
    plan = create_load_plan(m, reqs, value_keys=["step", "extra_value"], strict=False)
    assert plan.missing == ("model.extra", "extra_value")
    assert plan.needed_bytes == 3 * 16
    assert {i.key for r in plan.reads for i in r.items} == {"w"}
    simulate(m, files, [reqs[0]], plan)
    # nothing missing: an empty tuple
    assert create_load_plan(m, [req()], value_keys=["step"], strict=False).missing == ()


def test_shape_mismatch(small):
    m, _ = small
    with pytest.raises(IncompatibleStateError) as info:
        create_load_plan(m, [req(shape=(10, 5))], strict=False)
    msg = str(info.value)
    assert "'w'" in msg and "[10, 4]" in msg and "[10, 5]" in msg
    assert "checkpoint shape [10, 4] != target shape [10, 5]" in msg


def test_dtype_mismatch(small):
    m, _ = small
    with pytest.raises(IncompatibleStateError) as info:
        create_load_plan(m, [req(dtype="bfloat16")])
    msg = str(info.value)
    assert "'w'" in msg
    assert "checkpoint dtype float32 != target dtype bfloat16" in msg


def test_kind_mismatch(small):
    m, _ = small
    with pytest.raises(IncompatibleStateError, match="'step': target is a tensor but the checkpoint holds a value"):
        create_load_plan(m, [req("step", "int64", ())])
    with pytest.raises(IncompatibleStateError, match="'w': target is a plain value but the checkpoint holds a tensor"):
        create_load_plan(m, [], value_keys=["w"])


def test_all_problems_in_one_error(small):
    m, _ = small
    with pytest.raises(IncompatibleStateError) as info:
        create_load_plan(m, [req(shape=(4,)), req("step"), req("gone")], value_keys=["w"])
    lines = str(info.value).splitlines()
    assert lines[0] == "state does not match checkpoint:"
    assert len(lines) == 5
    assert "'gone'" in lines[1]  # missing keys first
    assert all(f"'{k}'" in "\n".join(lines[2:]) for k in ("w", "step"))


# ---------------------------------------------------------------------------
# Property tests: random N -> M reshards, simulated end to end

DTYPES = ["int16", "int32", "float64"]


@st.composite
def grid(draw, shape):
    """A random grid partition of ``shape`` into boxes."""
    cuts = []
    for n in shape:
        inner = draw(st.lists(st.integers(1, n - 1), max_size=3)) if n > 1 else []
        pts = sorted(set(inner) | {0, n})
        cuts.append(list(zip(pts, pts[1:])) or [(0, 0)])
    return [B([a for a, _ in cell], [b - a for a, b in cell]) for cell in itertools.product(*cuts)]


@st.composite
def layout(draw, shape):
    """('dim0', boxes of N ranks) or ('grid', boxes of a random grid partition)."""
    if draw(st.booleans()):
        return "dim0", dim0_boxes(shape, draw(st.integers(1, 9)))
    return "grid", draw(grid(shape))


@st.composite
def saved_tensor(draw, key):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
    dtype = draw(st.sampled_from(DTYPES))
    isz = itemsize(dtype)
    kind, boxes = draw(layout(shape))
    # ranks hold the boxes, each box on `rep` ranks (replicated, HSDP-like)
    rep = draw(st.integers(1, 2))
    nranks = len(boxes) if kind == "dim0" else draw(st.integers(1, 4))
    shards: list[list[LocalShard]] = [[] for _ in range(nranks * rep)]
    for i, b in enumerate(boxes):
        for k in range(rep):
            shards[k * nranks + i % nranks].append(LocalShard(key, dtype, shape, b))
    max_chunk = draw(st.sampled_from([isz, 3 * isz, 5 * isz, 2**31]))
    return dict(key=key, shape=shape, dtype=dtype, kind=kind, boxes=boxes, shards=shards, max_chunk=max_chunk)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_reshard_property(data):
    draw = data.draw
    tensors = [draw(saved_tensor(key)) for key in draw(st.sampled_from([["x"], ["x", "y"]]))]
    nsave = max(len(t["shards"]) for t in tensors)
    shards = [[s for t in tensors if r < len(t["shards"]) for s in t["shards"][r]] for r in range(nsave)]
    save_plans = create_save_plans(shards, max_chunk_bytes=min(t["max_chunk"] for t in tensors))

    # every distinct non-empty box is written once, by a rank that holds it, in pieces
    for t in tensors:
        if t["shape"]:
            assert find_coverage_problem(t["shape"], t["boxes"]) is None
        distinct = {b for b in t["boxes"] if b.volume}
        pieces: dict[Box, int] = {}
        for p in save_plans:
            for item in p.items:
                if item.key != t["key"]:
                    continue
                assert item.local.contains(item.box)
                assert any(s.key == t["key"] and s.box == item.local for s in shards[p.rank])
                pieces[item.local] = pieces.get(item.local, 0) + item.box.volume
        assert set(pieces) == distinct
        assert all(pieces[b] == b.volume for b in distinct)

    # lay the chunks out: one file per writer or all in one, in a random order
    one_file = draw(st.booleans())
    chunks = [(i.key, i.box, "all.arrow" if one_file else f"r{p.rank}.arrow") for p in save_plans for i in p.items]
    chunks = draw(st.permutations(chunks))
    block_size = draw(st.one_of(st.just(0), st.integers(1, 40)))  # 0: one element per block
    if block_size == 0:
        block_size = itemsize(tensors[0]["dtype"])
    built = {t["key"]: Tensor(t["dtype"], t["shape"], [(b, f) for k, b, f in chunks if k == t["key"]]) for t in tensors}
    m, files = build(built, block_size, pad=draw(st.integers(0, 5)), header=draw(st.integers(0, 16)))
    for t in tensors:
        assert find_coverage_problem(t["shape"], [c.box for c in m.tensor(t["key"]).chunks]) is None

    # load on M ranks with a random layout per key
    targets = {t["key"]: draw(layout(t["shape"])) for t in tensors}
    nload = max(len(boxes) for _, boxes in targets.values())
    requests = [
        [
            TensorRequest(t["key"], t["dtype"], t["shape"], targets[t["key"]][1][r])
            for t in tensors
            if r < len(targets[t["key"]][1])
        ]
        for r in range(nload)
    ]
    plans = create_load_plans(m, requests)
    for reqs, plan in zip(requests, plans):
        assert plan == create_load_plan(m, reqs)
        simulate(m, files, reqs, plan)
        assert plan.missing == ()
        # reading a dim-0 slab (whole trailing dims) with one element per block reads
        # exactly the bytes needed, whatever the save layout: read amplification 1.0
        single_key = len(tensors) == 1 or tensors[0]["dtype"] == tensors[1]["dtype"]
        dim0_like = all(r.box.sizes[1:] == r.shape[1:] for r in reqs)
        if dim0_like and single_key and block_size == itemsize(tensors[0]["dtype"]):
            assert plan.read_bytes == plan.needed_bytes
            event("read amplification 1.0 checked")
    # the generated target layouts are tilings themselves (0-dim: every rank wants the value)
    for t in tensors:
        if t["shape"]:
            assert find_coverage_problem(t["shape"], targets[t["key"]][1]) is None
