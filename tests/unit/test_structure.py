"""The saved state dict's structure survives: consolidate, torch and DCP exports and imports, bytes values."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import rayckpt
from rayckpt.tools import CheckpointReader
from rayckpt.tools.convert import convert


def make_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        # a module's state_dict: one dict key with dots in it per parameter
        "model": {"layers.0.weight": torch.randn(3, 2, generator=g), "layers.0.bias": torch.randn(3, generator=g)},
        # a plain optimizer's state_dict: int keys, a list of param groups
        "optim": {
            "state": {0: {"exp_avg": torch.randn(3, 2, generator=g), "step": torch.tensor(4.0)}},
            "param_groups": [{"lr": 0.1, "params": [0, 1]}],
        },
        "extra": {"a.b": {"c": torch.arange(3)}, "seq": [torch.ones(2), {"x": torch.zeros(1)}]},
        "step": 7,
        "rng": b"\x00\x01\xfe\xff",
        "losses": io.BytesIO(b"bytes of torch.save([0.5, 0.25])"),
    }


def assert_same(got, want, path="") -> None:
    """Equal in structure, types (dict keys included) and bits."""
    assert type(got) is type(want), path
    if isinstance(want, dict):
        assert {(k, type(k)) for k in got} == {(k, type(k)) for k in want}, path
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{path}.{i}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), path
    elif isinstance(want, io.BytesIO):
        assert got.getvalue() == want.getvalue() and got.tell() == 0, path
    else:
        assert got == want, path


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ckpt")
    rayckpt.save(make_state(), path)
    return path


def test_consolidate_rebuilds_the_exact_structure_that_was_saved(ckpt):
    assert_same(rayckpt.consolidate(ckpt), make_state())
    assert_same(rayckpt.consolidate(ckpt, prefix="model."), make_state()["model"])  # a model's state_dict
    assert_same(rayckpt.consolidate(ckpt, prefix="optim.state."), make_state()["optim"]["state"])
    flat = rayckpt.consolidate(ckpt, flat=True)
    assert "model.layers.0.weight" in flat and flat["optim.state.0.step"] == torch.tensor(4.0)


def test_bytes_values_round_trip_in_place_and_in_statefuls(ckpt, tmp_path):
    class TrainState:  # as DCP's e2e test keeps its losses: torch.save into a BytesIO
        def __init__(self, losses):
            self.losses = losses

        def state_dict(self):
            buf = io.BytesIO()
            torch.save(self.losses, buf)
            return {"losses": buf, "rng": torch.get_rng_state().numpy().tobytes()}

        def load_state_dict(self, sd):
            self.losses = torch.load(sd["losses"], weights_only=True)
            self.rng = sd["rng"]

    path = str(tmp_path / "train")
    saved = TrainState([0.5, 0.25])
    rayckpt.save({"train": saved}, path)
    back = TrainState([])
    rayckpt.load({"train": back}, path)
    assert back.losses == [0.5, 0.25] and back.rng == torch.get_rng_state().numpy().tobytes()

    target = make_state()
    target.update(rng=b"", losses=io.BytesIO())
    rayckpt.load(target, ckpt)
    assert target["rng"] == b"\x00\x01\xfe\xff" and type(target["losses"]) is io.BytesIO
    assert target["losses"].getvalue() == make_state()["losses"].getvalue()


def test_torch_export_is_nested_as_saved_and_imports_keep_it(ckpt, tmp_path):
    out = str(tmp_path / "full.pt")
    convert(ckpt, out, to="torch", prefix="optim.")
    assert_same(torch.load(out, weights_only=True), make_state()["optim"])
    out = str(tmp_path / "all.pt")
    convert(ckpt, out, to="torch")
    with torch.serialization.safe_globals([io.BytesIO]):  # weights_only needs BytesIO allowed
        full = torch.load(out, weights_only=True)
    assert_same(full, make_state())
    torch.save(make_state()["model"], str(tmp_path / "model.pt"))
    convert(str(tmp_path / "model.pt"), str(tmp_path / "back"), from_="torch", prefix="app.model.")
    assert_same(rayckpt.consolidate(str(tmp_path / "back")), {"app": {"model": make_state()["model"]}})


def test_dcp_export_records_dcps_own_paths_and_imports_keep_them(ckpt, tmp_path):
    out = str(tmp_path / "dcp")
    convert(ckpt, out, to="dcp")
    planner_data = FileSystemReader(out).read_metadata().planner_data
    assert planner_data["model.layers.0.weight"] == ("model", "layers.0.weight")
    assert planner_data["extra.seq.1.x"] == ("extra", "seq", 1, "x")
    assert planner_data["extra.a.b.c"] == ("extra", "a.b", "c")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(out, str(tmp_path / "via_torch.pt"))
        full = torch.load(str(tmp_path / "via_torch.pt"), weights_only=False)
    want = make_state()
    want["optim"]["state"] = {"0": want["optim"]["state"][0]}  # DCP's own limit: str(key) in paths
    want["losses"].seek(0)
    full["losses"].seek(0)
    assert_same(full, want)
    convert(out, str(tmp_path / "back"), from_="dcp")
    m = CheckpointReader(str(tmp_path / "back")).manifest
    assert m.path("extra.a.b.c") == ("extra", "a.b", "c") and m.path("optim.param_groups") == ("optim", "param_groups")
    assert_same(rayckpt.consolidate(str(tmp_path / "back")), want)
