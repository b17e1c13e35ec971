"""Saves beside training, in one process on a real local Ray: what is copied late, the step that
waits for it, and the tensor changed during its copy that fails the save.

The background copy is held at a gate (``gated_copies``) so that the order of the copy, the
optimizer step and an in-place change is fixed by the test, not by the machine's speed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch

import rayckpt
from rayckpt.app_state import AppState
from rayckpt.engine.state import flatten
from rayckpt.ray.rank import async_save, staging
from rayckpt.ray.rank.loading import load as ray_load

pytestmark = pytest.mark.slow

#: Seconds a test lets a blocked step run to show it stays blocked (a wrong pass is possible on a
#: stalled machine, never a wrong failure).
BLOCKED_FOR_S = 0.5


@pytest.fixture
def gated_copies(monkeypatch) -> Iterator[threading.Event]:
    """Hold every piece the background thread copies until the returned event is set."""
    gate = threading.Event()
    copy_piece = staging.StagingBuffer.copy_piece

    def gated(self, piece, span, to_host):
        if threading.current_thread().name == "rayckpt-save-copy":
            gate.wait(60)
        return copy_piece(self, piece, span, to_host)

    monkeypatch.setattr(staging.StagingBuffer, "copy_piece", gated)
    yield gate
    gate.set()


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, opt)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(16, 64)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def snapshot(app: AppState) -> dict[str, torch.Tensor]:
    flat = flatten({"app": app})
    return {k: leaf.source.detach().clone() for k, leaf in flat.tensors.items()}


def loaded(path: str, run: str) -> dict[str, torch.Tensor]:
    model, opt = trained(seed=99)  # another state, overwritten by the load
    app = AppState(model, opt)
    ray_load({"app": app}, path, run=run)
    return snapshot(app)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_an_optimizers_tensors_are_copied_late_and_its_step_waits_for_the_copy(ray_session, tmp_path, gated_copies):
    model, opt = trained()
    app = AppState(model, opt)
    before = snapshot(app)
    path = str(tmp_path / "late")
    handle = async_save.save_async({"app": app}, path, run="late", step=1)
    state_bytes = sum(t.numel() * t.element_size() for t in before.values())
    assert not handle.copied() and 0 < handle.late_bytes <= state_bytes  # the rest copied before returning
    model(torch.randn(16, 64)).square().sum().backward()  # forward and backward run beside the copy
    stepped = threading.Event()
    stepper = threading.Thread(target=lambda: (opt.step(), stepped.set()))
    stepper.start()
    assert not stepped.wait(BLOCKED_FOR_S)  # the step waits: the copy is held at the gate
    gated_copies.set()
    stepper.join(60)
    assert stepped.is_set() and handle.copied() and handle.copy_seconds >= handle.stall_seconds
    assert handle.wait().status == "committed"
    assert_same(loaded(path, "late"), before)  # the state before the step, bit for bit
    assert not torch.equal(snapshot(app)["app.model.0.weight"], before["app.model.0.weight"])  # the step ran


def test_a_tensor_changed_in_place_during_its_copy_fails_the_save_and_keeps_the_previous_one(
    ray_session, tmp_path, gated_copies
):
    model, opt = trained()
    app = AppState(model, opt)
    path = str(tmp_path / "torn")
    gated_copies.set()
    async_save.save_async({"app": app}, path, run="torn", step=1).wait()
    first = snapshot(app)
    gated_copies.clear()
    train_step(model, opt)
    handle = async_save.save_async({"app": app}, path, run="torn", step=2)
    with torch.no_grad():
        model[2].bias.add_(1.0)  # an update outside the optimizer, while the copy is held
    gated_copies.set()
    with pytest.raises(rayckpt.SaveFailedError, match=r"key 'app\.model\.2\.bias' was changed in place"):
        handle.wait()
    assert_same(loaded(path, "torn"), first)  # the previous checkpoint is still the one there
    assert async_save.wait_inflight() is None  # heard once, from its own wait()


def test_a_failed_background_copy_fails_the_save_and_releases_the_step(ray_session, tmp_path, monkeypatch):
    model, opt = trained()
    copy_piece = staging.StagingBuffer.copy_piece

    def failing(self, piece, span, to_host):
        if threading.current_thread().name == "rayckpt-save-copy":
            raise OSError(5, "Input/output error (injected)")
        return copy_piece(self, piece, span, to_host)

    monkeypatch.setattr(staging.StagingBuffer, "copy_piece", failing)
    path = str(tmp_path / "failed")
    handle = async_save.save_async({"app": AppState(model, opt)}, path, run="failed", step=1)
    train_step(model, opt)  # returns: the failed copy does not hold the step
    with pytest.raises(rayckpt.SaveFailedError, match=r"staging: OSError: .*Input/output error \(injected\)"):
        handle.wait()
    assert not os.path.exists(os.path.join(path, "manifest.json"))


def test_other_tensors_are_copied_before_the_call_returns(ray_session, tmp_path, gated_copies):
    model, opt = trained()
    ema = torch.arange(32, dtype=torch.float32)  # no optimizer's: nothing guards it
    app = AppState(model, opt, ema=ema)
    optimizer_bytes = sum(
        t.numel() * t.element_size()
        for p in model.parameters()
        for t in (p, *(v for v in opt.state[p].values() if isinstance(v, torch.Tensor)))
    )
    path = str(tmp_path / "ema")
    handle = async_save.save_async({"app": app}, path, run="ema", step=1)
    assert handle.late_bytes == optimizer_bytes
    ema.add_(100.0)  # changed once the call returned: its copy is already made
    gated_copies.set()
    assert handle.wait().status == "committed"
    out = {"app": AppState(*trained(seed=5), ema=torch.zeros(32))}
    ray_load(out, path, run="ema")
    assert torch.equal(out["app"].extras["ema"], torch.arange(32, dtype=torch.float32))


def test_overlap_false_copies_everything_before_returning_and_all_copies_everything_late(
    ray_session, tmp_path, gated_copies
):
    state = {"w": torch.ones(1000), "b": torch.full((10,), 2.0)}
    handle = async_save.save_async(state, str(tmp_path / "sync"), run="modes", step=1, overlap=False)
    assert handle.copied() and handle.late_bytes == 0
    handle.wait()
    handle = async_save.save_async(state, str(tmp_path / "all"), run="modes", step=2, overlap="all")
    assert not handle.copied() and handle.late_bytes == 4 * 1010
    state["w"].mul_(3.0)  # "all": the caller keeps the state as it is until the copy is done
    gated_copies.set()
    with pytest.raises(rayckpt.SaveFailedError, match=r"key 'w' was changed in place"):
        handle.wait()


def test_unknown_overlap_values_are_refused(ray_session, tmp_path):
    with pytest.raises(ValueError, match=r"overlap='sometimes': expected True, False or 'all'"):
        async_save.save_async({"w": torch.ones(4)}, str(tmp_path / "x"), run="bad", overlap="sometimes")
    assert not os.path.exists(tmp_path / "x")
