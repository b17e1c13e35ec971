"""The Ray async save goes the engine's way: the same shard files and manifest as ``rayckpt.save``."""

from __future__ import annotations

from rayckpt.engine import save as save_module
from rayckpt.ray import async_save
from tests.helpers import golden


def test_an_async_save_writes_the_golden_shard_files(ray_session, tmp_path, monkeypatch):
    monkeypatch.setattr(save_module, "new_save_id", lambda: golden.SAVE_ID)
    path = str(tmp_path / "ckpt")
    handle = async_save.save_async(golden.golden_state(), path, run="golden", block_size=golden.BLOCK_SIZE)
    assert handle.wait().status == "committed" and handle.save_id == golden.SAVE_ID
    got, want = golden.describe(path), golden.expected()
    assert got["files"] == want["files"]  # written by the node's ShardWriter from shared memory
    # The manifest differs only in what the Ray path adds to user_metadata: the step.
    assert got["manifest"].pop("user_metadata") == {"step": None, "run": "golden"}
    assert want["manifest"].pop("user_metadata") == {"run": "golden"}
    assert got["manifest"] == want["manifest"]
