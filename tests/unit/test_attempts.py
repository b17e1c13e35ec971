"""The MetadataActor counts a Ray Train run's worker groups (its class, without Ray): what ``restarts`` says."""

from __future__ import annotations

import asyncio

from rayckpt.ray.metadata.actor import MetadataActor
from rayckpt.ray.metadata.save_history import RUNS_KEPT


def test_each_worker_group_of_a_run_counts_the_ones_before_it():
    actor = MetadataActor()

    async def starts() -> list[int]:
        first = [await actor.begin_attempt("job", "fit-1", w) for w in (4, 2, 4)]  # start, node lost, grown back
        other = await actor.begin_attempt("job", "fit-2", 3)  # a second fit() of the same run name: its own count
        return [*first, other]

    assert asyncio.run(starts()) == [0, 1, 2, 0]
    events = asyncio.run(actor.events("job"))
    assert [(e["kind"], e["restarts"], e["world_size"]) for e in events if e["kind"] == "started"] == [
        ("started", 0, 4),
        ("started", 1, 2),
        ("started", 2, 4),
        ("started", 0, 3),
    ]


def test_the_counts_kept_are_bounded_to_the_most_recent_runs():
    actor = MetadataActor()

    async def many() -> None:
        for i in range(RUNS_KEPT + 5):
            await actor.begin_attempt(f"run-{i}", f"fit-{i}", 1)
        await actor.begin_attempt("run-last", f"fit-{RUNS_KEPT + 4}", 1)  # touched again: the newest

    asyncio.run(many())
    counts = actor._attempts.counts
    assert len(counts) == RUNS_KEPT
    assert "fit-0" not in counts and counts[f"fit-{RUNS_KEPT + 4}"] == 2


def test_a_restarted_group_fails_the_saves_an_earlier_group_left_in_flight(monkeypatch):
    """A resize stops a healthy group with no callback: its pending save must not block the new group's."""
    actor = MetadataActor()
    failed: list[tuple[str, str]] = []

    async def fail_pending(run: str, reason: str) -> list[str]:
        failed.append((run, reason))
        return ["save-1"]

    monkeypatch.setattr(actor, "fail_pending", fail_pending)

    async def starts() -> None:
        await actor.begin_attempt("job", "fit-1", 4)  # the first group: nothing of this fit() before it
        await actor.begin_attempt("job", "fit-1", 2)  # resized or restarted

    asyncio.run(starts())
    assert failed == [("job", "its worker group was replaced (Ray Train restart 1)")]
    started = [e for e in asyncio.run(actor.events("job")) if e["kind"] == "started"]
    assert [e["failed_saves"] for e in started] == [[], ["save-1"]]
