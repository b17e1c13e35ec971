"""Per-phase timing of a save and a load (``rayckpt.phases``; ``SaveInfo.phases``, ``LoadInfo.phases``)."""

from __future__ import annotations

import logging

import pytest
import torch

import rayckpt
from rayckpt import phases


class FakeClock:
    """``time.perf_counter`` that moves only when told: phase times exact, no sleeps."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_are_exclusive_and_add_up_to_the_total(monkeypatch):
    clock_time = FakeClock()
    monkeypatch.setattr(phases.time, "perf_counter", clock_time)
    with phases.timed() as clock:
        clock_time.now += 0.5  # before any phase: "other"
        with phases.phase("outer"):
            clock_time.now += 2.0
            with phases.phase("inner"):
                clock_time.now += 3.0
            clock_time.now += 1.0
        with phases.phase("inner"):
            clock_time.now += 1.0
        clock.add("work_threads", 5.0)  # thread-seconds: reported, not part of the total
    out = clock.result()
    assert out == {"outer": 3.0, "inner": 4.0, "work_threads": 5.0, "other": 0.5, "total": 7.5}


def test_a_mark_outside_a_timed_operation_does_nothing_and_nested_timing_keeps_the_outer_clock():
    with phases.phase("nowhere"):
        pass
    assert phases.current() is None
    with phases.timed() as outer, phases.timed() as inner:
        assert inner is outer


def state() -> dict:
    return {"w": torch.arange(100_000, dtype=torch.float32), "b": torch.ones(10), "step": 3}


def test_save_and_load_report_their_phases_and_log_them_at_debug(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="rayckpt.phases")
    info = rayckpt.save(state(), str(tmp_path / "c"))
    for name in ("plan", "lease_claim", "write", "fsync", "manifest_write", "sweep", "lease_release"):
        assert name in info.phases, name  # each phase marked (a fast one may round to 0.0 s)
    assert info.phases["total"] > 0 and info.phases["write"] > 0
    assert sum(v for k, v in info.phases.items() if k != "total") == pytest.approx(info.phases["total"], abs=1e-4)
    target = {"w": torch.zeros(100_000), "b": torch.zeros(10), "step": 0}
    loaded = rayckpt.load(target, str(tmp_path / "c"))
    for name in ("plan", "manifest_read", "check", "read", "verify"):
        assert name in loaded.phases, name
    assert loaded.phases["total"] > 0
    assert torch.equal(target["w"], state()["w"])
    lines = [r.getMessage() for r in caplog.records if r.name == "rayckpt.phases"]
    assert any(line.startswith("rayckpt: save to ") and " on rank 0: " in line and "write " in line for line in lines)
    assert any(line.startswith("rayckpt: load from ") and "verify " in line for line in lines)


def test_a_failed_save_still_raises_and_leaves_no_clock_behind(tmp_path):
    with pytest.raises(rayckpt.InvalidStateError, match="key 'bad' has type object"):
        rayckpt.save({"bad": object()}, str(tmp_path / "c"))
    assert phases.current() is None
