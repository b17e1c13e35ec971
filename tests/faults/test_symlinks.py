"""Symbolic links inside a checkpoint are never followed (they could point anywhere), like ``..`` paths."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import rayckpt
from rayckpt import tools
from rayckpt.errors import CorruptCheckpointError
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import read_manifest
from tests.helpers.checkpoints import manifest_of, rewrite_manifest
from tests.helpers.manifest_faults import (
    assert_loads_bit_exact,
    assert_one_line_error,
    empty_like,
    run_cli,
    save_run,
)


@pytest.fixture
def run(tmp_path):
    return save_run(str(tmp_path / "run"), steps=(1, 2))


def _shard(path: str) -> str:
    """A float32 shard file of the checkpoint (holds 'model.w')."""
    return next(f["path"] for f in manifest_of(path)["files"] if f["path"].endswith("-float.arrow"))


def _link_outside(path: str, name: str, tmp_path) -> str:
    """Move ``name`` out of the checkpoint and leave a symlink to it: same bytes, outside the directory."""
    outside = str(tmp_path / f"outside-{name}")
    shutil.move(os.path.join(path, name), outside)
    os.symlink(outside, os.path.join(path, name))
    return outside


def test_symlinked_shard_file_is_refused(run, tmp_path):
    path, state = run[2]
    name = _shard(path)
    _link_outside(path, name, tmp_path)

    with pytest.raises(CorruptCheckpointError, match=rf"{name} is a symbolic link .* does not follow links"):
        rayckpt.load(empty_like(state), path)
    with pytest.raises(CorruptCheckpointError, match=rf"{name} is a symbolic link"):
        tools.read_tensor(path, "model.w")
    with pytest.raises(CorruptCheckpointError, match=rf"{name} is a symbolic link"):
        rayckpt.consolidate(path)

    report = rayckpt.verify(path)
    assert not report.ok
    links = [p for p in report.problems if p.kind == "link"]
    assert len(links) == 1 and links[0].file == name and "'model.w'" in links[0].message
    status, out, err = run_cli("verify", path)
    assert status == 1 and f"link      {path}/{name} is a symbolic link" in out and not err

    status, _, err = run_cli("inspect", path, "--tensor", "model.w")
    assert status == 1
    assert_one_line_error(err, name, "symbolic link")
    assert_loads_bit_exact(*run[1])


def test_symlinked_manifest_is_refused(run, tmp_path):
    path, state = run[2]
    _link_outside(path, "manifest.json", tmp_path)

    for fn in (lambda: read_manifest(CheckpointDir.resolve(path)), lambda: rayckpt.load(empty_like(state), path)):
        with pytest.raises(CorruptCheckpointError, match="manifest.json is a symbolic link"):
            fn()
    report = rayckpt.verify(path)
    assert not report.ok and report.problems[0].kind == "manifest"
    assert "symbolic link" in report.problems[0].message

    entries = {e.step: e for e in rayckpt.tools.ls(os.path.dirname(path))}
    assert entries[2].status == "corrupt" and "symbolic link" in entries[2].error
    assert entries[1].status == "committed"
    assert_loads_bit_exact(*run[1])


def test_symlinked_directory_on_the_way_is_refused(run, tmp_path):
    """A manifest path through a subdirectory that is a link to elsewhere."""
    path, state = run[2]
    name = _shard(path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(os.path.join(path, name), elsewhere / name)
    os.symlink(elsewhere, os.path.join(path, "sub"))

    def into_sub(m):
        for f in m["files"]:
            if f["path"] == name:
                f["path"] = f"sub/{name}"
        for e in m["entries"].values():
            for c in e.get("chunks", []):
                if c["file"] == name:
                    c["file"] = f"sub/{name}"

    rewrite_manifest(path, into_sub)
    with pytest.raises(CorruptCheckpointError, match=rf"sub/{name} is a symbolic link \(.*/sub -> "):
        rayckpt.load(empty_like(state), path)


def test_a_checkpoint_directory_that_is_itself_a_link_still_loads(run, tmp_path):
    """Only what is inside the checkpoint must not be a link ("latest -> rayckpt-step-2" is fine)."""
    path, state = run[2]
    latest = str(tmp_path / "latest")
    os.symlink(path, latest)
    assert_loads_bit_exact(latest, state)
    assert rayckpt.verify(latest).ok
    assert torch.equal(tools.read_tensor(latest, "model.w"), state["model"]["w"])
