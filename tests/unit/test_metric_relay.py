"""How metrics leave a process: ``record`` by the metric's kind, ``send`` to the MetadataActor, and ``keep_set``'s
gauge set again while its owner lives (without Ray: the recording calls captured)."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from rayckpt.ray import metrics


@pytest.fixture
def recorded(monkeypatch):
    got: list[tuple[str, str, float, dict]] = []
    monkeypatch.setattr(metrics, "inc", lambda name, value=1.0, **tags: got.append(("inc", name, value, tags)))
    monkeypatch.setattr(metrics, "observe", lambda name, value, **tags: got.append(("observe", name, value, tags)))
    return got


def test_record_increments_counters_and_observes_histograms_and_gauges(recorded):
    metrics.record("rayckpt_bytes_read", 10, run="r", rank=1)
    metrics.record("rayckpt_restore_seconds", 0.5, run="r", tier="memory")
    metrics.record("rayckpt_run_active", 1, run="r")
    assert [(how, name) for how, name, *_ in recorded] == [
        ("inc", "rayckpt_bytes_read"),
        ("observe", "rayckpt_restore_seconds"),
        ("observe", "rayckpt_run_active"),
    ]
    with pytest.raises(KeyError, match="no rayckpt metric 'rayckpt_nope'"):
        metrics.record("rayckpt_nope", 1)


def test_send_outside_ray_does_nothing(recorded):
    metrics.send("rayckpt_restore_seconds", 0.5, run="r", tier="memory")
    assert recorded == [] and metrics._OUTBOX == []


def wait_for(condition, what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_keep_set_sets_the_gauge_again_while_its_owner_lives_and_stops_after(recorded, monkeypatch):
    monkeypatch.setattr(metrics, "_get", lambda name: object())  # as under Ray: the gauge exists
    monkeypatch.setattr(metrics, "KEEP_SET_EVERY_S", 0.01)

    class Owner:
        pass

    owner = Owner()
    metrics.keep_set("rayckpt_run_active", 1, owner, run="r")
    sets = lambda: [r for r in recorded if r[1] == "rayckpt_run_active"]  # noqa: E731
    wait_for(lambda: len(sets()) >= 3, "the gauge was not set again")
    assert set(map(repr, sets())) == {repr(("observe", "rayckpt_run_active", 1, {"run": "r"}))}
    del owner
    gc.collect()
    wait_for(lambda: not metrics._KEEPER, "the thread still sets the gauge of an owner that is gone")
    assert metrics._KEPT == {}
    after = len(sets())
    time.sleep(0.05)  # not a timing assertion: nothing may set it again, however long this waits
    assert len(sets()) == after


def test_send_only_queues_and_a_thread_delivers_the_samples_in_one_batch(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    delivered: list[list] = []
    gate = threading.Event()

    def deliver(batch):
        gate.wait(30)  # the caller has returned long before this: it never waits for a delivery
        delivered.append(batch)

    monkeypatch.setattr(metrics, "deliver", deliver)
    metrics.send("rayckpt_save_stall_seconds", 0.25, run="r", tier="memory", rank=1)
    metrics.send("rayckpt_bytes_read", 0, run="r", rank=1)  # a counter never counts 0: not queued
    assert not metrics.flush(timeout=0.05)  # queued, not delivered yet
    metrics.send("rayckpt_bytes_read", 10, run="r", rank=1)
    gate.set()
    assert metrics.flush(timeout=30)
    samples = [s for batch in delivered for s in batch]
    assert samples == [
        ("rayckpt_save_stall_seconds", 0.25, {"run": "r", "tier": "memory", "rank": "1"}),
        ("rayckpt_bytes_read", 10.0, {"run": "r", "rank": "1"}),
    ]


def test_delivery_records_here_without_a_metadata_actor_and_never_raises(recorded, monkeypatch):
    import ray

    def none_named(name, namespace=None):
        raise ValueError(f"Failed to look up actor with name '{name}'")

    monkeypatch.setattr(ray, "get_actor", none_named)
    metrics.deliver([("rayckpt_restore_seconds", 0.5, {"run": "r", "tier": "memory"})])
    assert recorded == [("observe", "rayckpt_restore_seconds", 0.5, {"run": "r", "tier": "memory"})]

    def unreachable(name, namespace=None):
        raise ConnectionError("GCS unreachable")

    monkeypatch.setattr(ray, "get_actor", unreachable)
    metrics.deliver([("rayckpt_restore_seconds", 0.5, {"run": "r", "tier": "memory"})])  # dropped, not raised
    assert len(recorded) == 1
