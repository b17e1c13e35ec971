"""Loads without Ray: rank 0 reads the manifest once and plans every rank; each rank receives only its slice."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import rayckpt
from rayckpt.examples.demo import save_worker
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.testing.multiproc import run_ranks
from tests.helpers.load_plan_workers import EVERY, NONE, recording_load_worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """A FSDP2 toy checkpoint saved by 4 ranks, loaded by 3 ranks: as it is, with rank 1 asking for a
    tensor it lacks, with every rank asking for a value it lacks, and from a copy with a corrupt manifest."""
    root = tmp_path_factory.mktemp("root-planned")
    path, corrupt = str(root / "saved_by_4"), str(root / "corrupt")
    reference = run_ranks(save_worker, 4, path, 2)[0]["state"]
    shutil.copytree(path, corrupt)
    with open(os.path.join(corrupt, "manifest.json"), "r+b") as f:
        f.seek(10)
        f.write(b"\x00garbage")
    loads = [(path, NONE), (path, 1), (path, EVERY), (corrupt, NONE)]
    good, odd, every, bad = zip(*run_ranks(recording_load_worker, 3, loads))
    return {
        "path": path,
        "corrupt": corrupt,
        "reference": reference,
        "good": good,
        "odd": odd,
        "every": every,
        "bad": bad,
    }


def test_only_rank_0_reads_the_manifest_and_each_rank_gets_only_its_files(loaded):
    results, reference = loaded["good"], loaded["reference"]
    assert [r["manifest_reads"] for r in results] == [1, 0, 0]
    assert [r["slice"] for r in results] == ["RankSlice"] * 3
    sizes = {f.path: f.size for f in rayckpt.read_manifest(CheckpointDir.resolve(loaded["path"])).files}
    for rank, r in enumerate(results):
        assert r["state"].keys() == reference.keys() and r["step"] == 2
        for key, value in reference.items():
            assert torch.equal(r["state"][key], value), f"{key} differs on rank {rank} (4->3)"
        assert r["sizes"] == {f: sizes[f] for f in r["files"]}, f"rank {rank}"
        assert r["info"].bytes_needed > 0
    # FSDP2's dim-0 shards, 4 -> 3: no rank reads every file.
    assert all(len(r["files"]) < len(sizes) for r in results)


def test_a_corrupt_manifest_fails_every_rank_naming_it_as_each_rank_reading_it_did(loaded):
    for rank, r in enumerate(loaded["bad"]):
        name, msg = r["error"]
        assert name == "CorruptCheckpointError", f"rank {rank}"
        assert msg.startswith("load failed on 3 of 3 rank(s):\n  rank 0: CorruptCheckpointError: ")
        assert msg.count(f"{loaded['corrupt']}/manifest.json") >= 3 and "rank 2: CorruptCheckpointError" in msg
    assert [r["manifest_reads"] for r in loaded["bad"]] == [1, 0, 0]


def test_a_key_every_rank_asks_for_fails_every_rank_naming_the_key(loaded):
    for r in loaded["every"]:
        name, msg = r["error"]
        assert name == "IncompatibleStateError"
        assert msg.startswith("load failed on 3 of 3 rank(s):\n  rank 0: IncompatibleStateError: state does not ")
        assert msg.count("'extra.v' (pass strict=False to skip them)") == 3
    assert [r["manifest_reads"] for r in loaded["every"]] == [1, 0, 0]


def test_ranks_asking_differently_plan_from_the_manifest_and_the_odd_rank_fails_every_rank(loaded):
    for r in loaded["odd"]:
        name, msg = r["error"]
        assert name == "IncompatibleStateError" and r["slice"] == "NoneType"
        assert msg.startswith("load failed on 1 of 3 rank(s):\n  rank 1: IncompatibleStateError: state does not ")
        assert "'extra.w' (pass strict=False to skip them)" in msg
    assert [r["manifest_reads"] for r in loaded["odd"]] == [1, 1, 1]
