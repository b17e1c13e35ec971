"""rayckpt.tools: inspect, read_tensor, consolidate, verify, plan and ls, in one process."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import rayckpt
from rayckpt import tools
from rayckpt.examples.demo import load_worker, save_worker
from rayckpt.testing.multiproc import run_ranks
from rayckpt.tools import verification
from tests.helpers.checkpoints import flip_byte, manifest_of, rewrite_manifest, track_read_tensor
from tests.helpers.checkpoints import make_state as engine_state


def make_state() -> dict:
    state = engine_state()
    state["model"]["empty"] = torch.empty(0, 3)
    state["model"]["z"] = torch.randn(3, generator=torch.Generator().manual_seed(1), dtype=torch.complex64)
    return state


@pytest.fixture
def single(tmp_path):
    """A one-process checkpoint with 32-byte checksum blocks."""
    path = str(tmp_path / "ckpt")
    state = make_state()
    rayckpt.save(state, path, block_size=32)
    return path, state


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """An FSDP2 + AdamW checkpoint saved by 3 ranks (3 chunks per sharded tensor), and its full state."""
    path = str(tmp_path_factory.mktemp("fsdp") / "ckpt")
    saved = run_ranks(save_worker, 3, path, 2, "float32", 16)
    return path, saved[0]["state"]


# ---------------------------------------------------------------------------
# inspect, read_tensor, consolidate


def test_inspect_describes_keys_shapes_chunks_and_files(fsdp):
    path, state = fsdp
    info = rayckpt.inspect(path)
    assert info.world_size == 3 and info.block_size == 16 and info.version == 4 and info.checksum == "xxh3_64"
    tensors = {t.key: t for t in info.tensors}
    assert set(tensors) == set(state)
    w = tensors["app.model.blocks.0.0.weight"]
    assert (w.dtype, w.shape, w.numel, w.nbytes) == ("float32", (13, 10), 130, 520)
    assert w.num_chunks == 3 and len(w.files) == 3  # one float file per saving rank
    assert {f.rank for f in info.files} == {0, 1, 2}
    assert info.total_bytes == sum(os.path.getsize(os.path.join(path, f.path)) for f in info.files)
    values = {v.key: v.decoded for v in info.values}
    assert values["app.extra.step"] == 2
    assert values["app.optim.param_groups"][0]["lr"] == 0.01


def test_read_tensor_assembles_the_full_tensor_from_its_shards(fsdp):
    path, state = fsdp
    for key in ("app.model.blocks.0.0.weight", "app.optim.state.head.bias.exp_avg", "app.model.head.bias"):
        assert torch.equal(tools.read_tensor(path, key), state[key]), key


def test_tensor_summary_gives_the_right_values(fsdp):
    path, state = fsdp
    key = "app.model.blocks.1.2.weight"
    s = tools.tensor_summary(path, key, first=5)
    full = state[key].double()
    assert (s.key, s.dtype, s.shape, s.numel) == (key, "float32", (10, 13), 130)
    assert s.min == full.min().item() and s.max == full.max().item()
    assert s.mean == pytest.approx(full.mean().item(), rel=1e-12)
    assert s.norm == pytest.approx(full.norm().item(), rel=1e-12)
    assert list(s.first) == state[key].reshape(-1)[:5].tolist()


def test_tensor_summary_of_bool_complex_and_empty_tensors(single):
    path, state = single
    mask = tools.tensor_summary(path, "model.mask")
    assert mask.mean == pytest.approx(state["model"]["mask"].double().mean().item())
    assert mask.first == tuple(state["model"]["mask"].tolist())
    z = tools.tensor_summary(path, "model.z")
    parts = torch.view_as_real(state["model"]["z"]).double()
    assert z.max == parts.max().item() and all(isinstance(v, str) for v in z.first)
    empty = tools.tensor_summary(path, "model.empty")
    assert empty.numel == 0 and empty.min is None and empty.first == ()
    scalar = tools.tensor_summary(path, "model.scalar")
    assert scalar.shape == () and scalar.first == (3.5,) and scalar.norm == 3.5


def test_unknown_key_suggests_close_matches(single):
    path, _ = single
    with pytest.raises(ValueError, match=r"no tensor 'model\.ww' in the checkpoint; did you mean 'model\.w'"):
        tools.read_tensor(path, "model.ww")
    with pytest.raises(ValueError, match=r"key 'step' holds a plain value \(10\), not a tensor"):
        tools.tensor_summary(path, "step")


def test_unknown_key_without_a_close_match_points_to_inspect(single):
    path, _ = single
    with pytest.raises(ValueError, match=r"no tensor 'zzz' in the checkpoint; `rayckpt inspect` lists the keys"):
        tools.read_tensor(path, "zzz")


def test_consolidate_returns_the_full_state_dict(fsdp):
    path, state = fsdp
    assert rayckpt.consolidate(path)["app"]["extra.step"] == 2  # nested as saved (AppState's key has a dot)
    full = rayckpt.consolidate(path, flat=True)
    assert full["app.extra.step"] == 2
    tensors = {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
    assert tensors.keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in tensors.items())
    model = rayckpt.consolidate(path, prefix="app.model.")
    from rayckpt.testing.toy import ToyModel

    plain = ToyModel()
    plain.load_state_dict(model)  # strict: exactly a model state_dict
    assert torch.equal(plain.head.weight, state["app.model.head.weight"])


def test_reading_reports_progress(single):
    path, _ = single
    seen = []
    rayckpt.consolidate(path, on_progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] and [d for d, _ in seen] == sorted(d for d, _ in seen)


# ---------------------------------------------------------------------------
# Where a checkpoint is, and where it is not


def test_not_a_checkpoint_errors_say_what_is_there(tmp_path, single):
    path, _ = single
    with pytest.raises(rayckpt.CheckpointNotFoundError, match="no such file or directory"):
        rayckpt.inspect(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(rayckpt.CheckpointNotFoundError, match=r"is not a rayckpt checkpoint \(no manifest.json\)"):
        rayckpt.inspect(str(tmp_path / "empty"))
    os.rename(os.path.join(path, "manifest.json"), os.path.join(path, "manifest.bak"))
    with pytest.raises(rayckpt.CheckpointNotFoundError, match="shard files but no manifest.json"):
        rayckpt.verify(path)
    (tmp_path / "file.pt").write_bytes(b"x")
    with pytest.raises(rayckpt.CheckpointNotFoundError, match="is a file, not a rayckpt checkpoint"):
        rayckpt.plan(str(tmp_path / "file.pt"), 2)


def test_the_manifest_path_itself_is_accepted(single):
    path, _ = single
    assert rayckpt.inspect(os.path.join(path, "manifest.json")).path == path


def test_a_uri_works_like_a_path(single):
    path, state = single
    assert torch.equal(tools.read_tensor(f"file://{path}", "model.w"), state["model"]["w"])
    assert rayckpt.verify(f"file://{path}").ok


# ---------------------------------------------------------------------------
# verify


def test_verify_passes_a_healthy_checkpoint(fsdp):
    path, _ = fsdp
    report = rayckpt.verify(path)
    assert report.ok and report.problems == ()
    m = manifest_of(path)
    chunks = [c for e in m["entries"].values() for c in e.get("chunks", [])]
    assert report.chunks_checked == len(chunks) and report.files_checked == len(m["files"])
    assert report.bytes_checked == sum(c["byte_length"] for c in chunks)  # every byte, once


def test_verify_catches_a_flipped_byte_naming_file_key_and_bytes(single):
    path, _ = single
    chunk = manifest_of(path)["entries"]["model.w"]["chunks"][0]
    flip_byte(path, chunk["file"], chunk["byte_offset"] + 100)
    report = rayckpt.verify(path)
    assert not report.ok
    (p,) = report.problems
    start = chunk["byte_offset"] + 96  # the flipped byte's 32-byte block
    assert (p.kind, p.file, p.key, p.start, p.end) == ("checksum", chunk["file"], "model.w", start, start + 32)
    assert f"[{start}, {start + 32})" in p.message and chunk["file"] in p.message


def test_verify_reads_in_windows_and_reports_every_bad_block(single, monkeypatch):
    path, _ = single
    monkeypatch.setattr(verification, "VERIFY_WINDOW_BYTES", 64)
    chunk = manifest_of(path)["entries"]["model.w"]["chunks"][0]
    for offset in (5, 300, 700):
        flip_byte(path, chunk["file"], chunk["byte_offset"] + offset)
    report = rayckpt.verify(path)
    assert [(p.kind, p.start - chunk["byte_offset"]) for p in report.problems] == [
        ("checksum", 0),
        ("checksum", 288),
        ("checksum", 672),
    ]


def test_verify_catches_a_truncated_file(single):
    path, _ = single
    chunk = manifest_of(path)["entries"]["model.w"]["chunks"][0]
    full = os.path.join(path, chunk["file"])
    size = os.path.getsize(full)
    with open(full, "r+b") as f:
        f.truncate(chunk["byte_offset"] + 10)
    report = rayckpt.verify(path)
    kinds = {p.kind: p for p in report.problems}
    assert kinds["size"].file == chunk["file"] and f"recorded {size}" in kinds["size"].message
    lost = [p for p in report.problems if p.kind == "truncated"]
    assert any(p.key == "model.w" and p.start == chunk["byte_offset"] for p in lost)
    assert all("lie past the end of the file" in p.message for p in lost)


def test_verify_catches_a_missing_file(single):
    path, _ = single
    name = manifest_of(path)["entries"]["model.w"]["chunks"][0]["file"]
    os.remove(os.path.join(path, name))
    report = rayckpt.verify(path)
    (p,) = report.problems
    assert p.kind == "missing" and p.file == name
    assert f"shard file '{name}' is missing" in p.message and "'model.w'" in p.message


def test_verify_catches_an_overlapping_chunk_in_a_hand_edited_manifest(fsdp, tmp_path):
    path = str(tmp_path / "edited")
    shutil.copytree(fsdp[0], path)
    key = "app.model.blocks.0.0.weight"  # 13 rows saved by 3 ranks: rows 0-4, 5-9, 10-12
    rewrite_manifest(path, lambda m: m["entries"][key]["chunks"][1].update(offsets=[4, 0]))
    report = rayckpt.verify(path)
    p = report.problems[0]
    assert p.kind == "manifest" and p.file == "manifest.json"
    assert f"key {key!r}: chunks offsets=[0, 0] sizes=[5, 10] and offsets=[4, 0] sizes=[5, 10] overlap" in p.message
    # The edited box is not the record batch the shard file really holds.
    assert [q.kind for q in report.problems[1:]] == ["arrow"] and key in report.problems[1].message


def test_verify_reports_several_problems_at_once(single):
    path, _ = single
    m = manifest_of(path)
    w = m["entries"]["model.w"]["chunks"][0]
    b_file = m["entries"]["model.b"]["chunks"][0]["file"]
    flip_byte(path, w["file"], w["byte_offset"])
    os.remove(os.path.join(path, b_file))
    assert {p.kind for p in rayckpt.verify(path).problems} == {"checksum", "missing"}


def test_verify_reports_an_unreadable_manifest(single):
    path, _ = single
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write("{not json")
    (p,) = rayckpt.verify(path).problems
    assert p.kind == "manifest" and "not valid JSON" in p.message


def test_verify_checks_the_arrow_structure(single):
    path, _ = single
    m = manifest_of(path)
    name = m["entries"]["model.w"]["chunks"][0]["file"]
    size = os.path.getsize(os.path.join(path, name))
    with open(os.path.join(path, name), "wb") as f:
        f.write(b"\0" * size)  # same size, not Arrow
    kinds = {p.kind for p in rayckpt.verify(path).problems}
    assert "arrow" in kinds and "checksum" in kinds


def test_verify_catches_a_dtype_the_shard_file_contradicts(single):
    path, _ = single
    rewrite_manifest(path, lambda m: m["entries"]["model.w"].update(dtype="int32"))  # same width, other type
    (p,) = rayckpt.verify(path).problems
    assert p.kind == "arrow" and "key 'model.w' is float32 here but int32 in the manifest" in p.message


# ---------------------------------------------------------------------------
# plan


def test_plan_figures_match_what_a_real_load_reads(fsdp):
    path, _ = fsdp
    p = rayckpt.plan(path, 2)
    loaded = run_ranks(load_worker, 2, path)
    for rank, result in enumerate(loaded):
        info = result["info"]
        r = p.ranks[rank]
        assert (r.bytes_needed, r.bytes_read, r.reads) == (info.bytes_needed, info.bytes_read, info.num_reads)
    assert p.saved_world_size == 3 and p.world_size == 2
    assert p.bytes_read == sum(r["info"].bytes_read for r in loaded)
    assert p.read_amplification == pytest.approx(p.bytes_read / p.bytes_needed)
    assert 0 < p.balance <= 1


def test_plan_for_one_rank_reads_everything_once(single):
    path, state = single
    p = rayckpt.plan(path, 1)
    (r,) = p.ranks
    payload = sum(t.numel() * t.element_size() for t in state["model"].values())
    assert r.bytes_needed == payload == r.bytes_read and p.read_amplification == 1.0 and p.balance == 1.0
    assert set(r.files) == {f["path"] for f in manifest_of(path)["files"]}


def test_plan_replicates_zero_dim_tensors_and_splits_rows(tmp_path):
    path = str(tmp_path / "c")
    rayckpt.save({"w": torch.zeros(10, 4), "s": torch.tensor(1.0)}, path, block_size=4)
    p = rayckpt.plan(path, 4)
    # rows 3/3/3/1 of 16 bytes, plus the 4-byte scalar on every rank
    assert [r.bytes_needed for r in p.ranks] == [52, 52, 52, 20]
    assert p.read_amplification == 1.0 and p.balance == pytest.approx(44 / 52)
    with pytest.raises(ValueError, match="at least 1"):
        rayckpt.plan(path, 0)


# ---------------------------------------------------------------------------
# ls


def test_ls_finds_committed_incomplete_and_corrupt_checkpoints(tmp_path, single):
    path, state = single
    root = tmp_path / "storage"
    for run, step in (("run-a", 20), ("run-a", 10), ("run-b", 5)):
        rayckpt.save(state, str(root / run / f"rayckpt-step-{step:08d}"), metadata={"step": step, "run": run})
    crashed = root / "run-b" / "rayckpt-step-00000006"
    crashed.mkdir()
    (crashed / "x-r00000-float.arrow").write_bytes(b"1234")
    shutil.copytree(path, root / "run-b" / "rayckpt-step-00000007")
    (root / "run-b" / "rayckpt-step-00000007" / "manifest.json").write_text("{}")
    (root / "run-b" / "not-a-checkpoint").mkdir()

    entries = tools.ls(str(root))
    assert [(e.run, e.step, e.status) for e in entries] == [
        ("run-a", 10, "committed"),
        ("run-a", 20, "committed"),
        ("run-b", 5, "committed"),
        ("run-b", 6, "incomplete"),
        ("run-b", 7, "corrupt"),
    ]
    first = entries[0]
    assert first.world_size == 1 and first.bytes == rayckpt.inspect(first.path).total_bytes and first.created > 0
    assert entries[3].bytes == 4 and "not a rayckpt manifest" in entries[4].error
    assert [e.step for e in tools.ls(str(root), run="run-a")] == [10, 20]
    assert [e.step for e in tools.ls(str(root / "run-a"))] == [10, 20]  # a run directory
    (single_entry,) = tools.ls(path)  # a checkpoint itself
    assert single_entry.status == "committed"
    assert tools.ls(str(tmp_path / "storage" / "run-b" / "not-a-checkpoint")) == ()


def test_ls_errors(tmp_path):
    with pytest.raises(rayckpt.CheckpointNotFoundError, match="no such directory"):
        tools.ls(str(tmp_path / "nope"))
    with pytest.raises(rayckpt.CheckpointNotFoundError, match="no run 'x'"):
        tools.ls(str(tmp_path), run="x")


def test_reading_every_tensor_holds_one_at_a_time(single, monkeypatch):
    path, state = single
    stats = track_read_tensor(monkeypatch)
    for _key, value in tools.CheckpointReader(path).items():
        del value
    assert stats == {"read": len(state["model"]), "peak": 1}
