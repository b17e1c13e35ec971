"""Per-phase timing of a save and a load (``rayckpt.phases``; ``SaveInfo.phases``, ``LoadInfo.phases``)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import rayckpt
from rayckpt import phases


def test_phases_are_exclusive_and_add_up_to_the_total():
    with phases.timed() as clock:
        with phases.phase("outer"):
            time.sleep(0.02)
            with phases.phase("inner"):
                time.sleep(0.03)
            time.sleep(0.01)
        with phases.phase("inner"):
            time.sleep(0.01)
        clock.add("work_threads", 5.0)  # thread-seconds: reported, not part of the total
    out = clock.result()
    assert out["inner"] == pytest.approx(0.04, abs=0.02)
    assert out["outer"] == pytest.approx(0.03, abs=0.02)  # the inner phase's time is not counted twice
    assert out["work_threads"] == 5.0
    parts = sum(v for k, v in out.items() if k not in ("total", "work_threads"))
    assert parts == pytest.approx(out["total"], abs=1e-6)


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
    for name in ("plan", "lease_claim", "write", "fsync", "manifest_write", "sweep", "lease_release", "total"):
        assert info.phases.get(name, 0) > 0, name
    assert sum(v for k, v in info.phases.items() if k != "total") == pytest.approx(info.phases["total"], abs=1e-4)
    target = {"w": torch.zeros(100_000), "b": torch.zeros(10), "step": 0}
    loaded = rayckpt.load(target, str(tmp_path / "c"))
    for name in ("plan", "manifest_read", "check", "read", "verify", "total"):
        assert loaded.phases.get(name, 0) > 0, name
    assert torch.equal(target["w"], state()["w"])
    lines = [r.getMessage() for r in caplog.records if r.name == "rayckpt.phases"]
    assert any(line.startswith("rayckpt: save to ") and " on rank 0: " in line and "write " in line for line in lines)
    assert any(line.startswith("rayckpt: load from ") and "verify " in line for line in lines)


def test_a_failed_save_still_raises_and_leaves_no_clock_behind(tmp_path):
    with pytest.raises(rayckpt.InvalidStateError, match="key 'bad' has type object"):
        rayckpt.save({"bad": object()}, str(tmp_path / "c"))
    assert phases.current() is None
