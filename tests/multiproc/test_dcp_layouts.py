"""Layouts DCP saves that FSDP2 does not make: DTensors on a sub-mesh, uneven local shards (gloo, 4 ranks).

One spawn per scenario saves and loads every combination; the tests then check
each rank's held rows bit-exactly against the full tensor, and load the same
checkpoints into plain tensors here, with no process group.
"""

from __future__ import annotations

import pytest
import torch

import rayckpt
from rayckpt.format.manifest import Manifest
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.testing.multiproc import run_ranks
from tests.helpers import layout_workers as lw

pytestmark = pytest.mark.slow
WORLD = 4


def manifest_at(path: str) -> Manifest:
    return rayckpt.read_manifest(CheckpointDir.resolve(path))


def assert_holds(per_rank: list[lw.Held], full: torch.Tensor, where: str) -> None:
    """Every held shard equals its rows of ``full`` (bit for bit), and together they cover every row once."""
    covered = [0] * full.shape[0]
    for rank, held in enumerate(per_rank):
        for first, local in held:
            assert torch.equal(local, full[first : first + local.shape[0]]), f"{where}: rank {rank} rows {first}+"
            for row in range(first, first + local.shape[0]):
                covered[row] += 1
    assert covered == [1] * full.shape[0], f"{where}: rows held per rank {covered}"


@pytest.fixture(scope="module")
def submesh(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("submesh") / "ck")
    return path, run_ranks(lw.submesh_worker, WORLD, path)


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("uneven"))
    return root, run_ranks(lw.uneven_worker, WORLD, root)


def test_submesh_save_writes_only_the_mesh_ranks_data(submesh):
    path, results = submesh
    assert [r["in_sub_mesh"] for r in results] == [True, False, True, False]
    manifest = manifest_at(path)
    chunks = manifest.tensor("sub").chunks
    assert sorted(c.box.offsets for c in chunks) == [(0, 0), (4, 0)]
    assert {f.rank for f in manifest.files for c in chunks if c.file == f.path} <= {0, 2}
    assert len(manifest.tensor("rep").chunks) == len(manifest.tensor("s").chunks) == 1  # replicas written once


@pytest.mark.parametrize("target", ["same", "other", "all"])
def test_submesh_checkpoint_reshards_into_meshes_of_some_or_all_ranks(submesh, target):
    _, results = submesh
    sub, rep = lw.expected(lw.SUB_SHAPE, 1), lw.expected(lw.REP_SHAPE, 2)
    assert_holds([r[target]["sub"] for r in results], sub, target)
    inside = {"same": [0, 2], "other": [1, 3], "all": [0, 1, 2, 3]}[target]
    for rank, r in enumerate(results):
        loaded = r[target]
        assert torch.equal(loaded["plain"], torch.arange(6.0))
        if rank in inside:
            assert torch.equal(loaded["rep"], rep) and loaded["s"].item() == 2.5
        else:
            assert loaded["rep"] is None and loaded["sub"] == []


def test_ranks_outside_the_target_mesh_load_strictly_without_touching_their_tensor(submesh):
    _, results = submesh
    for r in results:
        assert r["same"]["untouched"] and r["other"]["untouched"]


def test_submesh_checkpoint_loads_into_plain_tensors_without_a_process_group(submesh):
    path, _ = submesh
    target = {"sub": torch.zeros(lw.SUB_SHAPE), "rep": torch.zeros(lw.REP_SHAPE), "s": torch.tensor(0.0)}
    rayckpt.load(target, path)
    assert torch.equal(target["sub"], lw.expected(lw.SUB_SHAPE, 1))
    assert torch.equal(target["rep"], lw.expected(lw.REP_SHAPE, 2))
    assert target["s"].item() == 2.5


LAYOUTS = ["4_3_4_5", "two_and_none", "even"]


@pytest.mark.parametrize("saved", LAYOUTS)
@pytest.mark.parametrize("target", LAYOUTS)
def test_uneven_local_shards_reshard_to_and_from_even_layouts(uneven, saved, target):
    _, results = uneven
    assert_holds([r[(saved, target)] for r in results], lw.expected(lw.UNEVEN_SHAPE, 3), f"{saved} -> {target}")


def test_uneven_save_stores_each_local_shard_as_its_own_chunk(uneven):
    root, _ = uneven
    rows = {
        name: sorted(c.box.offsets[0] for c in manifest_at(f"{root}/{name}").tensor("w").chunks) for name in LAYOUTS
    }
    assert rows == {"4_3_4_5": [0, 4, 7, 11], "two_and_none": [0, 2, 5, 8], "even": [0, 4, 8, 12]}


@pytest.mark.parametrize("saved", LAYOUTS)
def test_uneven_checkpoints_load_into_a_plain_tensor_without_a_process_group(uneven, saved):
    root, _ = uneven
    target = {"w": torch.zeros(lw.UNEVEN_SHAPE)}
    rayckpt.load(target, f"{root}/{saved}")
    assert torch.equal(target["w"], lw.expected(lw.UNEVEN_SHAPE, 3))
