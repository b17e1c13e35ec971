"""The load's per-rank figures go to Ray's metrics through the MetadataActor (``metrics.send``), tagged by run and
rank; that they reach a real Prometheus is tests/e2e/test_e2e.py's."""

from __future__ import annotations

import pytest
import torch

import rayckpt
from rayckpt.ray.rank import loading as ray_load_module

pytestmark = pytest.mark.slow


def test_load_records_requests_and_bytes_per_rank(ray_session, tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    state = {"a": torch.arange(5000, dtype=torch.float32), "b": torch.arange(300, dtype=torch.int64)}
    rayckpt.save(state, path)
    recorded: dict[str, tuple[float, dict]] = {}

    def send(name: str, value: float, **tags) -> None:
        recorded[name] = (value, tags)

    monkeypatch.setattr(ray_load_module.metrics, "send", send)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    info = ray_load_module.load(target, path, run="metrics-run")
    assert torch.equal(target["a"], state["a"]) and torch.equal(target["b"], state["b"])
    tags = {"run": "metrics-run", "rank": 0}
    seconds, seconds_tags = recorded.pop("rayckpt_load_seconds")
    assert seconds > 0 and seconds_tags == tags
    assert recorded == {
        "rayckpt_bytes_read": (info.bytes_read, tags),
        "rayckpt_bytes_needed": (info.bytes_needed, tags),
        "rayckpt_bytes_fetched": (info.bytes_fetched, tags),
        "rayckpt_read_requests": (info.requests, tags),
    }
    assert info.requests == 2 and info.bytes_fetched == info.bytes_read == info.bytes_needed == 5000 * 4 + 300 * 8
