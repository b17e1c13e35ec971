"""The format did not change when the package was layered: a save is byte-identical to the golden one.

The golden record is a format-version-2 save. Version 3 added each key's path to
the manifest and nothing else for this state: the shard files are byte-identical
but for the version stamp in their schema metadata, the manifest equals the
golden one less the paths and the version, and the golden (version-2) manifest
itself still loads. Version 4 moved the chunks into the chunk table: read back
inline (``checkpoints.manifest_of``) they equal the golden ones.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import torch

import rayckpt
from rayckpt.engine import save as save_module
from rayckpt.format import shard_file
from tests.helpers import golden


def test_a_save_writes_the_golden_manifest_and_shard_files(tmp_path, monkeypatch):
    monkeypatch.setattr(save_module, "new_save_id", lambda: golden.SAVE_ID)
    path = str(tmp_path / "ckpt")
    rayckpt.save(golden.golden_state(), path, block_size=golden.BLOCK_SIZE, metadata={"run": "golden"})
    stamps = {
        pa.ipc.open_file(os.path.join(path, n)).schema.metadata[b"rayckpt.version"]
        for n in os.listdir(path)
        if n.endswith(".arrow")
    }
    assert stamps == {b"4"}  # the shard files and the chunk table
    # The same save with the shard files stamped as version 2, as the golden ones are.
    monkeypatch.setattr(shard_file, "FORMAT_VERSION", 2)
    rayckpt.save(golden.golden_state(), path, block_size=golden.BLOCK_SIZE, metadata={"run": "golden"})
    got, want = golden.describe(path), golden.expected()
    assert sorted(got["files"]) == sorted(want["files"])  # file names: <save id>-r<rank>-<type>.arrow
    assert got["files"] == want["files"]  # every shard byte
    manifest = got["manifest"]
    assert manifest.pop("version") == 4 and want["manifest"].pop("version") == 2
    paths = {key: entry.pop("path") for key, entry in manifest["entries"].items()}
    assert manifest == want["manifest"]  # every key and value but the creation time and the paths
    assert paths == {k: k.split(".") for k in want["manifest"]["entries"]}


def test_a_version_2_checkpoint_still_loads(tmp_path, monkeypatch):
    # The golden save's shard files with the golden (version 2, path-less) manifest.
    monkeypatch.setattr(save_module, "new_save_id", lambda: golden.SAVE_ID)
    path = str(tmp_path / "ckpt")
    state = golden.golden_state()
    rayckpt.save(state, path, block_size=golden.BLOCK_SIZE, metadata={"run": "golden"})
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump({**golden.expected()["manifest"], "created": 0.0}, f)
    assert rayckpt.inspect(path).version == 2
    target = golden.golden_state()
    for t in target["model"].values():
        t.zero_()
    target.update(step=0, lr=0.0, note=None, nested=None)
    rayckpt.load(target, path)
    assert all(torch.equal(target["model"][k], state["model"][k]) for k in state["model"])
    assert (target["step"], target["lr"], target["note"], target["nested"]) == (
        12,
        1e-3,
        ("a", 1),
        {"k": [1, 2.5, None]},
    )
    assert rayckpt.verify(path).ok
    # Without recorded paths an export keeps the flat keys, as before version 3.
    assert set(rayckpt.consolidate(path)) == set(golden.expected()["manifest"]["entries"])


def test_the_golden_record_is_a_real_checkpoint_description():
    # Guards the check above against a golden file that holds nothing.
    want = golden.expected()
    assert len(want["files"]) == 4 and all(len(h) == 64 for h in want["files"].values())
    entries = want["manifest"]["entries"]
    assert {"model.w", "model.b", "model.ids", "model.mask", "step", "lr", "note", "nested"} <= set(entries)
    assert json.dumps(want).count(golden.SAVE_ID) >= 4
    assert os.path.basename(golden.GOLDEN) == "golden_save.json"
