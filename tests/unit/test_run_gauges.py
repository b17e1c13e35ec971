"""The gauges the MetadataActor keeps set per run and tier, and what it records of each save: without Ray
(``metrics.observe`` captured)."""

from __future__ import annotations

import asyncio

import pytest

from rayckpt.ray import metrics
from rayckpt.ray.metadata import actor as metadata_actor
from rayckpt.ray.metadata.run_gauges import RunGauges
from rayckpt.ray.metadata.save_log import SaveLog
from rayckpt.ray.records import run_and_tier, tracked_run


@pytest.fixture
def seen(monkeypatch):
    got: list[tuple[str, float, dict]] = []
    monkeypatch.setattr(metrics, "observe", lambda name, value, **tags: got.append((name, value, tags)))
    return got


def last(seen, name: str, **tags) -> float:
    values = [v for n, v, t in seen if n == name and all(t.get(k) == w for k, w in tags.items())]
    assert values, f"{name} {tags} never set"
    return values[-1]


def test_tracked_runs_split_into_run_and_tier():
    assert tracked_run("gpt", "memory") == "gpt@memory" and tracked_run("gpt", "storage") == "gpt"
    assert run_and_tier("gpt@memory") == ("gpt", "memory") and run_and_tier("gpt") == ("gpt", "storage")
    assert run_and_tier("a@b") == ("a@b", "storage")


def test_age_and_commit_time_per_tier_are_set_again_between_saves(seen):
    gauges = RunGauges(runs=4)
    gauges.committed("gpt@memory", 7, "mem/gpt/rayckpt-step-00000007", at=1000.0)
    gauges.committed("gpt", 5, "/c/gpt/rayckpt-step-00000005", at=990.0)
    gauges.committed("gpt", 4, "/c/gpt/rayckpt-step-00000004", at=980.0)  # older: found late on storage
    seen.clear()
    gauges.refresh({}, now=1012.5)
    assert last(seen, "rayckpt_last_commit_timestamp_seconds", run="gpt", tier="memory") == 1000.0
    assert last(seen, "rayckpt_checkpoint_age_seconds", run="gpt", tier="memory") == 12.5
    assert last(seen, "rayckpt_checkpoint_age_seconds", run="gpt", tier="storage") == 22.5
    gauges.refresh({}, now=1020.0)  # nothing happened: the age moved on
    assert last(seen, "rayckpt_checkpoint_age_seconds", run="gpt", tier="memory") == 20.0
    gauges.committed("gpt@memory", 8, "mem/gpt/rayckpt-step-00000008", at=1021.0)
    gauges.refresh({}, now=1021.5)
    assert last(seen, "rayckpt_checkpoint_age_seconds", run="gpt", tier="memory") == 0.5
    assert gauges.newest()[("gpt", "memory")].step == 8 and gauges.newest()[("gpt", "storage")].step == 5


def test_saves_in_flight_fall_back_to_zero_and_throughput_stays_set(seen):
    gauges = RunGauges(runs=4)
    gauges.throughput("gpt@memory", 5e8)
    gauges.refresh({"gpt": 2, "gpt@memory": 1})
    assert last(seen, "rayckpt_saves_in_flight", run="gpt", tier="storage") == 2
    assert last(seen, "rayckpt_saves_in_flight", run="gpt", tier="memory") == 1
    seen.clear()
    gauges.refresh({})
    assert last(seen, "rayckpt_saves_in_flight", run="gpt", tier="storage") == 0  # not left at 2
    assert last(seen, "rayckpt_write_throughput_bytes_per_second", run="gpt", tier="memory") == 5e8


def test_the_actor_refreshes_its_gauges_until_stopped(seen, monkeypatch):
    """Ray's export drops a gauge not set for two report intervals: the actor sets them again and again."""
    monkeypatch.setattr(metadata_actor, "_GAUGE_REFRESH_S", 0.01)
    monkeypatch.setattr(metadata_actor, "install_dashboard_soon", lambda: None)

    async def scenario() -> None:
        actor = metadata_actor.MetadataActor()
        actor._gauges.committed("gpt", 3, "/c/gpt/rayckpt-step-00000003", at=1.0)
        actor._keep_gauges()
        await asyncio.sleep(0.2)
        actor._gauge_refresher.cancel()

    asyncio.run(scenario())
    ages = [v for n, v, t in seen if n == "rayckpt_checkpoint_age_seconds"]
    assert len(ages) >= 4 and ages == sorted(ages)


def test_the_save_log_keeps_each_save_s_moments_whatever_its_ranks():
    log = SaveLog(runs=2, per_run=2)
    log.heard("s1", "gpt@memory", 4, at=10.0, registered=True)
    log.written("s1", 10.5, 0.25, 100)
    log.written("s1", 10.75, 0.75, 100)  # staged first, written last
    log.stalled("s1", 0.125)
    log.stalled("s1", 0.0625)
    log.settled("s1", "gpt@memory", 4, at=11.0, status="committed", error=None)
    log.heard("s2", "gpt", 5, at=12.0)  # a rank's report before the registration
    (s1, s2) = log.of_run("gpt")
    assert (s1["tier"], s1["step"], s1["status"], s1["settled"]) == ("memory", 4, "committed", 11.0)
    assert (s1["staged"], s1["written"], s1["ranks_written"], s1["bytes"], s1["stall"]) == (10.0, 10.75, 2, 200, 0.125)
    assert (s2["tier"], s2["registered"], s2["status"], s2["written"]) == ("storage", None, "pending", None)
    log.stalled("never-heard", 1.0)  # a late or foreign report is dropped, not an error
    for i in range(3):
        log.heard(f"t{i}", "gpt", 10 + i, at=20.0 + i)
    assert [s["save_id"] for s in log.of_run("gpt") if s["tier"] == "storage"] == ["t1", "t2"]  # 2 kept per run
    assert len(log) == 3
    log.heard("x", "other", 1, at=30.0)
    log.heard("y", "third", 1, at=31.0)  # 2 runs kept: gpt@memory, the least recently active, goes, then gpt
    assert log.of_run("gpt") == [] and log.runs() == ["other", "third"] and len(log) == 2
