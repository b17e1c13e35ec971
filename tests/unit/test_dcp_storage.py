"""rayckpt's DCP writer, reader and stager in one process (``no_dist``): values, refusals, leases, the stager."""

from __future__ import annotations

import gc
import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

import rayckpt
import rayckpt.dcp
from rayckpt.dcp.writer import PICKLED_KEY
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import new_save_id
from rayckpt.storage.lease import HELD, read_leases, release_lease, write_lease


class Opaque:
    def __init__(self, tag: str) -> None:
        self.tag = tag


def sample_state() -> dict:
    torch.manual_seed(0)
    return {
        "w": torch.randn(5, 3),
        "nested": {"b": torch.arange(4), "lr": 0.1, "betas": (0.9, 0.99), "groups": [{"params": ["w"], "wd": 0.0}]},
        "n": 5,
        "blob": io.BytesIO(b"raw bytes"),
        "obj": Opaque("kept"),
    }


def empty_like_state() -> dict:
    return {
        "w": torch.zeros(5, 3),
        "nested": {
            "b": torch.zeros(4, dtype=torch.int64),
            "lr": 0.0,
            "betas": (0.0, 0.0),
            "groups": [{"params": [], "wd": 1.0}],
        },
        "n": 0,
        "blob": io.BytesIO(),
        "obj": Opaque(""),
    }


def save(state, path, **kw):
    dcp.save(state, storage_writer=rayckpt.dcp.StorageWriter(path, **kw), no_dist=True)


def failure_of(exc: CheckpointException) -> BaseException:
    return next(iter(exc.failures.values()))[0]


def test_values_are_stored_typed_and_only_what_json_cannot_hold_is_dcps_pickle(tmp_path):
    path = str(tmp_path / "ck")
    save(sample_state(), path)
    manifest = rayckpt.read_manifest(path)
    assert manifest.user_metadata[PICKLED_KEY] == ["obj"]
    assert manifest.entries["n"].value == 5
    assert manifest.entries["nested.lr"].value == 0.1
    # DCP flattens lists of dicts into their leaves
    assert manifest.entries["nested.groups.0.wd"].value == 0.0
    assert manifest.entries["nested.groups.0.params"].value == ["w"]
    assert manifest.entries["nested.b"].path == ("nested", "b")
    # rayckpt's own load never unpickles: the object comes back as the bytes DCP pickled
    target = {"w": torch.zeros(5, 3), "n": 0, "blob": io.BytesIO(), "obj": None}
    rayckpt.load(target, path, strict=False)
    assert target["n"] == 5 and target["blob"].getvalue() == b"raw bytes"
    assert isinstance(target["obj"], bytes) and pickle.loads.__name__  # bytes, untouched
    assert torch.equal(target["w"], sample_state()["w"])


def test_dcp_load_with_the_reader_gives_every_item_back(tmp_path):
    path = str(tmp_path / "ck")
    save(sample_state(), path)
    target = empty_like_state()
    dcp.load(target, storage_reader=rayckpt.dcp.StorageReader(path), no_dist=True)
    ref = sample_state()
    assert torch.equal(target["w"], ref["w"]) and torch.equal(target["nested"]["b"], ref["nested"]["b"])
    assert target["nested"]["lr"] == 0.1 and target["nested"]["betas"] == (0.9, 0.99)
    assert target["nested"]["groups"] == [{"params": ["w"], "wd": 0.0}]
    assert target["n"] == 5 and target["blob"].getvalue() == b"raw bytes" and target["obj"].tag == "kept"


def test_checkpoint_id_goes_through_reset_for_both(tmp_path):
    path = str(tmp_path / "ck")
    dcp.save(sample_state(), checkpoint_id=path, storage_writer=rayckpt.dcp.StorageWriter(), no_dist=True)
    target = empty_like_state()
    dcp.load(target, checkpoint_id=path, storage_reader=rayckpt.dcp.StorageReader(), no_dist=True)
    assert target["n"] == 5


def test_the_reader_reads_rayckpt_saves_like_dcps_empty_planner_does_for_dcp_to_torch_save(tmp_path):
    path = str(tmp_path / "ck")
    state = {"model": {"layer": {"weight": torch.randn(3, 2)}}, "step": 7, "cfg": {"name": "x", "sizes": [1, 2]}}
    rayckpt.save(state, path)
    # dcp_to_torch_save hard-codes FileSystemReader; this is its body with rayckpt's reader
    loaded: dict = {}
    reader = rayckpt.dcp.StorageReader(path)
    _load_state_dict(loaded, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert torch.equal(loaded["model"]["layer"]["weight"], state["model"]["layer"]["weight"])
    assert loaded["step"] == 7 and loaded["cfg"] == {"name": "x", "sizes": [1, 2]}


def test_the_reader_refuses_a_dcp_directory_naming_what_reads_it(tmp_path):
    path = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(path), no_dist=True)
    with pytest.raises(rayckpt.CheckpointNotFoundError, match="torch.distributed.checkpoint directory") as info:
        rayckpt.dcp.StorageReader(path)
    assert "FileSystemReader" in str(info.value) and "rayckpt convert" in str(info.value) and path in str(info.value)
    with pytest.raises(rayckpt.CheckpointNotFoundError, match="torch.distributed.checkpoint directory"):
        dcp.load({"w": torch.zeros(2)}, checkpoint_id=path, storage_reader=rayckpt.dcp.StorageReader(), no_dist=True)


def test_the_reader_given_no_checkpoint_raises_checkpoint_not_found(tmp_path):
    with pytest.raises(rayckpt.CheckpointNotFoundError, match=f"no rayckpt checkpoint at {tmp_path / 'none'}"):
        rayckpt.dcp.StorageReader(str(tmp_path / "none"))


def test_a_dtype_is_never_cast_silently(tmp_path):
    path = str(tmp_path / "ck")
    save({"w": torch.ones(4)}, path)
    with pytest.raises(CheckpointException) as info:
        target = {"w": torch.zeros(4, dtype=torch.bfloat16)}
        dcp.load(target, storage_reader=rayckpt.dcp.StorageReader(path), no_dist=True)
    err = failure_of(info.value)
    assert isinstance(err, rayckpt.IncompatibleStateError)
    assert "key 'w'" in str(err) and "float32" in str(err) and "bfloat16" in str(err)


def test_an_item_of_a_dtype_the_format_cannot_store_is_refused_naming_its_key(tmp_path):
    path = str(tmp_path / "ck")
    with pytest.raises(CheckpointException) as info:
        save({"ok": torch.ones(2), "z": torch.ones(2, dtype=torch.complex128)}, path)
    err = failure_of(info.value)
    assert isinstance(err, rayckpt.InvalidStateError) and "'z'" in str(err) and "complex128" in str(err)
    assert not os.path.exists(path) or not os.listdir(path), "nothing written"


def test_a_live_lease_refuses_the_writer_naming_the_holder(tmp_path):
    path = str(tmp_path / "ck")
    save({"w": torch.ones(2)}, path)
    ckdir = CheckpointDir.resolve(path)
    other = new_save_id()
    write_lease(ckdir, other, HELD)
    try:
        with pytest.raises(CheckpointException) as info:
            save({"w": torch.zeros(2)}, path)
        err = failure_of(info.value)
        assert isinstance(err, rayckpt.SaveFailedError) and other in str(err) and "another save is writing" in str(err)
    finally:
        release_lease(ckdir, other)
    target = {"w": torch.zeros(2)}
    rayckpt.load(target, path)
    assert torch.equal(target["w"], torch.ones(2)), "the committed checkpoint is untouched"


def test_overwrite_false_refuses_a_committed_location(tmp_path):
    path = str(tmp_path / "ck")
    save({"w": torch.ones(2)}, path)
    with pytest.raises(CheckpointException) as info:
        save({"w": torch.zeros(2)}, path, overwrite=False)
    assert isinstance(failure_of(info.value), rayckpt.CheckpointExistsError)


class _Failing(dcp.DefaultSavePlanner):
    def resolve_data(self, write_item):
        if write_item.index.fqn == "b":
            raise RuntimeError("the planner broke on b")
        return super().resolve_data(write_item)


def test_a_failed_save_keeps_its_lease_until_the_writer_saves_again_or_is_dropped(tmp_path):
    path = str(tmp_path / "ck")
    ckdir = CheckpointDir.resolve(path)
    save({"a": torch.ones(2), "b": torch.ones(2)}, path)
    first = rayckpt.read_manifest(path).save_id
    writer = rayckpt.dcp.StorageWriter(path)
    with pytest.raises(CheckpointException, match="the planner broke on b"):
        dcp.save({"a": torch.zeros(2), "b": torch.zeros(2)}, storage_writer=writer, planner=_Failing(), no_dist=True)
    held = [lease.save_id for lease in read_leases(ckdir) if lease.is_live()]
    assert len(held) == 1, "DCP gives a storage writer no call on failure: its lease is kept"
    with pytest.raises(CheckpointException, match=held[0]):
        save({"a": torch.zeros(2), "b": torch.zeros(2)}, path)
    dcp.save({"a": torch.full((2,), 2.0), "b": torch.zeros(2)}, storage_writer=writer, no_dist=True)
    assert rayckpt.read_manifest(path).save_id not in (first, held[0])
    assert not read_leases(ckdir)
    with pytest.raises(CheckpointException):
        dcp.save({"a": torch.zeros(2), "b": torch.zeros(2)}, storage_writer=writer, planner=_Failing(), no_dist=True)
    assert read_leases(ckdir)
    del writer
    gc.collect()
    assert not read_leases(ckdir), "a dropped writer releases its lease"
    assert sorted(os.listdir(path)) == sorted(n for n in os.listdir(path) if not n.startswith("."))


def test_use_collectives_false_is_refused_across_ranks(monkeypatch, tmp_path):
    writer = rayckpt.dcp.StorageWriter(str(tmp_path / "ck"))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    with pytest.raises(ValueError, match="use_collectives=True"):
        writer.set_up_storage_writer(True, rank=0, use_collectives=False)


def test_a_writer_without_a_location_says_where_to_give_one():
    with pytest.raises(ValueError, match="no location"):
        rayckpt.dcp.StorageWriter().set_up_storage_writer(True, rank=0)
    with pytest.raises(ValueError, match="no location"):
        rayckpt.dcp.StorageReader().read_metadata()


def test_bad_writer_options_are_refused():
    with pytest.raises(ValueError, match="full_every"):
        rayckpt.dcp.StorageWriter("x", full_every=-1)
    with pytest.raises(ValueError, match="block_size"):
        rayckpt.dcp.StorageWriter("x", block_size=0)


def test_a_writer_pickles_without_its_save_in_flight(tmp_path):
    writer = rayckpt.dcp.StorageWriter(str(tmp_path / "ck"), incremental=True)
    writer.set_up_storage_writer(True, rank=0)
    writer.prepare_global_plan([dcp.SavePlan([])])
    assert writer._claim is not None and read_leases(CheckpointDir.resolve(str(tmp_path / "ck")))
    copy = pickle.loads(pickle.dumps(writer))
    assert copy._claim is None and copy.checkpoint_id == writer.checkpoint_id and copy._incremental
    writer.reset()
    assert not read_leases(CheckpointDir.resolve(str(tmp_path / "ck")))


def test_the_stager_copies_into_one_reused_buffer_and_deep_copies_values(tmp_path):
    stager = rayckpt.dcp.Stager(str(tmp_path))
    state = {"w": torch.randn(300, 300), "l": [torch.arange(10), {"lr": [0.1]}], "n": 3}
    staged = stager.stage(state)
    assert torch.equal(staged["w"], state["w"]) and torch.equal(staged["l"][0], state["l"][0])
    assert staged["w"].data_ptr() != state["w"].data_ptr()
    state["w"].add_(1)
    state["l"][1]["lr"].append(0.2)
    assert not torch.equal(staged["w"], state["w"]) and staged["l"][1] == {"lr": [0.1]} and staged["n"] == 3
    first = staged["w"].untyped_storage().data_ptr()
    again = stager.stage(state)
    assert again["w"].untyped_storage().data_ptr() == first, "the buffer is reused"
    assert torch.equal(again["w"], state["w"])
    assert stager.should_synchronize_after_execute is False
    stager.close()


def test_async_save_with_the_stager_in_one_process(tmp_path):
    path = str(tmp_path / "ck")
    stager = rayckpt.dcp.Stager(str(tmp_path))
    state = {"w": torch.randn(8, 8), "n": 1}
    fut = dcp.async_save(state, storage_writer=rayckpt.dcp.StorageWriter(path), async_stager=stager, no_dist=True)
    before = state["w"].clone()
    state["w"].add_(1)  # training goes on: the staged copy is saved
    fut.result()
    target = {"w": torch.zeros(8, 8), "n": 0}
    dcp.load(target, storage_reader=rayckpt.dcp.StorageReader(path), no_dist=True)
    assert torch.equal(target["w"], before) and target["n"] == 1
    stager.close()
