"""The data position through ``rayckpt.save`` / ``rayckpt.load`` in one process: the manifest's
``data_position``, a resume from it, a checkpoint without one, and the refusals."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from torch.utils.data import DataLoader

import rayckpt
from rayckpt.data import ResumableSampler
from rayckpt.errors import DataPositionError


def state() -> dict:
    return {"w": torch.arange(12.0)}


def manifest(path) -> dict:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def test_the_position_is_saved_in_the_manifest_and_a_load_continues_from_it(tmp_path):
    sampler = ResumableSampler(30, num_replicas=1, rank=0, seed=4, identity="thirty")
    loader = DataLoader(list(range(30)), batch_size=4, sampler=sampler)
    sampler.set_epoch(1)
    it = iter(loader)
    first = next(it).tolist() + next(it).tolist()
    rayckpt.save(state(), str(tmp_path / "c"), data=loader)
    doc = manifest(tmp_path / "c")["data_position"]
    assert doc == {
        "dataset": "thirty",
        "length": 30,
        "epoch": 1,
        "seed": 4,
        "shuffle": True,
        "drop_last": False,
        "consumed": 8,
        "extras": [],
        "world_size": 1,
    }
    fresh = ResumableSampler(30, num_replicas=1, rank=0, seed=4, identity="thirty")
    target = {"w": torch.zeros(12)}
    rayckpt.load(target, str(tmp_path / "c"), data=fresh)
    assert torch.equal(target["w"], torch.arange(12.0)) and fresh.epoch == 1
    assert sorted(first + list(fresh)) == list(range(30))


def test_a_checkpoint_without_a_position_restarts_the_epoch_with_one_warning(tmp_path, caplog):
    rayckpt.save(state(), str(tmp_path / "old"))  # as every checkpoint before data positions: no field
    assert "data_position" not in manifest(tmp_path / "old")
    sampler = ResumableSampler(10, num_replicas=1, rank=0, shuffle=False)
    next(iter(sampler))
    with caplog.at_level(logging.WARNING, logger="rayckpt.data"):
        rayckpt.load({"w": torch.zeros(12)}, str(tmp_path / "old"), data=sampler)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "holds no data position" in warnings[0].getMessage()
    assert "old" in warnings[0].getMessage() and "start of epoch 0" in warnings[0].getMessage()
    assert list(sampler) == list(range(10))


def test_a_position_of_another_dataset_or_length_is_refused_by_load(tmp_path):
    sampler = ResumableSampler(10, num_replicas=1, rank=0, identity="a")
    next(iter(sampler))
    rayckpt.save(state(), str(tmp_path / "c"), data=sampler)
    with pytest.raises(DataPositionError, match=r"'a' of 10 samples, this sampler's dataset is 'b' of 10"):
        rayckpt.load({"w": torch.zeros(12)}, str(tmp_path / "c"), data=ResumableSampler(10, identity="b"))
    with pytest.raises(DataPositionError, match=r"had 10 samples when .* and has 11 now"):
        rayckpt.load({"w": torch.zeros(12)}, str(tmp_path / "c"), data=ResumableSampler(11, identity="a"))


def test_a_loader_that_cannot_say_what_was_consumed_is_refused_before_anything_is_written(tmp_path):
    sampler = ResumableSampler(10, num_replicas=1, rank=0)
    loader = DataLoader(list(range(10)), batch_size=2, sampler=sampler, num_workers=2)
    with pytest.raises(DataPositionError, match="num_workers=2 prefetches"):
        rayckpt.save(state(), str(tmp_path / "c"), data=loader)
    assert not os.path.exists(tmp_path / "c" / "manifest.json")
    with pytest.raises(DataPositionError, match="got list"):
        rayckpt.save(state(), str(tmp_path / "d"), data=[1, 2])


def test_the_position_leaves_the_shard_files_as_they_were(tmp_path):
    sampler = ResumableSampler(10, num_replicas=1, rank=0)
    rayckpt.save(state(), str(tmp_path / "with"), data=sampler)
    rayckpt.save(state(), str(tmp_path / "without"))
    a, b = manifest(tmp_path / "with"), manifest(tmp_path / "without")
    assert [f["size"] for f in a["files"]] == [f["size"] for f in b["files"]]
    assert rayckpt.verify(str(tmp_path / "with")).ok
