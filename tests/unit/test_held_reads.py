"""A load from the memory tier reads the files its node holds with ``preadv``, straight into the targets,
as from a local disk; files only another node holds are read through the filesystem.

The memory tier's filesystem is stood in for by a ``PyFileSystem`` handler of the same type name over
local files (the real one, over Ray, is covered in tests/ray/test_memory_tier.py and tests/s3).
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch

import rayckpt
from rayckpt.errors import CorruptCheckpointError
from rayckpt.format.shard_file import ShardReader
from rayckpt.storage.checkpoint_dir import MEMORY_TIER
from tests.helpers.checkpoints import flip_byte, make_state, manifest_of


class HeldFiles(pafs.FileSystemHandler):
    """Local files under the memory tier's type name; ``held``: the shard files "this node" holds."""

    def __init__(self, held: bool) -> None:
        self.local, self.held, self.opened, self.descriptors = pafs.LocalFileSystem(), held, [], []

    def get_type_name(self):
        return MEMORY_TIER.removeprefix("py::")

    def local_descriptor(self, path):
        if not (self.held and path.endswith(".arrow")) or path.endswith("-chunks.arrow"):
            return None
        self.descriptors.append(os.path.basename(path))
        return os.open(path, os.O_RDONLY)

    def open_input_file(self, path):
        self.opened.append(os.path.basename(path))
        return pa.memory_map(path, "r")

    def open_input_stream(self, path):
        return self.open_input_file(path)

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def normalize_path(self, path):
        return path

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def __hash__(self):
        return id(self)

    # the reads never write
    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = delete_file = None
    move = copy_file = open_output_stream = open_append_stream = None


def saved(tmp_path) -> tuple[str, dict]:
    path, state = str(tmp_path / "ck"), make_state()
    rayckpt.save(state, path, block_size=64)
    return path, state


def target_like(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0, "config": None}


def direct_reads(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = ShardReader.read_direct
    monkeypatch.setattr(ShardReader, "read_direct", lambda self, rel, *a: calls.append(rel) or real(self, rel, *a))
    return calls


def test_files_held_on_this_node_are_read_with_preadv_and_not_mapped(tmp_path, monkeypatch):
    path, state = saved(tmp_path)
    handler, calls = HeldFiles(held=True), direct_reads(monkeypatch)
    target = target_like(state)
    info = rayckpt.load(target, path, filesystem=pafs.PyFileSystem(handler))
    for key, value in state["model"].items():
        assert torch.equal(target["model"][key], value), key
    shards = sorted(f.path for f in rayckpt.read_manifest(path).files)
    assert sorted(set(handler.descriptors)) == shards  # each opened once, by descriptor
    assert calls and set(calls) <= set(shards)
    assert not set(handler.opened) & set(shards)  # none mapped: only the manifest and its chunk table
    assert info.bytes_read > 0


def test_files_only_another_node_holds_are_read_through_the_filesystem(tmp_path, monkeypatch):
    path, state = saved(tmp_path)
    handler, calls = HeldFiles(held=False), direct_reads(monkeypatch)
    target = target_like(state)
    rayckpt.load(target, path, filesystem=pafs.PyFileSystem(handler))
    for key, value in state["model"].items():
        assert torch.equal(target["model"][key], value), key
    shards = {f.path for f in rayckpt.read_manifest(path).files}
    assert calls == [] and shards <= set(handler.opened)


def test_a_flipped_byte_in_a_held_file_fails_its_checksum_naming_the_file_and_key(tmp_path, monkeypatch):
    path, state = saved(tmp_path)
    key = next(iter(state["model"]))
    chunk = manifest_of(path)["entries"][f"model.{key}"]["chunks"][0]
    flip_byte(path, chunk["file"], chunk["byte_offset"] + 10)
    calls = direct_reads(monkeypatch)
    with pytest.raises(CorruptCheckpointError) as err:
        rayckpt.load(target_like(state), path, filesystem=pafs.PyFileSystem(HeldFiles(held=True)))
    assert chunk["file"] in str(err.value) and f"'model.{key}'" in str(err.value)
    assert chunk["file"] in calls  # caught on the preadv path
