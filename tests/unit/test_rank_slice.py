"""``planning.rank_slice``: each loading rank's columnar part of one bulk plan (a load without Ray).

A rank builds from its slice the plan ``BulkPlan.for_rank`` and ``create_load_plan``
give it; a slice holds only the files its rank reads and the values it asked for,
and crosses processes as numpy columns (no per-item object); asks are small and
tell ranks that ask alike; plans with items not of dim-0 slabs are left to each rank.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from rayckpt.errors import IncompatibleStateError
from rayckpt.format.boxes import Box
from rayckpt.planning.bulk import create_dim0_plans
from rayckpt.planning.load_plan import TensorRequest, create_load_plan, dim0_box, dim0_boxes
from rayckpt.planning.rank_slice import LoadAsk, asked_alike, create_rank_slices
from tests.helpers.planning import Tensor, build

# Saved by 4 ranks, dim-0 sharded (a file per rank), plus a 0-dim tensor and two plain values.
SPECS = (("w", "float32", (12, 3)), ("b", "int64", (7,)), ("s", "float32", ()))
VALUES = {"step": 5, "lr": 0.5}


@pytest.fixture(scope="module")
def manifest():
    tensors = {
        key: Tensor(dtype, shape, [(box, f"r{r}.arrow") for r, box in enumerate(dim0_boxes(shape, 4))])
        for key, dtype, shape in SPECS[:2]
    }
    tensors["s"] = Tensor("float32", (), [(Box((), ()), "r3.arrow")])
    return build(tensors, block_size=8, values=VALUES)[0]


def requests(rank: int, world: int, specs=SPECS) -> list[TensorRequest]:
    return [TensorRequest(k, d, s, dim0_box(s, world, rank)) for k, d, s in specs]


@pytest.mark.parametrize("world", [1, 2, 3, 5, 13])
def test_each_rank_builds_from_its_slice_the_plan_it_would_make_itself(manifest, world):
    slices = create_rank_slices(manifest, SPECS, world, ("step",))
    bulk = create_dim0_plans(manifest, SPECS, world, ("step",))
    assert slices is not None and len(slices) == world
    for rank, part in enumerate(slices):
        plan = part.plan(SPECS)
        assert plan == bulk.for_rank(rank) == create_load_plan(manifest, requests(rank, world), ("step",))
        assert part.blocks == manifest.blocks and part.values == {"step": manifest.entries["step"].value}


def test_a_slice_holds_the_sizes_of_only_the_files_its_rank_reads(manifest):
    sizes = {f.path: f.size for f in manifest.files}
    slices = create_rank_slices(manifest, SPECS, 3)
    # 4 -> 3: rank 0 needs rows 0-3 of w (saved ranks 0 and 1), rank 2 rows 8-11 (2 and 3); all need s (3).
    assert slices[0].file_sizes == {f: sizes[f] for f in ("r0.arrow", "r1.arrow", "r3.arrow")}
    assert slices[2].file_sizes == {f: sizes[f] for f in ("r2.arrow", "r3.arrow")}
    for part in slices:
        assert set(part.file_sizes) == set(part.plan(SPECS).files)


def test_a_slice_crosses_processes_as_columns_and_gives_the_same_plan(manifest):
    for part in create_rank_slices(manifest, SPECS, 3, ("step", "lr")):
        data = pickle.dumps(part)
        for name in (b"ReadItem", b"FileRead", b"ChunkEntry", b"LoadPlan", b"Box"):
            assert name not in data, name
        back = pickle.loads(data)
        assert back.plan(SPECS) == part.plan(SPECS) and back.values == part.values
        assert back.checksums.dtype == np.uint64 and part.nbytes > 0


def test_block_checksums_reach_the_rank_whatever_their_value(manifest):
    big = manifest.entries["w"].chunks[1]
    sums = (2**64 - 1, 0, 2**63)[: len(big.checksums)]
    chunks = list(manifest.entries["w"].chunks)
    chunks[1] = type(big)(
        box=big.box, file=big.file, byte_offset=big.byte_offset, byte_length=big.byte_length, checksums=sums
    )
    entries = dict(manifest.entries, w=type(manifest.entries["w"])("float32", (12, 3), tuple(chunks)))
    changed = type(manifest)(
        save_id=manifest.save_id, world_size=4, block_size=manifest.block_size, entries=entries, files=manifest.files
    )
    plan = create_rank_slices(changed, SPECS, 2)[0].plan(SPECS)
    assert plan == create_load_plan(changed, requests(0, 2))
    assert any(i.chunk.checksums == sums for r in plan.reads for i in r.items)


def test_missing_keys_without_strict_are_reported_in_each_slice(manifest):
    specs = SPECS + (("gone", "float32", (4,)),)
    slices = create_rank_slices(manifest, specs, 2, ("step", "gone.v"), strict=False)
    for rank, part in enumerate(slices):
        assert part.plan(specs) == create_load_plan(manifest, requests(rank, 2, specs), ("step", "gone.v"), False)
        assert part.missing == ("gone", "gone.v") and part.values == {"step": manifest.entries["step"].value}


@pytest.mark.parametrize(
    "specs, values, fragment",
    [
        ((("w", "float64", (12, 3)),), (), "key 'w': checkpoint dtype float32 != target dtype float64"),
        ((("w", "float32", (12, 4)),), (), "key 'w': checkpoint shape [12, 3] != target shape [12, 4]"),
        ((("nope", "float32", (2,)),), (), "1 key(s) the target asks for are not in the checkpoint: 'nope'"),
        ((), ("w",), "key 'w': target is a plain value but the checkpoint holds a tensor"),
    ],
)
def test_asks_that_do_not_fit_raise_the_planners_message(manifest, specs, values, fragment):
    with pytest.raises(IncompatibleStateError) as own:
        create_load_plan(manifest, requests(0, 2, specs), values)
    with pytest.raises(IncompatibleStateError) as err:
        create_rank_slices(manifest, specs, 2, values)
    assert str(err.value) == str(own.value) and fragment in str(err.value)


def test_chunks_that_are_not_dim0_slabs_or_a_key_asked_twice_leave_planning_to_each_rank(manifest):
    grid = [Box((0, 0), (2, 3)), Box((0, 3), (2, 2)), Box((2, 0), (3, 5))]
    m = build({"g": Tensor("float32", (5, 5), [(b, "r0.arrow") for b in grid])}, block_size=8)[0]
    assert create_rank_slices(m, [("g", "float32", (5, 5))], 2) is None
    assert create_rank_slices(manifest, SPECS + SPECS[:1], 2) is None


def test_ranks_asking_alike_send_the_same_small_ask():
    asks = [LoadAsk.of(requests(r, 3), ("step",), True, r, 3) for r in range(3)]
    assert asked_alike(asks) and len({a.digest for a in asks}) == 1
    assert len(pickle.dumps(asks[0])) < 120 and all(a.dim0 for a in asks)
    full = LoadAsk.of([TensorRequest(k, d, s, Box.full(s)) for k, d, s in SPECS], ("step",), True, 1, 3)
    assert not full.dim0 and not asked_alike([asks[0], full, asks[2]])
    for other in (
        LoadAsk.of(requests(1, 3, SPECS[:2]), ("step",), True, 1, 3),  # other specs
        LoadAsk.of(requests(1, 3, SPECS[::-1]), ("step",), True, 1, 3),  # other order
        LoadAsk.of(requests(1, 3), ("lr",), True, 1, 3),  # other values
        LoadAsk.of(requests(1, 3), ("step",), False, 1, 3),  # other strict
        LoadAsk.of(requests(0, 3), ("step",), True, 1, 3),  # another rank's boxes
    ):
        assert not asked_alike([asks[0], other, asks[2]])
    assert not asked_alike([])


def test_a_checkpoint_read_from_storage_slices_from_its_stored_columns(tmp_path):
    import torch

    import rayckpt
    from rayckpt.format.chunk_columns import ChunkColumns
    from rayckpt.storage.checkpoint_dir import CheckpointDir

    rayckpt.save({"w": torch.arange(40.0).reshape(10, 4), "b": torch.ones(3), "step": 3}, str(tmp_path))
    m = rayckpt.read_manifest(CheckpointDir.resolve(str(tmp_path)))
    assert ChunkColumns.from_manifest(m).checksums is not None  # what the chunk table holds
    specs = [("b", "float32", (3,)), ("w", "float32", (10, 4))]
    for rank, part in enumerate(create_rank_slices(m, specs, 3, ("step",))):
        assert part.plan(specs) == create_load_plan(m, requests(rank, 3, specs), ("step",))
        assert part.values == {"step": m.entries["step"].value}
