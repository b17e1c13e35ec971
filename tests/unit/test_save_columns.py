"""The column save planner: the same plans as the per-box planner it replaced, on random layouts
with replication and splitting; its fast path; its errors; what a rank sends it."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayckpt.errors import InvalidStateError
from rayckpt.format.boxes import Box
from rayckpt.planning.load_plan import dim0_boxes
from rayckpt.planning.save_columns import ShardLayout, assign_writers, create_save_plans
from rayckpt.planning.save_plan import LocalShard
from tests.helpers.save_plan_reference import reference_save_plans

DTYPES = ["float32", "bfloat16", "int64", "uint8"]


def tiling(shape: tuple[int, ...], dim: int, parts: int) -> list[Box]:
    """``shape`` cut into ``parts`` slabs along ``dim`` (as torch.chunk does; trailing ones may be empty)."""
    if not shape:
        return [Box((), ())]
    per = -(-shape[dim] // parts) if shape[dim] else 0
    boxes = []
    for p in range(parts):
        lo = min(p * per, shape[dim])
        size = min(per, shape[dim] - lo)
        offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(size if d == dim else shape[d] for d in range(len(shape)))
        boxes.append(Box(offsets, sizes))
    return boxes


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[list[LocalShard]], int]:
    """Every rank's shards: per tensor one tiling, each tile held by a random set of ranks
    (one: sharded; several: replicated, as HSDP or a replicated buffer), in a random order per rank."""
    world = draw(st.integers(1, 5))
    shards: list[list[LocalShard]] = [[] for _ in range(world)]
    for t in range(draw(st.integers(1, 5))):
        shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        dim = draw(st.integers(0, len(shape) - 1)) if shape else 0
        for box in tiling(shape, dim, draw(st.integers(1, 4))):
            holders = draw(st.sets(st.integers(0, world - 1), max_size=world))
            for r in holders:
                shards[r].append(LocalShard(f"t{t}", dtype, shape, box))
    for r in range(world):
        shards[r] = draw(st.permutations(shards[r]))
    return shards, draw(st.sampled_from([8, 24, 100, 2**31 - 64]))


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_the_column_planner_gives_the_per_box_planners_plans(layout):
    shards, max_chunk = layout
    assert create_save_plans(shards, max_chunk) == reference_save_plans(shards, max_chunk)


def test_fsdp_dim0_shards_each_written_by_its_one_holder():
    shapes = {f"layers.{i}.w": (10 + i, 3) for i in range(6)}
    shards = [[LocalShard(k, "float32", s, dim0_boxes(s, 4)[r]) for k, s in shapes.items()] for r in range(4)]
    assignment = assign_writers([ShardLayout.from_shards(s) for s in shards])
    assert [w.tolist() for w in assignment.written] == [list(range(6))] * 4
    assert assignment.tensors == {k: ("float32", s) for k, s in shapes.items()}
    assert create_save_plans(shards) == reference_save_plans(shards)


def test_replicated_boxes_are_written_once_by_the_least_loaded_holder():
    # "big" is rank 1's alone; the replicated ones go largest first to whoever has written least
    full = Box.full((4,))
    shards = [
        [LocalShard("a", "float32", (4,), full), LocalShard("b", "int64", (4,), full)],
        [LocalShard("big", "float32", (8,), Box.full((8,))), LocalShard("a", "float32", (4,), full)],
        [LocalShard("b", "int64", (4,), full), LocalShard("a", "float32", (4,), full)],
    ]
    written = assign_writers([ShardLayout.from_shards(s) for s in shards]).written
    # b (32 bytes): ranks 0 and 2 are empty: rank 0; big (32) is rank 1's; a (16): rank 2 (0 bytes so far)
    assert [w.tolist() for w in written] == [[1], [0], [1]]
    assert create_save_plans(shards) == reference_save_plans(shards)


def test_a_rank_reporting_a_box_twice_writes_it_once():
    box = Box.full((3,))
    shards = [[LocalShard("w", "float32", (3,), box), LocalShard("w", "float32", (3,), box)], []]
    plans = create_save_plans(shards)
    assert [len(p.items) for p in plans] == [1, 0] and plans == reference_save_plans(shards)


def test_chunks_over_the_limit_are_split_by_their_writer():
    shards = [[LocalShard("w", "float32", (10, 4), Box.full((10, 4)))]] * 2
    plans = create_save_plans(shards, max_chunk_bytes=48)
    assert [[i.box.offsets for i in p.items] for p in plans] == [[(0, 0), (3, 0), (6, 0), (9, 0)], []]
    assert plans == reference_save_plans(shards, 48)


@pytest.mark.parametrize(
    "other, fragments",
    [
        (("bfloat16", (4, 4)), ["rank 0 has dtype float32 shape [4, 4]", "rank 2 has dtype bfloat16 shape [4, 4]"]),
        (("float32", (4, 5)), ["rank 0 has dtype float32 shape [4, 4]", "rank 2 has dtype float32 shape [4, 5]"]),
    ],
)
def test_ranks_disagreeing_on_a_key_raise_naming_the_key_and_both_ranks(other, fragments):
    same = [LocalShard("layer.w", "float32", (4, 4), Box.full((4, 4)))]
    shards = [same, same, [LocalShard("layer.w", other[0], other[1], Box.full(other[1]))]]
    with pytest.raises(InvalidStateError) as err:
        assign_writers([ShardLayout.from_shards(s) for s in shards])
    with pytest.raises(InvalidStateError) as old:
        reference_save_plans(shards)
    assert str(err.value) == str(old.value)
    assert str(err.value).startswith("key 'layer.w': ") and str(err.value).endswith("; every rank must agree")
    for f in fragments:
        assert f in str(err.value)


def test_a_layout_is_columns_its_size_grows_with_its_shards_and_its_digest_with_any_change():
    def layout(n: int, rows: int = 10) -> ShardLayout:
        return ShardLayout.from_shards(
            [LocalShard(f"k{i}", "float32", (rows, 2), Box.full((rows, 2))) for i in range(n)]
        )

    small, large = (len(pickle.dumps(layout(n))) for n in (100, 1000))
    assert large < 12 * small  # ~linear: no per-shard objects, the table once
    assert layout(100).digest() == layout(100).digest()
    assert layout(100).digest() != layout(100, rows=11).digest()
    assert isinstance(layout(3).boxes, np.ndarray) and layout(3).boxes.shape == (3, 4)


def test_a_hash_collision_only_takes_the_long_way_to_the_same_plans(monkeypatch):
    from rayckpt.planning import save_columns

    shapes = {f"k{i}": (7, 2) for i in range(4)}
    shards = [[LocalShard(k, "float32", s, dim0_boxes(s, 3)[r]) for k, s in shapes.items()] for r in range(3)]
    fast = create_save_plans(shards)
    monkeypatch.setattr(save_columns, "_hash", lambda box: np.zeros(box.shape[1], dtype=np.uint64))
    assert create_save_plans(shards) == fast == reference_save_plans(shards)
