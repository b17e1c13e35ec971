"""save/load in one process (no process group): format, integrity and error paths."""

from __future__ import annotations

import json
import os
import zlib

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch
import xxhash

import rayckpt
from rayckpt.engine import reader, writer
from rayckpt.engine.state import FlatState, Piece, TensorLeaf
from rayckpt.format.boxes import Box
from rayckpt.planning import load_plan, save_plan
from rayckpt.storage.checkpoint_dir import CheckpointDir
from tests.helpers.checkpoints import flip_byte, make_state, manifest_of, rewrite_manifest


def zeros_like_state(state: dict) -> dict:
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "step": 0,
        "config": None,
    }


def data_files(path) -> list[str]:
    """The shard files (not the version-4 chunk table)."""
    return sorted(f for f in os.listdir(path) if f.endswith(".arrow") and not f.endswith("-chunks.arrow"))


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "ckpt")
    state = make_state()
    info = rayckpt.save(state, path, block_size=32)
    return path, state, info


def test_round_trip_is_exact_for_tensors_and_values(saved):
    path, state, info = saved
    target = zeros_like_state(state)
    rayckpt.load(target, path)
    for k, v in state["model"].items():
        assert target["model"][k].dtype == v.dtype
        assert torch.equal(target["model"][k], v), k
    assert target["step"] == 10
    cfg = target["config"]
    assert cfg["betas"] == (0.9, 0.99) and isinstance(cfg["betas"], tuple)
    assert cfg[3] == "int key" and cfg["names"] == ["a", "b"]
    assert cfg["lr"] != cfg["lr"]  # nan survives


def test_save_info_describes_the_checkpoint(saved):
    path, _, info = saved
    assert info.world_size == 1
    assert info.num_files == len(data_files(path)) >= 3  # float, uint16 (bf16), uint8/int64 files
    assert info.bytes_written == sum(os.path.getsize(os.path.join(path, f)) for f in data_files(path))


def test_shard_files_are_plain_arrow_ipc(saved):
    """Any Arrow reader sees typed, flat arrays; bf16 is stored as uint16."""
    path, state, _ = saved
    seen = {}
    for name in data_files(path):
        reader = pa.ipc.open_file(pa.memory_map(os.path.join(path, name)))
        for i in range(reader.num_record_batches):
            batch, meta = reader.get_batch_with_custom_metadata(i)
            seen[meta[b"key"].decode()] = (reader.schema.field("data").type, batch.column(0))
    w_type, w_col = seen["model.w"]
    assert w_type == pa.float32()
    assert w_col.to_numpy().tolist() == state["model"]["w"].reshape(-1).tolist()
    assert seen["model.b"][0] == pa.uint16()
    assert seen["model.ids"][0] == pa.int64()
    m = manifest_of(path)
    assert m["entries"]["model.b"]["dtype"] == "bfloat16"
    assert m["format"] == "rayckpt" and m["version"] == 4 and m["checksum"] == "xxh3_64"


def test_manifest_is_json_without_pickle(saved):
    path, _, _ = saved
    raw = open(os.path.join(path, "manifest.json"), "rb").read()
    json.loads(raw)
    for name in data_files(path):
        assert b"\x80\x04\x95" not in open(os.path.join(path, name), "rb").read()[:16]


def test_load_ignores_keys_the_target_does_not_ask_for(saved):
    path, state, _ = saved
    target = {"model": {"w": torch.zeros(37, 5)}}
    info = rayckpt.load(target, path)
    assert torch.equal(target["model"]["w"], state["model"]["w"])
    assert info.bytes_needed == 37 * 5 * 4


def test_missing_key_is_an_error_naming_it(saved):
    path, state, _ = saved
    target = zeros_like_state(state)
    target["model"]["extra_layer"] = torch.zeros(3)
    with pytest.raises(rayckpt.IncompatibleStateError, match=r"'model.extra_layer'.*strict=False"):
        rayckpt.load(target, path)


def test_strict_false_skips_missing_keys(saved):
    path, state, _ = saved
    target = zeros_like_state(state)
    target["model"]["extra_layer"] = torch.full((3,), 7.0)
    info = rayckpt.load(target, path, strict=False)
    assert info.missing_keys == ("model.extra_layer",)
    assert torch.equal(target["model"]["extra_layer"], torch.full((3,), 7.0))
    assert torch.equal(target["model"]["w"], state["model"]["w"])


def test_shape_mismatch_names_key_and_shapes(saved):
    path, state, _ = saved
    target = zeros_like_state(state)
    target["model"]["w"] = torch.zeros(36, 5)
    with pytest.raises(rayckpt.IncompatibleStateError, match=r"'model.w'.*\[37, 5\].*\[36, 5\]"):
        rayckpt.load(target, path)


def test_dtype_mismatch_is_an_error_not_a_cast(saved):
    path, state, _ = saved
    target = zeros_like_state(state)
    target["model"]["w"] = torch.zeros(37, 5, dtype=torch.float64)
    with pytest.raises(rayckpt.IncompatibleStateError, match=r"'model.w'.*float32.*float64"):
        rayckpt.load(target, path)
    assert torch.equal(target["model"]["w"], torch.zeros(37, 5, dtype=torch.float64))


def test_value_where_tensor_expected_is_an_error(saved):
    path, state, _ = saved
    with pytest.raises(rayckpt.IncompatibleStateError, match=r"'step'.*tensor but the checkpoint holds a value"):
        rayckpt.load({"step": torch.zeros(1)}, path)


def test_flipped_byte_is_caught_naming_file_key_and_bytes(saved):
    path, state, _ = saved
    chunk = manifest_of(path)["entries"]["model.w"]["chunks"][0]
    flip_byte(path, chunk["file"], chunk["byte_offset"] + 100)
    target = zeros_like_state(state)
    with pytest.raises(rayckpt.CorruptCheckpointError) as err:
        rayckpt.load(target, path)
    msg = str(err.value)
    assert chunk["file"] in msg and "'model.w'" in msg
    start = chunk["byte_offset"] + 96  # 32-byte blocks: the flipped byte's block
    assert f"[{start}, {start + 32})" in msg


def test_flipped_byte_outside_the_needed_range_does_not_fail_a_partial_read(tmp_path):
    """Verification is per block: a read checks only the blocks it touches."""
    path = str(tmp_path / "c")
    w = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    rayckpt.save({"w": w}, path, block_size=16)
    chunk = manifest_of(path)["entries"]["w"]["chunks"][0]
    flip_byte(path, chunk["file"], chunk["byte_offset"] + 200)  # row 12
    m = rayckpt.read_manifest(CheckpointDir.resolve(path))
    req = load_plan.TensorRequest("w", "float32", (16, 4), Box((0, 0), (8, 4)))
    plan = load_plan.create_load_plan(m, [req])
    assert plan.read_bytes == plan.needed_bytes == 128
    target = torch.zeros(8, 4)
    flat = FlatState(
        tensors={"w": TensorLeaf(key="w", pieces=(Piece(req.box, target),), shape=(16, 4), dtype="float32")}
    )
    sizes = {f.path: f.size for f in m.files}
    reader.read_into(CheckpointDir.resolve(path), reader.RankRead(plan=plan, blocks=m.blocks, file_sizes=sizes), flat)
    assert torch.equal(target, w[:8])


def test_read_manifest_takes_a_path_a_uri_or_a_checkpoint_dir(saved, tmp_path):
    path, _, _ = saved
    m = rayckpt.read_manifest(CheckpointDir.resolve(path))
    assert rayckpt.read_manifest(path) == m
    assert rayckpt.read_manifest(tmp_path / "ckpt") == m  # an os.PathLike
    assert rayckpt.read_manifest(f"file://{path}") == m
    assert rayckpt.read_manifest(path, filesystem=pafs.LocalFileSystem()) == m
    with pytest.raises(rayckpt.CheckpointNotFoundError) as info:
        rayckpt.read_manifest(str(tmp_path / "nothing"))
    assert str(info.value) == f"no manifest.json in {tmp_path}/nothing: not a committed checkpoint"
    with pytest.raises(TypeError) as info:
        rayckpt.read_manifest(5)
    assert str(info.value) == "read_manifest takes a checkpoint path, URI or CheckpointDir, got int 5"


def test_truncated_file_is_caught(saved):
    path, state, _ = saved
    name = manifest_of(path)["entries"]["model.w"]["chunks"][0]["file"]
    full = os.path.join(path, name)
    with open(full, "r+b") as f:
        f.truncate(os.path.getsize(full) - 50)
    with pytest.raises(rayckpt.CorruptCheckpointError, match=rf"{name}.*truncated"):
        rayckpt.load(zeros_like_state(state), path)


def test_missing_shard_file_is_caught(saved):
    path, state, _ = saved
    name = manifest_of(path)["entries"]["model.w"]["chunks"][0]["file"]
    os.remove(os.path.join(path, name))
    with pytest.raises(rayckpt.CorruptCheckpointError, match=rf"shard file '{name}' is missing"):
        rayckpt.load(zeros_like_state(state), path)


def to_version_1(path) -> None:
    """Rewrite a checkpoint's manifest as format version 1 wrote it: CRC-32 blocks, no algorithm field."""

    def edit(m):
        m["version"] = 1
        del m["checksum"]
        for entry in m["entries"].values():
            for c in entry.get("chunks", []):
                with open(os.path.join(path, c["file"]), "rb") as f:
                    f.seek(c["byte_offset"])
                    data = f.read(c["byte_length"])
                del c["checksums"]
                c["crc32"] = [zlib.crc32(data[i : i + m["block_size"]]) for i in range(0, len(data), m["block_size"])]

    rewrite_manifest(path, edit)


def test_version_1_crc32_checkpoint_still_loads_and_verifies(saved):
    path, state, _ = saved
    to_version_1(path)
    target = zeros_like_state(state)
    rayckpt.load(target, path)
    for k, v in state["model"].items():
        assert torch.equal(target["model"][k], v)
    assert rayckpt.verify(path).ok
    chunk = manifest_of(path)["entries"]["model.w"]["chunks"][0]
    flip_byte(path, chunk["file"], chunk["byte_offset"] + 5)
    with pytest.raises(rayckpt.CorruptCheckpointError, match=r"'model.w'.*stored crc32 0x"):
        rayckpt.load(zeros_like_state(state), path)


def test_checksums_are_xxh3_64_of_each_block(saved):
    path, _, _ = saved
    m = manifest_of(path)
    c = m["entries"]["model.w"]["chunks"][0]
    with open(os.path.join(path, c["file"]), "rb") as f:
        f.seek(c["byte_offset"])
        data = f.read(c["byte_length"])
    bs = m["block_size"]
    assert c["checksums"] == [xxhash.xxh3_64_intdigest(data[i : i + bs]) for i in range(0, len(data), bs)]


def test_manifest_path_escaping_the_directory_is_refused(saved, tmp_path):
    path, state, _ = saved
    secret = tmp_path / "secret.arrow"
    secret.write_bytes(b"x" * 100)

    def escape(m):
        m["files"][0]["path"] = "../secret.arrow"
        for e in m["entries"].values():
            for c in e.get("chunks", []):
                c["file"] = "../secret.arrow"

    rewrite_manifest(path, escape)
    with pytest.raises(rayckpt.CorruptCheckpointError, match=r"'\.\./secret\.arrow' escapes the checkpoint directory"):
        rayckpt.load(zeros_like_state(state), path)


def test_unknown_format_version_is_refused(saved):
    path, state, _ = saved
    rewrite_manifest(path, lambda m: m.update(version=99))
    with pytest.raises(rayckpt.FormatVersionError, match="format version 99"):
        rayckpt.load(zeros_like_state(state), path)


def test_no_manifest_means_no_checkpoint(tmp_path):
    with pytest.raises(rayckpt.CheckpointNotFoundError, match="manifest.json"):
        rayckpt.load({"w": torch.zeros(1)}, str(tmp_path / "nothing"))


def test_unsupported_value_type_is_refused_before_anything_is_written(tmp_path):
    path = tmp_path / "c"
    with pytest.raises(rayckpt.InvalidStateError, match=r"key 'cfg.fn'.*function"):
        rayckpt.save({"w": torch.ones(2), "cfg": {"fn": lambda: 0}}, str(path))
    assert not path.exists() or not os.listdir(path)


def test_saving_again_replaces_the_checkpoint_atomically(tmp_path):
    path = str(tmp_path / "c")
    rayckpt.save(make_state(0), path)
    old_files = data_files(path)
    rayckpt.save(make_state(1), path)
    new_files = data_files(path)
    assert not set(old_files) & set(new_files)  # old data removed after the new commit
    target = zeros_like_state(make_state())
    rayckpt.load(target, path)
    assert target["step"] == 11
    assert torch.equal(target["model"]["ids"], make_state(1)["model"]["ids"])


def test_failed_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    rayckpt.save(make_state(0), path)
    before = (manifest_of(path), data_files(path))

    def disk_full(ckdir, rel, chunks, block_size, save_id, fingerprints=False):
        with ckdir.open_output(rel) as out:
            out.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_shard_file", disk_full)
    with pytest.raises(rayckpt.SaveFailedError, match="No space left on device"):
        rayckpt.save(make_state(1), path)
    assert (manifest_of(path), data_files(path)) == before
    monkeypatch.undo()
    target = zeros_like_state(make_state())
    rayckpt.load(target, path)
    assert target["step"] == 10


def test_large_chunks_are_split(tmp_path, monkeypatch):
    monkeypatch.setattr(save_plan, "MAX_CHUNK_BYTES", 100)
    path = str(tmp_path / "c")
    w = torch.arange(24 * 7, dtype=torch.float32).reshape(24, 7)
    rayckpt.save({"w": w}, path)
    chunks = manifest_of(path)["entries"]["w"]["chunks"]
    assert len(chunks) == 8 and all(c["byte_length"] <= 100 for c in chunks)
    target = {"w": torch.zeros(24, 7)}
    rayckpt.load(target, path)
    assert torch.equal(target["w"], w)


def test_zero_dim_and_empty_tensors(tmp_path):
    path = str(tmp_path / "c")
    state = {"s": torch.tensor(2.5), "e": torch.zeros(0, 4), "i": torch.tensor(7)}
    rayckpt.save(state, path)
    target = {"s": torch.tensor(0.0), "e": torch.ones(0, 4), "i": torch.tensor(0)}
    rayckpt.load(target, path)
    assert target["s"].item() == 2.5 and target["i"].item() == 7 and target["e"].shape == (0, 4)


def test_non_local_filesystem_uses_ranged_reads(tmp_path):
    """A pyarrow filesystem other than local (in-memory mock): no mmap, no fsync, same result."""
    fs = pafs._MockFileSystem()
    state = make_state()
    info = rayckpt.save(state, "ckpts/a", filesystem=fs)
    assert fs.get_file_info("ckpts/a/manifest.json").type == pafs.FileType.File
    target = zeros_like_state(state)
    rayckpt.load(target, "ckpts/a", filesystem=fs)
    assert torch.equal(target["model"]["w"], state["model"]["w"]) and target["step"] == 10
    assert info.num_files >= 3


def test_uri_checkpoint_id(tmp_path):
    location = f"file://{tmp_path}/viauri"
    state = make_state()
    rayckpt.save(state, location)
    assert os.path.exists(tmp_path / "viauri" / "manifest.json")
    target = zeros_like_state(state)
    rayckpt.load(target, location)
    assert torch.equal(target["model"]["b"], state["model"]["b"])


def test_bad_uri_is_a_clear_error():
    with pytest.raises(rayckpt.RayckptError, match="cannot open checkpoint location 'nosuch://x'"):
        rayckpt.save({"w": torch.ones(1)}, "nosuch://x")


def test_stateful_gets_load_state_dict_called(tmp_path):
    class Thing:
        def __init__(self, v):
            self.v = v
            self.loaded = None

        def state_dict(self):
            return {"v": self.v, "t": torch.full((2,), float(self.v))}

        def load_state_dict(self, sd):
            self.loaded = sd

    rayckpt.save({"thing": Thing(4)}, str(tmp_path / "c"))
    t = Thing(0)
    rayckpt.load({"thing": t}, str(tmp_path / "c"))
    assert t.loaded["v"] == 4 and torch.equal(t.loaded["t"], torch.full((2,), 4.0))


def test_colliding_flattened_keys_are_refused(tmp_path):
    with pytest.raises(rayckpt.InvalidStateError, match="same key 'a.b'"):
        rayckpt.save({"a": {"b": torch.ones(1)}, "a.b": torch.ones(1)}, str(tmp_path / "c"))


def test_hand_edited_overlapping_chunks_are_refused_at_load(tmp_path):
    path = str(tmp_path / "c")
    rayckpt.save({"w": torch.arange(8.0)}, path, block_size=8)

    def overlap(m):
        c = m["entries"]["w"]["chunks"][0]
        half = dict(c, offsets=[2], sizes=[6], byte_length=24, checksums=c["checksums"][:3])
        c.update(sizes=[4], byte_length=16, checksums=c["checksums"][:2])
        m["entries"]["w"]["chunks"].append(half)

    rewrite_manifest(path, overlap)
    with pytest.raises(rayckpt.CorruptCheckpointError, match=r"(?s)inconsistent manifest.*key 'w'.*overlap"):
        rayckpt.load({"w": torch.zeros(8)}, path)


def test_non_contiguous_target_is_filled_through_the_buffered_path(tmp_path):
    path = str(tmp_path / "c")
    w = torch.arange(20.0).reshape(4, 5)
    rayckpt.save({"w": w}, path, block_size=8)
    base = torch.zeros(5, 4)
    target = {"w": base.t()}  # a (4, 5) view with strides (1, 4): not contiguous
    rayckpt.load(target, path)
    assert torch.equal(base.t(), w)


# ---------------------------------------------------------------------------
# Direct reads: split into pieces over I/O threads, verified in order


def test_direct_read_pieces_cover_head_body_tail_in_file_order(monkeypatch):
    monkeypatch.setattr(reader, "READ_PIECE_BYTES", 7)
    data = bytearray(range(40))
    head, body, tail = memoryview(data)[:3], memoryview(data)[3:33], memoryview(data)[33:]
    read = load_plan.FileRead("f", 1000, 40, ())
    pieces = reader._pieces(reader.DirectRead(read, head, body, tail))
    assert [off for off, _ in pieces] == [1000, 1007, 1014, 1021, 1028, 1035]
    assert all(sum(len(v) for v in views) == 7 for _, views in pieces[:-1])
    assert b"".join(bytes(v) for _, views in pieces for v in views) == bytes(data)
    assert [len(v) for v in pieces[0][1]] == [3, 4]  # the head and the start of the body


@pytest.mark.parametrize("threads", [1, 3])
def test_load_with_tiny_pieces_on_several_threads_is_exact(saved, monkeypatch, threads):
    path, state, _ = saved
    monkeypatch.setattr(reader, "READ_PIECE_BYTES", 5)  # splits blocks and elements
    monkeypatch.setattr(reader, "READ_THREADS", threads)
    target = zeros_like_state(state)
    info = rayckpt.load(target, path)
    assert info.bytes_read >= info.bytes_needed > 0
    for k, v in state["model"].items():
        assert torch.equal(target["model"][k], v)


def test_corrupt_block_fails_the_load_even_when_later_pieces_are_queued(saved, monkeypatch):
    path, state, _ = saved
    monkeypatch.setattr(reader, "READ_PIECE_BYTES", 8)
    chunk = manifest_of(path)["entries"]["model.w"]["chunks"][0]
    flip_byte(path, chunk["file"], chunk["byte_offset"] + 1)
    with pytest.raises(rayckpt.CorruptCheckpointError, match=r"'model.w'.*stored xxh3_64 0x"):
        rayckpt.load(zeros_like_state(state), path)


def test_overwrite_false_refuses_a_committed_checkpoint_and_leaves_it_untouched(tmp_path):
    path = str(tmp_path / "ck")
    state = make_state(1)
    rayckpt.save(state, path)
    before = {n: (tmp_path / "ck" / n).read_bytes() for n in os.listdir(path)}
    refused = r"ck already holds a committed checkpoint and overwrite=False: nothing was written"
    with pytest.raises(rayckpt.CheckpointExistsError, match=refused):
        rayckpt.save(make_state(2), path, overwrite=False)
    assert {n: (tmp_path / "ck" / n).read_bytes() for n in os.listdir(path)} == before
    assert isinstance(rayckpt.CheckpointExistsError("x"), rayckpt.SaveFailedError)


def test_overwrite_false_saves_where_nothing_is_committed(tmp_path):
    fresh = str(tmp_path / "fresh")
    rayckpt.save(make_state(1), fresh, overwrite=False)
    assert os.path.exists(os.path.join(fresh, "manifest.json"))
    crashed = tmp_path / "crashed"  # shard files of a save that never committed: no checkpoint there
    crashed.mkdir()
    (crashed / "20260101T000000-deadbeef-r00000-float.arrow").write_bytes(b"partial")
    rayckpt.save(make_state(2), str(crashed), overwrite=False)
    out = zeros_like_state(make_state(2))
    rayckpt.load(out, str(crashed))
    assert torch.equal(out["model"]["w"], make_state(2)["model"]["w"])
    assert not (crashed / "20260101T000000-deadbeef-r00000-float.arrow").exists()  # dropped by the commit
    rayckpt.save(make_state(3), fresh)  # the default still replaces atomically
    rayckpt.load(out, fresh)
    assert torch.equal(out["model"]["w"], make_state(3)["model"]["w"])


def test_stateful_objects_are_called_in_sorted_key_order_whatever_the_dict_order(tmp_path):
    calls: list[str] = []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def state_dict(self) -> dict:
            calls.append(f"save {self.name}")
            return {"t": torch.ones(2)}

        def load_state_dict(self, sd: dict) -> None:
            calls.append(f"load {self.name}")

    path = str(tmp_path / "ck")
    rayckpt.save({"b": Recorder("b"), "a": Recorder("a"), "c": {"z": Recorder("cz"), "y": Recorder("cy")}}, path)
    assert calls == ["save a", "save b", "save cy", "save cz"]
    calls.clear()
    rayckpt.load({"c": {"y": Recorder("cy"), "z": Recorder("cz")}, "b": Recorder("b"), "a": Recorder("a")}, path)
    assert calls == ["save a", "save b", "save cy", "save cz", "load a", "load b", "load cy", "load cz"]


class _DCPCheckpointable(torch.Tensor):
    """A tensor subclass that speaks DCP's checkpoint protocol (as LocalShardsWrapper does)."""

    def __create_write_items__(self, fqn, obj):  # pragma: no cover - never called by rayckpt
        raise AssertionError("rayckpt must refuse this type before using it")


def test_tensors_with_dcps_checkpoint_protocol_are_refused_by_key_and_type(tmp_path):
    path = tmp_path / "ck"
    weird = torch.ones(3).as_subclass(_DCPCheckpointable)
    with pytest.raises(rayckpt.InvalidStateError, match=r"key 'm\.w': _DCPCheckpointable .*__create_write_items__"):
        rayckpt.save({"m": {"w": weird, "b": torch.ones(2)}}, str(path))
    assert not path.exists()  # refused before anything was written


def test_save_ids_are_utc_so_they_order_saves_across_hosts(monkeypatch):
    # The lease rule orders rival saves by save id: hosts in other time zones must agree.
    import datetime
    import time

    from rayckpt.storage.commit import new_save_id

    monkeypatch.setenv("TZ", "Asia/Kolkata")  # UTC+05:30: a local-time id would be 5.5 h off
    time.tzset()
    try:
        stamp = datetime.datetime.strptime(new_save_id().split("-")[0], "%Y%m%dT%H%M%S")
    finally:
        monkeypatch.undo()
        time.tzset()
    now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
    assert abs((now - stamp).total_seconds()) < 600
