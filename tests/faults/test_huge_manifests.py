"""Self-consistent manifests describing more bytes than storage holds: refused before any allocation or read."""

from __future__ import annotations

import os

import pytest
import torch

import rayckpt
from rayckpt import tools
from rayckpt.errors import CorruptCheckpointError
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import read_manifest
from tests.helpers.checkpoints import make_state, manifest_of, rewrite_manifest
from tests.helpers.manifest_faults import assert_loads_bit_exact, assert_one_line_error, empty_like, run_cli, save_run

TIB4 = 4 * 2**40


@pytest.fixture
def huge(tmp_path):
    """A one-tensor checkpoint whose manifest says: a 4 TiB float32 tensor, its file 4 TiB, one 4 TiB block."""
    path = str(tmp_path / "huge")
    rayckpt.save({"w": torch.arange(8, dtype=torch.float32), "note": "hi"}, path)

    def grow(m):
        entry = m["entries"]["w"]
        chunk = entry["chunks"][0]
        entry["shape"] = chunk["sizes"] = [2**20, 2**20]
        chunk["offsets"] = [0, 0]
        chunk["byte_length"] = TIB4
        m["block_size"] = TIB4
        chunk["checksums"] = chunk["checksums"][:1]
        m["files"][0]["size"] = chunk["byte_offset"] + TIB4

    rewrite_manifest(path, grow)
    return path


def test_the_huge_manifest_is_self_consistent(huge):
    # Nothing in the manifest alone gives it away: only the files on storage do.
    m = read_manifest(CheckpointDir.resolve(huge))
    assert m.tensor("w").shape == (2**20, 2**20)
    info = rayckpt.inspect(huge)
    assert info.tensors[0].nbytes == TIB4


def _assert_refused(exc: BaseException, path: str) -> None:
    msg = str(exc)
    assert "tensor 'w'" in msg and f"would need {TIB4} bytes (4096.0 GiB)" in msg, msg
    assert "refusing to allocate" in msg and "manifest recorded" in msg, msg
    assert os.path.basename(manifest_of(path)["files"][0]["path"]) in msg, msg


def test_tools_refuse_before_allocating(huge, tmp_path):
    for fn in (lambda: tools.read_tensor(huge, "w"), lambda: rayckpt.consolidate(huge)):
        with pytest.raises(CorruptCheckpointError) as info:
            fn()
        _assert_refused(info.value, huge)
    with pytest.raises(CorruptCheckpointError) as info:
        tools.tensor_summary(huge, "w")
    _assert_refused(info.value, huge)
    for fmt in ("torch", "safetensors", "dcp"):
        dst = tmp_path / f"out-{fmt}"
        with pytest.raises(CorruptCheckpointError) as info:
            rayckpt.convert(huge, str(dst), to=fmt)
        _assert_refused(info.value, huge)
        assert not dst.exists()  # refused before the destination was made


def test_cli_refuses_in_one_line(huge, tmp_path):
    for args in (["inspect", huge, "--tensor", "w"], ["convert", huge, str(tmp_path / "out"), "--to", "torch"]):
        status, _, err = run_cli(*args)
        assert status == 1
        assert_one_line_error(err, "tensor 'w'", f"would need {TIB4} bytes", "refusing to allocate")


def test_load_refuses_a_huge_target_shape_without_reading(huge):
    with pytest.raises(rayckpt.IncompatibleStateError, match="shape"):
        rayckpt.load({"w": torch.zeros(8)}, huge)


def test_chunks_sharing_bytes_are_refused(tmp_path):
    """Two chunks of one tensor pointing at the same bytes (with valid checksums): more bytes than the file holds."""
    path = str(tmp_path / "shared")
    rayckpt.save({"w": torch.randn(1, 1000)}, path)

    def share(m):
        entry = m["entries"]["w"]
        first = entry["chunks"][0]
        entry["shape"] = [2, 1000]
        entry["chunks"].append(dict(first, offsets=[1, 0]))

    rewrite_manifest(path, share)
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w' .* would need 8000 bytes .* chunks share bytes"):
        tools.read_tensor(path, "w")


def test_load_checks_every_file_before_reading_any(tmp_path):
    """A later file's chunk lies past its real end (manifest grown to match): nothing is loaded, not even
    the tensors of the files read first; the previous checkpoint still loads bit-exact."""
    run = save_run(str(tmp_path), steps=(1, 2))
    path, state = run[2]
    m = manifest_of(path)
    files = sorted(f["path"] for f in m["files"])
    last = files[-1]  # reads go file by file in name order: this one is read last
    assert len(files) > 1

    def push_past_the_end(doc):
        for f in doc["files"]:
            if f["path"] == last:
                f["size"] += 10**6
        for e in doc["entries"].values():
            for c in e.get("chunks", []):
                if c["file"] == last:
                    c["byte_offset"] += 10**6 - 8

    rewrite_manifest(path, push_past_the_end)
    read_manifest(CheckpointDir.resolve(path))  # self-consistent
    target = empty_like(state)
    recorded = rf"shard file '{last}' .* has \d+ bytes but the manifest recorded"
    with pytest.raises(CorruptCheckpointError, match=recorded):
        rayckpt.load(target, path)
    for k, v in empty_like(state)["model"].items():
        assert torch.equal(target["model"][k], v), f"{k} was written before the error"
    assert_loads_bit_exact(*run[1])


def test_a_good_checkpoint_still_reads(tmp_path):
    path = str(tmp_path / "good")
    state = make_state()
    rayckpt.save(state, path, block_size=32)
    assert torch.equal(tools.read_tensor(path, "model.w"), state["model"]["w"])
    flat = rayckpt.consolidate(path, flat=True)
    assert torch.equal(flat["model.ids"], state["model"]["ids"])
