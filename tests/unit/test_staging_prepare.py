"""``StagingBuffer.prepare``: the buffer made (and page-locked) in the background, without Ray."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from rayckpt.ray.rank import staging
from rayckpt.ray.rank.staging import StagingBuffer, StagingUnavailable, granules
from rayckpt.ray.writer.regions import open_region


@pytest.fixture
def buffer(tmp_path):
    b = StagingBuffer(str(tmp_path))
    yield b
    b.close()


def descriptors_of(name: str) -> list[str]:
    """This process's descriptors of the (unlinked) file ``name``."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == f"{name} (deleted)":
                held.append(fd)
        except OSError:
            pass
    return held


@pytest.fixture
def held_create(monkeypatch):
    """``StagingBuffer._create`` held until the returned event is set (what it made is recorded)."""
    go, made = threading.Event(), []
    create = StagingBuffer._create

    def held(self, size):
        go.wait(30)
        made.append(create(self, size))
        return made[-1]

    monkeypatch.setattr(StagingBuffer, "_create", held)
    return go, made


def test_prepare_returns_before_the_buffer_exists_and_the_next_stage_lands_in_it(buffer, held_create):
    go, made = held_create
    assert buffer.prepare(3 << 20) == 3 << 20
    assert buffer.preparing and buffer.path is None and buffer.holds(3 << 20) and not buffer.holds((3 << 20) + 1)
    go.set()
    pieces = [torch.arange(1000, dtype=torch.float64), torch.ones(7, dtype=torch.int32)]
    region = buffer.stage(pieces, "n")  # waits for what is left of the prepare
    assert not buffer.preparing and buffer.name == made[0].name and buffer.capacity == 3 << 20
    with open_region(region) as views:
        assert [bytes(v) for v in views] == [p.numpy().tobytes() for p in pieces]


def test_prepare_of_a_size_the_buffer_holds_does_nothing(buffer):
    buffer.reserve(2 << 20)
    name = buffer.name
    assert buffer.prepare(1 << 20) == 2 << 20 and not buffer.preparing and buffer.name == name


def test_prepare_pins_for_the_pieces_device_in_the_background_and_close_unpins(buffer, monkeypatch):
    pinned, unpinned = [], []
    device = torch.device("cuda", 3)

    def pin(mapping, dev):
        pinned.append((len(mapping), dev, threading.current_thread().name))
        return 0xABC000

    monkeypatch.setattr(staging, "pin_host_memory", pin)
    monkeypatch.setattr(staging, "unpin_host_memory", unpinned.append)
    buffer.prepare(1 << 20, pin=device)
    buffer.ready()
    assert pinned == [(1 << 20, device, "rayckpt-staging-prepare")] and buffer._pinned == 0xABC000
    # a buffer that holds the size but is not page-locked yet is pinned where it is
    buffer.close()
    assert unpinned == [0xABC000]
    buffer.reserve(1 << 20)
    name = buffer.name
    buffer.prepare(1 << 20, pin=device)
    buffer.ready()
    assert buffer.name == name and len(pinned) == 2 and buffer._pinned == 0xABC000
    assert buffer.prepare(1 << 20, pin=device) == 1 << 20 and not buffer.preparing  # pinned already
    buffer.close()  # here, while unpinning is still the fake one
    assert unpinned == [0xABC000, 0xABC000]


def test_a_mapping_cuda_refuses_to_pin_is_not_tried_again(buffer, monkeypatch):
    tries = []
    monkeypatch.setattr(staging, "pin_host_memory", lambda mapping, dev: tries.append(dev) or 0)  # refused
    monkeypatch.setattr(staging, "needs_bounce", lambda t: True)  # the device branch, on the CPU
    device = torch.device("cuda", 1)
    buffer.prepare(1 << 20, pin=device)
    buffer.ready()
    assert tries == [device] and buffer.pin_refused and buffer._pinned == 0
    assert buffer.prepare(1 << 20, pin=device) == 1 << 20 and not buffer.preparing  # no new background try
    piece = torch.arange(1000, dtype=torch.float32)
    for _ in range(2):
        region = buffer.stage([piece], "n")
        with open_region(region) as views:
            assert bytes(views[0]) == piece.numpy().tobytes()  # staged all the same
    assert len(tries) == 1


def test_a_prepare_that_fails_raises_from_the_next_stage_and_leaves_nothing(buffer, tmp_path, monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(staging.os, "posix_fallocate", no_room)
    buffer.prepare(5 << 20)
    with pytest.raises(StagingUnavailable, match=r"cannot reserve 5242880 bytes of shared memory in .*No space left"):
        buffer.stage([torch.ones(4)], "n")
    assert buffer.path is None and not buffer.preparing and os.listdir(tmp_path) == []
    monkeypatch.undo()
    assert buffer.stage([torch.ones(4)], "n").path == buffer.path  # the buffer is usable again


def test_a_directory_that_cannot_hold_a_file_is_refused_at_once(tmp_path):
    missing = StagingBuffer(str(tmp_path / "missing"))
    refused = r"cannot create a staging file in .*missing .*not a writable directory"
    with pytest.raises(StagingUnavailable, match=refused):
        missing.prepare(1 << 20)
    assert not missing.preparing


def test_close_during_a_prepare_waits_and_closes_what_it_made(buffer, held_create):
    go, made = held_create
    buffer.prepare(1 << 20)
    go.set()
    buffer.close()
    assert made and descriptors_of(made[0].name) == [] and buffer.path is None and not buffer.preparing


def test_a_prepare_to_grow_replaces_the_buffer_once_ready(buffer):
    buffer.reserve(1 << 20)
    small = buffer.name
    assert buffer.prepare((1 << 20) + 1) == granules((1 << 20) + 1) == 2 << 20
    buffer.ready()
    assert buffer.name != small and buffer.capacity == 2 << 20 and descriptors_of(small) == []
