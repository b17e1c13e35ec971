"""rayckpt.convert: to and from torch.save, DCP and safetensors; bit-exact round trips; DCP interop on FSDP2."""

from __future__ import annotations

import json
import os
import warnings
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

import rayckpt
from rayckpt import tools
from rayckpt.engine.app_state import AppState
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.testing.multiproc import run_ranks
from rayckpt.testing.toy import ToyModel, build_fsdp, full_state, train_steps
from rayckpt.tools.convert import convert, dcp_dir, regroup_values, safetensors_files, streaming
from tests.helpers.checkpoints import track_read_tensor

FORMATS = ["torch", "dcp", "safetensors"]


def make_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(37, 5, generator=g),
            "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "h": torch.randn(2, 3, generator=g).to(torch.float16),
            "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
            "mask": torch.rand(6, generator=g) > 0.5,
            "ids": torch.arange(7, dtype=torch.int64),
            "u16": torch.arange(3).to(torch.uint16),
            "z": torch.randn(3, generator=g, dtype=torch.complex64),
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 3),
        },
        "step": 10,
        "config": {"betas": (0.9, 0.99), "groups": [{"lr": 0.1, "params": ["w", "b"]}], "name": "x", "none": None},
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def assert_same_checkpoint(a: str, b: str, tensors_only: bool = False) -> None:
    """Bit for bit: same keys, dtypes, shapes, bytes; same values."""
    ca, cb = rayckpt.consolidate(a, flat=True), rayckpt.consolidate(b, flat=True)
    if tensors_only:
        ca = {k: v for k, v in ca.items() if isinstance(v, torch.Tensor)}
    assert ca.keys() == cb.keys()
    for k, x in ca.items():
        y = cb[k]
        if isinstance(x, torch.Tensor):
            assert (x.dtype, x.shape) == (y.dtype, y.shape), k
            assert torch.equal(bits(x), bits(y)), k
        else:
            assert x == y and type(x) is type(y), k


def paths_of(ckpt: str) -> dict:
    """Each key's recorded path in the nested state dict."""
    m = tools.CheckpointReader(ckpt).manifest
    return {k: m.path(k) for k in m.entries}


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ckpt")
    rayckpt.save(make_state(), path, block_size=64)
    return path


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_is_bit_exact(ckpt, tmp_path, fmt):
    out = str(tmp_path / ("out.pt" if fmt == "torch" else "out"))
    info = convert(ckpt, out, to=fmt)
    assert info.direction == "to" and info.format == fmt and info.tensors == 10
    assert info.bytes == sum(t.nbytes for t in make_state()["model"].values())
    back = str(tmp_path / "back")
    again = convert(out, back, from_=fmt)
    assert again.direction == "from" and again.tensors == 10
    assert rayckpt.verify(back).ok
    assert_same_checkpoint(ckpt, back, tensors_only=fmt == "safetensors")
    if fmt != "safetensors":  # safetensors keys are flat: nothing records the nesting
        assert rayckpt.consolidate(back).keys() == {"model", "step", "config"}
        assert paths_of(back) == paths_of(ckpt)
    assert rayckpt.inspect(back).user_metadata == {"converted_from": {"format": fmt, "path": out}}


def test_torch_file_is_what_torch_save_writes(ckpt, tmp_path):
    out = str(tmp_path / "full.pt")
    convert(ckpt, out, to="torch")
    ref = str(tmp_path / "ref.pt")
    torch.save(rayckpt.consolidate(ckpt), ref)
    mine, theirs = zipfile.ZipFile(out), zipfile.ZipFile(ref)
    assert [n.split("/", 1)[1] for n in mine.namelist()] == [n.split("/", 1)[1] for n in theirs.namelist()]
    assert mine.read("full/data.pkl") == theirs.read("ref/data.pkl")  # the very same pickle
    for mmap in (False, True):
        loaded = torch.load(out, weights_only=True, mmap=mmap)
        assert loaded["config"] == make_state()["config"] and loaded["step"] == 10
        assert torch.equal(bits(loaded["model"]["b"]), bits(make_state()["model"]["b"]))


def test_prefix_exports_a_plain_model_state_dict(tmp_path):
    model = ToyModel()
    path = str(tmp_path / "ckpt")
    rayckpt.save({"app": {"model": model.state_dict(), "extra.step": 3}}, path)
    convert(path, str(tmp_path / "model.pt"), to="torch", prefix="app.model.")
    fresh = ToyModel()
    fresh.load_state_dict(torch.load(str(tmp_path / "model.pt"), weights_only=True))
    assert torch.equal(fresh.head.weight, model.head.weight)

    from safetensors.torch import load_model

    convert(path, str(tmp_path / "st"), to="safetensors", prefix="app.model.")
    fresh = ToyModel()
    load_model(fresh, str(tmp_path / "st" / "model.safetensors"))
    assert torch.equal(fresh.blocks[1][2].weight, model.blocks[1][2].weight)

    # importing with the prefix puts the keys back where they were
    convert(str(tmp_path / "st"), str(tmp_path / "back"), from_="safetensors", prefix="app.model.")
    assert_same_checkpoint(path, str(tmp_path / "back"), tensors_only=True)


def test_safetensors_split_with_an_index(ckpt, tmp_path):
    out = tmp_path / "st"
    info = convert(ckpt, str(out), to="safetensors", max_shard_bytes=200)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == info.bytes
    assert info.values == 2  # step and config have no place in safetensors

    from safetensors import safe_open

    for key, shard in index["weight_map"].items():
        with safe_open(str(out / shard), framework="pt") as f:
            want = make_state()["model"][key.removeprefix("model.")]
            assert torch.equal(bits(f.get_tensor(key)), bits(want)), key
    convert(str(out), str(tmp_path / "back"), from_="safetensors")
    assert_same_checkpoint(ckpt, str(tmp_path / "back"), tensors_only=True)


def test_safetensors_single_file_when_dst_names_one(ckpt, tmp_path):
    out = str(tmp_path / "weights.safetensors")
    info = convert(ckpt, out, to="safetensors")
    assert info.files == (out,) and os.listdir(tmp_path) == ["ckpt", "weights.safetensors"]
    from safetensors.torch import load_file

    assert torch.equal(bits(load_file(out)["model.b"]), bits(make_state()["model"]["b"]))
    with pytest.raises(ValueError, match="need .* files of at most 100 bytes; give a directory"):
        convert(ckpt, str(tmp_path / "small.safetensors"), to="safetensors", max_shard_bytes=100)
    assert not (tmp_path / "small.safetensors").exists()


def test_dcp_output_is_read_by_torch_itself(ckpt, tmp_path):
    out = str(tmp_path / "dcp")
    convert(ckpt, out, to="dcp")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(out, str(tmp_path / "via_format_utils.pt"))
    full = torch.load(str(tmp_path / "via_format_utils.pt"), weights_only=True)
    assert torch.equal(bits(full["model"]["f8"]), bits(make_state()["model"]["f8"]))
    assert full["config"] == make_state()["config"]
    target = {"model": {"w": torch.zeros(37, 5)}, "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=out)  # nested target: DCP flattens it to the same dotted keys
    assert torch.equal(target["model"]["w"], make_state()["model"]["w"]) and target["step"] == 10


def test_dcp_int_dict_keys_come_back_as_strings(tmp_path):
    """DCP's own limit: it joins object paths with str(key)."""
    path = str(tmp_path / "c")
    rayckpt.save({"w": torch.ones(2), "names": {3: "three"}}, path)
    convert(path, str(tmp_path / "dcp"), to="dcp")
    convert(str(tmp_path / "dcp"), str(tmp_path / "back"), from_="dcp")
    assert rayckpt.consolidate(str(tmp_path / "back"))["names"] == {"3": "three"}


def test_regroup_values_rebuilds_the_containers_rayckpt_stores_whole():
    paths = {
        "app.model.w": ("app", "model", "w"),
        "app.optim.state.w.step": ("app", "optim", "state", "w", "step"),
        "app.optim.param_groups.0.lr": ("app", "optim", "param_groups", 0, "lr"),
        "app.optim.param_groups.0.params": ("app", "optim", "param_groups", 0, "params"),
        "app.optim.param_groups.1.lr": ("app", "optim", "param_groups", 1, "lr"),
        "app.extra.step": ("app", "extra.step"),
        "flat": ("flat",),
    }
    values = {
        "app.optim.param_groups.0.lr": 0.1,
        "app.optim.param_groups.0.params": ["w"],
        "app.optim.param_groups.1.lr": 0.2,
        "app.extra.step": 3,
        "flat": "x",
        "no.path": 1,
    }
    out, out_paths = regroup_values(values, paths, ["app.model.w", "app.optim.state.w.step"])
    assert out == {
        "app.optim.param_groups": [{"lr": 0.1, "params": ["w"]}, {"lr": 0.2}],
        "app.extra.step": 3,
        "flat": "x",
        "no.path": 1,
    }
    # Each regrouped value keeps the path DCP recorded for it, cut where it is stored whole.
    assert out_paths == {
        "app.optim.param_groups": ("app", "optim", "param_groups"),
        "app.extra.step": ("app", "extra.step"),
        "flat": ("flat",),
    }


def test_torch_save_to_dcp_checkpoints_import(tmp_path):
    """A DCP checkpoint written by torch's own format_utils (nested dicts) converts."""
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    model = ToyModel()
    torch.save({"model": model.state_dict(), "epoch": 4}, str(tmp_path / "m.pt"))
    torch_save_to_dcp(str(tmp_path / "m.pt"), str(tmp_path / "dcp"))
    convert(str(tmp_path / "dcp"), str(tmp_path / "ckpt"), from_="dcp")
    fresh = {"model": ToyModel().state_dict(), "epoch": 0}
    rayckpt.load(fresh, str(tmp_path / "ckpt"))
    assert fresh["epoch"] == 4 and torch.equal(fresh["model"]["head.bias"], model.head.bias)


# ---------------------------------------------------------------------------
# Streaming: one tensor (or one bounded group) at a time


@pytest.mark.parametrize("fmt", FORMATS)
def test_exports_hold_one_tensor_at_a_time(ckpt, tmp_path, monkeypatch, fmt):
    stats = track_read_tensor(monkeypatch)
    convert(ckpt, str(tmp_path / "out"), to=fmt)
    assert stats == {"read": 10, "peak": 1}


def test_imports_load_bounded_groups(ckpt, tmp_path, monkeypatch):
    out = str(tmp_path / "dcp")
    convert(ckpt, out, to="dcp")
    groups = []
    original = dcp_dir.dcp_source

    def recording(src):
        source = original(src)

        def load(keys):
            groups.append(list(keys))
            return source.load(keys)

        return streaming.Source(
            format=source.format, tensors=source.tensors, values=source.values, load=load, paths=source.paths
        )

    monkeypatch.setattr(dcp_dir, "dcp_source", recording)
    convert(out, str(tmp_path / "back"), from_="dcp", group_bytes=160)
    sizes = {k: t.nbytes for k, t in make_state()["model"].items()}
    # each tensor is loaded once (the empty one has no bytes to load)
    assert sorted(k for g in groups for k in g) == sorted(f"model.{k}" for k, n in sizes.items() if n)
    assert all(len(g) == 1 or sum(sizes[k.removeprefix("model.")] for k in g) <= 160 for g in groups)
    assert len(groups) > 2
    assert_same_checkpoint(ckpt, str(tmp_path / "back"))


def test_progress_is_reported(ckpt, tmp_path):
    seen = []
    convert(ckpt, str(tmp_path / "o.pt"), to="torch", on_progress=lambda d, t: seen.append((d, t)))
    assert seen[-1][0] == seen[-1][1] == sum(t.nbytes for t in make_state()["model"].values())
    seen.clear()
    convert(str(tmp_path / "o.pt"), str(tmp_path / "back"), from_="torch", on_progress=lambda d, t: seen.append((d, t)))
    assert seen[-1][0] == seen[-1][1]


# ---------------------------------------------------------------------------
# Errors


def test_argument_errors(ckpt, tmp_path):
    with pytest.raises(ValueError, match="exactly one of --to FORMAT"):
        convert(ckpt, str(tmp_path / "x"))
    with pytest.raises(ValueError, match="exactly one of --to FORMAT"):
        convert(ckpt, str(tmp_path / "x"), to="dcp", from_="dcp")
    with pytest.raises(ValueError, match="unknown format 'onnx'; choose one of torch, dcp, safetensors"):
        convert(ckpt, str(tmp_path / "x"), to="onnx")
    with pytest.raises(ValueError, match=r"no key in .* starts with prefix 'nope\.'"):
        convert(ckpt, str(tmp_path / "x"), to="torch", prefix="nope.")
    with pytest.raises(ValueError, match="writes to a local path"):
        convert(ckpt, "mock://bucket/x", to="dcp")


def test_size_limits_must_be_positive(ckpt, tmp_path):
    with pytest.raises(ValueError, match="max_shard_bytes and group_bytes must be positive"):
        convert(ckpt, str(tmp_path / "x"), to="safetensors", max_shard_bytes=0)
    with pytest.raises(ValueError, match="max_shard_bytes and group_bytes must be positive"):
        convert(str(tmp_path / "x.pt"), str(tmp_path / "x"), from_="torch", group_bytes=-1)
    convert(ckpt, str(tmp_path / "x.pt"), to="torch")
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        convert(str(tmp_path / "x.pt"), str(tmp_path / "y"), from_="torch", block_size=0)


def test_safetensors_export_needs_tensors_with_a_safetensors_dtype(ckpt, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no tensor under prefix 'step' in"):
        convert(ckpt, str(tmp_path / "a"), to="safetensors", prefix="step")
    monkeypatch.delitem(safetensors_files.SAFETENSORS_DTYPES, "complex64")
    with pytest.raises(rayckpt.InvalidStateError, match="key 'model.z': safetensors has no dtype complex64"):
        convert(ckpt, str(tmp_path / "b"), to="safetensors")
    assert not (tmp_path / "b").exists()


def test_a_key_that_is_both_tensor_and_value_is_refused(tmp_path):
    source = streaming.Source(format="torch", tensors={"a": ("float32", (2,))}, values={"a": 1}, load=lambda keys: {})
    out = CheckpointDir.resolve(str(tmp_path / "o"))
    with pytest.raises(rayckpt.InvalidStateError, match="key 'a' is both a tensor and a value in src.pt"):
        streaming.import_source(source, out, "src.pt", streaming.ImportOptions(block_size=64, group_bytes=1024))


def test_existing_destination_is_refused(ckpt, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "a").write_text("x")
    with pytest.raises(ValueError, match="destination .*taken already exists"):
        convert(ckpt, str(tmp_path / "taken"), to="dcp")
    with pytest.raises(ValueError, match="already exists"):
        convert(ckpt, ckpt, from_="torch")
    (tmp_path / "empty").mkdir()
    convert(ckpt, str(tmp_path / "empty"), to="safetensors")  # an empty directory is fine


def test_bad_sources_are_named(ckpt, tmp_path):
    with pytest.raises(rayckpt.CheckpointNotFoundError, match="no such file"):
        convert(str(tmp_path / "nope.pt"), str(tmp_path / "o"), from_="torch")
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=r"garbage.pt is not a torch.save file that torch.load\(weights_only=True\)"):
        convert(str(tmp_path / "garbage.pt"), str(tmp_path / "o"), from_="torch")
    torch.save(torch.ones(2), str(tmp_path / "tensor.pt"))
    with pytest.raises(ValueError, match="holds a Tensor, not a state dict"):
        convert(str(tmp_path / "tensor.pt"), str(tmp_path / "o"), from_="torch")
    with pytest.raises(rayckpt.CheckpointNotFoundError, match=r"not a torch.distributed.checkpoint directory"):
        convert(ckpt, str(tmp_path / "o"), from_="dcp")
    with pytest.raises(rayckpt.CheckpointNotFoundError, match="no such directory"):
        convert(str(tmp_path / "nope"), str(tmp_path / "o"), from_="dcp")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        convert(str(tmp_path / "garbage.pt"), str(tmp_path / "o"), from_="safetensors")
    with pytest.raises(rayckpt.CheckpointNotFoundError, match=r"is not a rayckpt checkpoint"):
        convert(str(tmp_path), str(tmp_path / "o"), to="torch")
    with pytest.raises(rayckpt.CheckpointNotFoundError, match=r"ckpt is not a file"):
        convert(ckpt, str(tmp_path / "o"), from_="torch")
    with pytest.raises(rayckpt.CheckpointNotFoundError, match=r"garbage.pt is not a directory"):
        convert(str(tmp_path / "garbage.pt"), str(tmp_path / "o"), from_="dcp")
    with pytest.raises(rayckpt.CheckpointNotFoundError, match="holds no .safetensors file"):
        convert(ckpt, str(tmp_path / "o"), from_="safetensors")
    with pytest.raises(rayckpt.CheckpointNotFoundError, match="nope: no such file or directory"):
        convert(str(tmp_path / "nope"), str(tmp_path / "o"), from_="safetensors")
    torch.save({"x": torch.ones(2, dtype=torch.complex128)}, str(tmp_path / "c128.pt"))
    with pytest.raises(rayckpt.InvalidStateError, match="complex128"):
        convert(str(tmp_path / "c128.pt"), str(tmp_path / "o"), from_="torch")
    assert not (tmp_path / "o").exists()


def test_damaged_dcp_checkpoints_are_named(ckpt, tmp_path):
    out = tmp_path / "dcp"
    convert(ckpt, str(out), to="dcp")
    for name in os.listdir(out):
        if name.endswith(".distcp"):
            (out / name).write_bytes(b"garbage")
    with pytest.raises(rayckpt.RayckptError, match=r"reading .*dcp with dcp.load failed: "):
        convert(str(out), str(tmp_path / "o"), from_="dcp")
    (out / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(rayckpt.CorruptCheckpointError, match=r"\.metadata is not readable DCP metadata"):
        convert(str(out), str(tmp_path / "o"), from_="dcp")
    assert not (tmp_path / "o").exists()


def test_a_failed_export_removes_what_it_wrote(ckpt, tmp_path, monkeypatch):
    calls = 0
    original = tools.CheckpointReader.read_tensor

    def failing(self, key):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise rayckpt.CorruptCheckpointError("boom")
        return original(self, key)

    monkeypatch.setattr(tools.CheckpointReader, "read_tensor", failing)
    for fmt in FORMATS:
        calls = 0
        with pytest.raises(rayckpt.CorruptCheckpointError, match="boom"):
            convert(ckpt, str(tmp_path / fmt), to=fmt)
        assert not (tmp_path / fmt).exists(), fmt


def test_a_failed_import_leaves_nothing(ckpt, tmp_path, monkeypatch):
    out = str(tmp_path / "o.pt")
    convert(ckpt, out, to="torch")
    original = streaming._TensorStream.__call__
    calls = 0

    def failing(self, key, box):
        nonlocal calls
        calls += 1
        if calls == 4:
            raise OSError("disk full")
        return original(self, key, box)

    monkeypatch.setattr(streaming._TensorStream, "__call__", failing)
    with pytest.raises(rayckpt.SaveFailedError, match=r"rank 0: writing shard file .*back/.*\.arrow failed: disk full"):
        convert(out, str(tmp_path / "back"), from_="torch")
    assert not (tmp_path / "back").exists()


# ---------------------------------------------------------------------------
# DCP interop with FSDP2 on several ranks


def save_both_worker(rank: int, world_size: int, dcp_path: str, rk_path: str) -> dict:
    """Train FSDP2 + AdamW, then save the same state with torch's dcp.save and with rayckpt."""
    model, optim = build_fsdp(world_size, seed=0)
    train_steps(model, optim, 2, rank)
    app = AppState(model, optim, step=3)
    dcp.save({"app": app}, checkpoint_id=dcp_path)
    rayckpt.save({"app": app}, rk_path)
    return full_state(app)


def load_both_worker(rank: int, world_size: int, imported: str, exported: str) -> dict:
    """Load the DCP-imported checkpoint with rayckpt, and the rayckpt-exported DCP with torch's dcp.load."""
    model, optim = build_fsdp(world_size, seed=123)
    app = AppState(model, optim, step=0)
    info = rayckpt.load({"app": app}, imported)
    via_rayckpt = (full_state(app), app.extras["step"], info)
    model, optim = build_fsdp(world_size, seed=456)
    app = AppState(model, optim, step=0)
    dcp.load({"app": app}, checkpoint_id=exported)
    return {"rayckpt": via_rayckpt, "dcp": (full_state(app), app.extras["step"])}


@pytest.mark.slow
def test_fsdp_checkpoints_move_between_dcp_and_rayckpt_across_world_sizes(tmp_path):
    saved = run_ranks(save_both_worker, 2, str(tmp_path / "dcp_by_2"), str(tmp_path / "rk_by_2"))[0]
    imported = str(tmp_path / "imported")
    convert(str(tmp_path / "dcp_by_2"), imported, from_="dcp")
    exported = str(tmp_path / "exported_dcp")
    convert(str(tmp_path / "rk_by_2"), exported, to="dcp")
    # rayckpt's own checkpoint and the imported DCP one hold the same data
    assert_same_checkpoint(str(tmp_path / "rk_by_2"), imported)

    loaded = run_ranks(load_both_worker, 3, imported, exported)
    plan = rayckpt.plan(imported, 3)
    for rank, result in enumerate(loaded):
        for how in ("rayckpt", "dcp"):
            state, step = result[how][:2]
            assert step == 3, how
            assert state.keys() == saved.keys(), how
            for k, v in saved.items():
                assert torch.equal(state[k], v), (how, k)
        info = result["rayckpt"][2]
        r = plan.ranks[rank]
        assert (r.bytes_needed, r.bytes_read, r.reads) == (info.bytes_needed, info.bytes_read, info.num_reads)
