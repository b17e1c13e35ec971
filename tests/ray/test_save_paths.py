"""The Ray async save goes the engine's way: the same shard files and manifest as ``rayckpt.save``.

``rayckpt.save`` itself is pinned to the golden checkpoint (``tests/unit/test_format_stable.py``);
here the Ray path must write byte for byte what ``rayckpt.save`` writes for the same state.
"""

from __future__ import annotations

import rayckpt
from rayckpt.engine import save as save_module
from rayckpt.ray.rank import async_save
from tests.helpers import golden


def test_an_async_save_writes_the_same_files_as_an_in_process_save(ray_session, tmp_path, monkeypatch):
    monkeypatch.setattr(save_module, "new_save_id", lambda: golden.SAVE_ID)
    path, ref = str(tmp_path / "ckpt"), str(tmp_path / "ref")
    handle = async_save.save_async(golden.golden_state(), path, run="golden", block_size=golden.BLOCK_SIZE)
    assert handle.wait().status == "committed" and handle.save_id == golden.SAVE_ID
    rayckpt.save(golden.golden_state(), ref, block_size=golden.BLOCK_SIZE, metadata={"run": "golden"})
    got, want = golden.describe(path), golden.describe(ref)
    assert sorted(got["files"]) == sorted(golden.expected()["files"])  # the golden file names
    assert got["files"] == want["files"]  # written by the node's ShardWriter from shared memory
    # The manifest differs only in what the Ray path adds to user_metadata: the step.
    assert got["manifest"].pop("user_metadata") == {"step": None, "run": "golden"}
    assert want["manifest"].pop("user_metadata") == {"run": "golden"}
    assert got["manifest"] == want["manifest"]
