"""A rank's pieces of a tensor: none, one or several boxes per key, in one process.

DTensors are built on a fake process group (rank 1 of 4; no peers, no
collectives), so the flattening of layouts that need several ranks is checked
here without spawning any.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

import rayckpt
from rayckpt.engine import writer
from rayckpt.engine.reader import RankRead, read_into
from rayckpt.engine.state import FlatState, Piece, TensorLeaf, flatten
from rayckpt.errors import InvalidStateError
from rayckpt.format.boxes import Box
from rayckpt.planning.load_plan import TensorRequest, create_load_plan
from rayckpt.planning.save_columns import create_save_plans
from rayckpt.planning.save_plan import LocalShard
from rayckpt.storage.checkpoint_dir import CheckpointDir


def rows(lo: int, n: int, cols: int = 2) -> Box:
    return Box((lo, 0), (n, cols))


def two_piece_leaf(full: torch.Tensor) -> TensorLeaf:
    """Rows [0, 2) and [5, 8) of ``full``, as separate local tensors."""
    pieces = (Piece(rows(0, 2), full[0:2].clone()), Piece(rows(5, 3), full[5:8].clone()))
    return TensorLeaf(key="w", pieces=pieces, shape=tuple(full.shape), dtype="float32")


def test_region_is_a_view_into_the_piece_holding_the_box():
    full = torch.arange(32.0).reshape(16, 2)
    leaf = two_piece_leaf(full)
    view = leaf.region(rows(6, 2))
    assert torch.equal(view, full[6:8])
    view.fill_(-1)
    assert torch.equal(leaf.pieces[1].local[1:3], torch.full((2, 2), -1.0))
    with pytest.raises(ValueError, match=r"key 'w': box .* lies in none of this rank's pieces"):
        leaf.region(rows(1, 2))  # straddles both pieces' gap


def test_boxes_reported_to_the_plans():
    full = torch.zeros(16, 2)
    assert two_piece_leaf(full).boxes() == (rows(0, 2), rows(5, 3))
    # Holding nothing: one empty box keeps the key, shape and dtype in the plans.
    assert TensorLeaf(key="w", pieces=(), shape=(16, 2), dtype="float32").boxes() == (Box((0, 0), (0, 0)),)
    assert TensorLeaf(key="s", pieces=(), shape=(), dtype="float32").boxes() == ()


def test_several_pieces_per_rank_plan_and_write_each_piece_once():
    full = torch.arange(32.0).reshape(16, 2)
    leaf = two_piece_leaf(full)
    rank1 = [LocalShard("w", "float32", (16, 2), rows(2, 3)), LocalShard("w", "float32", (16, 2), rows(8, 8))]
    empty = [LocalShard("w", "float32", (16, 2), Box((0, 0), (0, 0)))]
    mine = [LocalShard("w", "float32", (16, 2), b) for b in leaf.boxes()]
    plans = create_save_plans([mine, rank1, empty])
    assert [sorted(i.box.offsets[0] for i in p.items) for p in plans] == [[0, 5], [2, 8], []]
    chunks = writer.create_chunk_data(plans[0], FlatState(tensors={"w": leaf}))
    for chunk, lo, n in zip(chunks, (0, 5), (2, 3)):
        assert chunk.box == rows(lo, n)
        assert np.array_equal(np.asarray(chunk.data), full[lo : lo + n].numpy().view(np.uint8).reshape(-1))


def test_one_rank_may_request_several_boxes_of_one_key(tmp_path):
    path = str(tmp_path / "ck")
    full = torch.arange(32.0).reshape(16, 2)
    rayckpt.save({"w": full}, path)
    manifest = rayckpt.read_manifest(CheckpointDir.resolve(path))
    leaf = two_piece_leaf(torch.zeros(16, 2))
    requests = [TensorRequest("w", "float32", (16, 2), b) for b in leaf.boxes()]
    plan = create_load_plan(manifest, requests)
    boxes = sorted((i.box for r in plan.reads for i in r.items), key=lambda b: b.offsets)
    assert boxes == [rows(0, 2), rows(5, 3)]
    sizes = {f.path: f.size for f in manifest.files}
    read_into(
        CheckpointDir.resolve(path),
        RankRead(plan=plan, blocks=manifest.blocks, file_sizes=sizes),
        FlatState(tensors={"w": leaf}),
    )
    assert torch.equal(leaf.pieces[0].local, full[0:2]) and torch.equal(leaf.pieces[1].local, full[5:8])


@pytest.fixture
def rank1_of_4():
    """This process as rank 1 of 4 on a fake process group (DTensors without peers)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def from_local(local: torch.Tensor, mesh: DeviceMesh, shape: tuple[int, ...]) -> DTensor:
    stride = torch.empty(shape).stride()
    return DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size(shape), stride=stride, run_check=False)


def test_a_rank_outside_a_sub_mesh_holds_no_piece(rank1_of_4):
    sub = from_local(torch.empty(0), DeviceMesh("cpu", [0, 2]), (6, 2))
    leaf = flatten({"w": sub}).tensors["w"]
    assert leaf.pieces == () and leaf.shape == (6, 2)
    assert leaf.boxes() == (Box((0, 0), (0, 0)),)


def test_local_shards_wrapper_pieces_keep_their_own_offsets_and_sizes(rank1_of_4):
    mesh = init_device_mesh("cpu", (4,))
    a, b = torch.ones(2, 2), torch.full((3, 2), 2.0)
    leaf = flatten({"w": from_local(LocalShardsWrapper([a, b], [(0, 0), (5, 0)]), mesh, (16, 2))}).tensors["w"]
    assert [p.box for p in leaf.pieces] == [rows(0, 2), rows(5, 3)]
    assert leaf.pieces[0].local.data_ptr() == a.data_ptr()  # loads fill the user's shards in place
    none = flatten({"w": from_local(LocalShardsWrapper([], []), mesh, (16, 2))}).tensors["w"]
    assert none.pieces == ()


def test_local_shard_outside_the_tensor_is_refused(rank1_of_4):
    mesh = init_device_mesh("cpu", (4,))
    bad = from_local(LocalShardsWrapper([torch.ones(3, 2)], [(14, 0)]), mesh, (16, 2))
    with pytest.raises(InvalidStateError, match=r"key 'w': local shard 0 \(offsets \[14, 0\].*shape \[16, 2\]"):
        flatten({"w": bad})


def test_plain_local_tensor_not_matching_its_placement_is_still_refused(rank1_of_4):
    mesh = init_device_mesh("cpu", (4,))
    with pytest.raises(InvalidStateError, match=r"local shard shape \[3, 2\] does not match the placement's \[4, 2\]"):
        flatten({"w": from_local(torch.ones(3, 2), mesh, (16, 2))})
