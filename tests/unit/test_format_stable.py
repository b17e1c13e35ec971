"""The format did not change when the package was layered: a save is byte-identical to the golden one."""

from __future__ import annotations

import json
import os

import rayckpt
from rayckpt.engine import save as save_module
from tests.helpers import golden


def test_a_save_writes_the_golden_manifest_and_shard_files(tmp_path, monkeypatch):
    monkeypatch.setattr(save_module, "new_save_id", lambda: golden.SAVE_ID)
    path = str(tmp_path / "ckpt")
    rayckpt.save(golden.golden_state(), path, block_size=golden.BLOCK_SIZE, metadata={"run": "golden"})
    got, want = golden.describe(path), golden.expected()
    assert sorted(got["files"]) == sorted(want["files"])  # file names: <save id>-r<rank>-<type>.arrow
    assert got["manifest"] == want["manifest"]  # every key and value but the creation time
    assert got["files"] == want["files"]  # every shard byte


def test_the_golden_record_is_a_real_checkpoint_description():
    # Guards the check above against a golden file that holds nothing.
    want = golden.expected()
    assert len(want["files"]) == 4 and all(len(h) == 64 for h in want["files"].values())
    entries = want["manifest"]["entries"]
    assert {"model.w", "model.b", "model.ids", "model.mask", "step", "lr", "note", "nested"} <= set(entries)
    assert json.dumps(want).count(golden.SAVE_ID) >= 4
    assert os.path.basename(golden.GOLDEN) == "golden_save.json"
