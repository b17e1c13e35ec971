"""Copies to and from device tensors (engine/device.py), their host-side logic run on the CPU.

No CUDA here: the device branches are forced onto CPU tensors (``force=True`` or
``needs_bounce`` patched), which runs the real slot, bound and ordering logic
with real copies; the CUDA streams themselves are tested in tests/gpu.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rayckpt
from rayckpt.engine import device, reader, writer
from rayckpt.engine.device import DeviceToHost, HostToDevice, bounded_pieces, host_like, needs_bounce
from rayckpt.format.shard_file import ShardReader
from rayckpt.ray.rank import staging
from rayckpt.ray.rank.staging import StagingBuffer
from rayckpt.ray.writer.regions import open_region
from tests.helpers.checkpoints import make_state


def zeros_like_state(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0, "config": None}


def test_only_tensors_outside_host_memory_need_a_bounce():
    assert not needs_bounce(torch.ones(3))
    assert needs_bounce(torch.ones(3, device="meta"))


@pytest.mark.parametrize(
    ("shape", "max_bytes", "pieces"),
    [
        ((37, 5), 64, 13),  # rows of 20 bytes: 3 rows a piece
        ((3, 40), 64, 9),  # rows of 160 bytes: each split into 16 + 16 + 8 elements
        ((), 1, 1),  # a scalar is one piece whatever the bound
        ((4, 4), 1024, 1),  # small enough: one piece
    ],
)
def test_bounded_pieces_cover_the_copy_in_pieces_within_the_bound(shape, max_bytes, pieces):
    src = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    dst = torch.zeros(shape)
    got = list(bounded_pieces(dst, src, max_bytes))
    assert len(got) == pieces
    for d, s in got:
        assert d.shape == s.shape and (s.numel() * 4 <= max_bytes or s.dim() == 0)
        d.copy_(s)
    assert torch.equal(dst, src)


def test_a_forced_bounce_copies_strided_tensors_through_bounded_slots():
    src = torch.arange(600.0).reshape(20, 30)[:, ::3]  # strided host bytes
    target = torch.zeros(25, 10)
    dst = target.t()[:, :20]  # a strided target region (10 x 20)
    h = HostToDevice(slot_bytes=64, slots=2, force=True)
    h.copy(dst, src.t())
    assert torch.equal(dst, src.t()) and target[20:].eq(0).all()
    assert h.pieces == 10 * 2 and h.peak_slot_bytes <= 64  # rows of 80 bytes: 16 + 4 elements each
    h.finish()
    assert h._slots == [None, None]


def test_a_cpu_target_is_copied_directly_without_a_slot(monkeypatch):
    monkeypatch.setattr(HostToDevice, "_copy_piece", lambda *a: pytest.fail("a CPU target went through a slot"))
    dst, h = torch.zeros(4), HostToDevice()
    h.copy(dst, torch.ones(4))
    assert torch.equal(dst, torch.ones(4)) and h.peak_slot_bytes == 0


def spy(monkeypatch, cls, name) -> list:
    calls: list = []
    real = getattr(cls, name)

    def wrapped(self, *args):
        calls.append(name)
        return real(self, *args)

    monkeypatch.setattr(cls, name, wrapped)
    return calls


def test_a_load_into_cpu_targets_reads_straight_into_them(tmp_path, monkeypatch):
    path, state = str(tmp_path / "c"), make_state()
    rayckpt.save(state, path, block_size=32)
    pieces, direct = spy(monkeypatch, HostToDevice, "_copy_piece"), spy(monkeypatch, ShardReader, "read_direct")
    target = zeros_like_state(state)
    rayckpt.load(target, path)
    assert torch.equal(target["model"]["w"], state["model"]["w"])
    assert direct and not pieces


def force_device(monkeypatch) -> None:
    """Every tensor is treated as a device tensor: the bounce and side-stream paths run on the CPU."""
    for module in (device, reader, writer, staging):
        monkeypatch.setattr(module, "needs_bounce", lambda t: True)


def test_a_load_into_device_targets_goes_through_the_bounce_and_is_exact(tmp_path, monkeypatch):
    path, state = str(tmp_path / "c"), make_state()
    rayckpt.save(state, path, block_size=32)
    force_device(monkeypatch)
    monkeypatch.setattr(device, "BOUNCE_BYTES", 48)
    pieces, direct = spy(monkeypatch, HostToDevice, "_copy_piece"), spy(monkeypatch, ShardReader, "read_direct")
    finished = spy(monkeypatch, HostToDevice, "finish")
    target = zeros_like_state(state)
    rayckpt.load(target, path)
    for k, v in state["model"].items():
        assert torch.equal(target["model"][k], v), k
    assert not direct and len(pieces) >= 37 * 5 * 4 // 48 and finished == ["finish"]


def test_a_save_of_device_tensors_copies_them_to_host_then_waits_once(tmp_path, monkeypatch):
    force_device(monkeypatch)
    calls: list[str] = []
    for name in ("copy", "wait"):
        real = getattr(DeviceToHost, name)
        monkeypatch.setattr(DeviceToHost, name, lambda self, *a, _r=real, _n=name: calls.append(_n) or _r(self, *a))
    state = make_state()
    path = str(tmp_path / "c")
    rayckpt.save(state, path, block_size=32)
    assert calls == ["copy"] * len(state["model"]) + ["wait"]
    target = zeros_like_state(state)
    monkeypatch.undo()
    rayckpt.load(target, path)
    for k, v in state["model"].items():
        assert torch.equal(target["model"][k], v), k


def gathers_at_wait(monkeypatch) -> list[int]:
    """``DeviceToHost.gathers`` of each instance when it is waited on."""
    seen: list[int] = []
    real = DeviceToHost.wait
    monkeypatch.setattr(DeviceToHost, "wait", lambda self: seen.append(self.gathers) or real(self))
    return seen


def test_a_strided_device_piece_is_made_contiguous_on_its_device_before_the_copy_to_host():
    """CUDA refuses a strided device-to-host copy into registered page-locked memory (the staging buffer)."""
    strided = torch.arange(12.0).reshape(3, 4).t()
    to_host = DeviceToHost(force=True)
    dst = host_like(strided)
    to_host.copy(dst, strided)
    to_host.copy(host_like(strided[0]), torch.arange(3.0))  # contiguous: copied as it is
    to_host.wait()
    assert torch.equal(dst, strided) and dst.is_contiguous()
    assert (to_host.copies, to_host.gathers) == (2, 1)


def test_a_save_of_strided_device_pieces_is_exact(tmp_path, monkeypatch):
    """``cpu_leaves`` (the engine's save) and ``host_like``: a transposed device weight."""
    force_device(monkeypatch)
    waited = gathers_at_wait(monkeypatch)
    w = torch.arange(40 * 30, dtype=torch.float32).reshape(40, 30).t()
    path = str(tmp_path / "c")
    rayckpt.save({"w": w, "b": torch.ones(5)}, path)
    assert waited == [1]
    monkeypatch.undo()
    target = {"w": torch.zeros(30, 40), "b": torch.zeros(5)}
    rayckpt.load(target, path)
    assert torch.equal(target["w"], w) and torch.equal(target["b"], torch.ones(5))


def test_host_memory_for_a_cpu_tensor_is_not_pinned():
    t = torch.ones(3, 4).t()
    h = host_like(t)
    assert h.shape == t.shape and h.is_contiguous() and not h.is_pinned()


def test_staging_device_pieces_copies_them_and_waits_before_returning(tmp_path, monkeypatch):
    force_device(monkeypatch)
    calls: list[str] = []
    for name in ("copy", "wait"):
        real = getattr(DeviceToHost, name)
        monkeypatch.setattr(DeviceToHost, name, lambda self, *a, _r=real, _n=name: calls.append(_n) or _r(self, *a))
    pieces = [torch.arange(10.0), torch.arange(12, dtype=torch.int64).reshape(3, 4).t()]
    waited = gathers_at_wait(monkeypatch)
    buf = StagingBuffer(str(tmp_path))
    try:
        region = buf.stage(pieces, "node")
        assert calls == ["copy", "copy", "wait"]
        assert waited == [1]  # the strided piece was made contiguous on its device before its copy
        assert buf._pinned == 0  # no CUDA: the mapping stays pageable
        with open_region(region) as views:
            for view, p in zip(views, pieces):
                assert bytes(view) == p.contiguous().numpy().tobytes()
    finally:
        buf.close()
