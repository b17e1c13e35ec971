"""``rayckpt status``'s report and screen, and the timeline picture, from records made by hand (no Ray)."""

from __future__ import annotations

import pytest

from rayckpt.cli.status import render
from rayckpt.observe import timeline
from rayckpt.ray.status.report import Newest, phase, run_status

NOW = 1_000_000.0


def flying(run: str, **kw) -> dict:
    base = {"save_id": "s9", "run": run, "step": 9, "location": "/c", "started": NOW - 3, "registered": True}
    return {**base, "written": 1, "world_size": 4, "committing": False, **kw}


def events() -> list[dict]:
    return [
        {"time": NOW - 60, "kind": "started", "tier": "storage", "restarts": 0, "world_size": 4},
        {"time": NOW - 50, "kind": "failed", "tier": "memory", "step": 6, "save_id": "s6", "error": "rank 2: boom"},
        {"time": NOW - 40, "kind": "started", "tier": "storage", "restarts": 1, "world_size": 3},
        {
            "time": NOW - 39,
            "kind": "restored",
            "tier": "memory",
            "step": 7,
            "seconds": 0.42,
            "bytes_read": 3 * 2**20,
            "peer_bytes": 2**20,
            "world_size": 3,
            "path": "mem/gpt/rayckpt-step-00000007",
        },
        {"time": NOW - 38, "kind": "restore_fallback", "tier": "storage", "step": 5},
    ]


def report() -> dict:
    newest = {"memory": Newest(step=8, path="mem/gpt/rayckpt-step-00000008", at=NOW - 2.5)}
    run = run_status("gpt", newest, [flying("gpt@memory")], events(), NOW)
    node = {"node": "ab12", "held": 2**30, "budget": 4 * 2**30, "room": 3 * 2**30, "bound": "of its memory budget left"}
    return {"time": NOW, "now": NOW, "pid": 42, "published_age_s": 0.3, "runs": [run], "nodes": [node]}


def test_phases_of_a_save_in_flight():
    assert phase(flying("gpt", registered=False, written=2)) == "registering (2 rank(s) written)"
    assert phase(flying("gpt")) == "writing (1 of 4 ranks written)"
    assert phase(flying("gpt", committing=True)) == "committing"


def test_run_status_has_newest_per_tier_in_flight_failures_and_restores():
    run = report()["runs"][0]
    assert run["tiers"]["memory"]["step"] == 8 and run["tiers"]["memory"]["age_s"] == 2.5
    assert run["in_flight"] == [
        {"save_id": "s9", "tier": "memory", "step": 9, "phase": "writing (1 of 4 ranks written)", "age_s": 3.0}
    ]
    assert [(f["tier"], f["step"], f["error"]) for f in run["failures"]] == [("memory", 6, "rank 2: boom")]
    assert [(r["tier"], r["step"], r["seconds"]) for r in run["restores"]] == [("memory", 7, 0.42)]
    assert (run["restarts"], run["fallbacks"]) == (1, 1)


def test_the_screen_shows_each_part():
    text = render(report(), "10.0.0.1:6379")
    assert text.splitlines()[0].startswith("rayckpt status at 10.0.0.1:6379, ")
    assert "  memory   newest step 8, committed 2.5 s ago  mem/gpt/rayckpt-step-00000008" in text
    assert "  in flight: memory step 9, writing (1 of 4 ranks written), for 3.0 s" in text
    assert "  failed 50.0 s ago: memory step 6: rank 2: boom" in text
    assert "  worker group restarts: 1" in text
    assert "  restored 39.0 s ago: step 7 from memory in 0.42 s on 3 worker(s) (rank 0 read 3.0 MiB, 1.0 MiB" in text
    assert "  ab12  1.0 GiB of 4.0 GiB held (25%), room 3.0 GiB (of its memory budget left)" in text
    assert "last published" not in text


def test_a_stale_snapshot_and_an_empty_actor_are_said_so():
    old = {**report(), "published_age_s": 30.0}
    assert "the MetadataActor last published its status 30.0 s ago" in render(old)
    empty = {"time": NOW, "pid": 1, "runs": [], "nodes": []}
    assert "no runs yet" in render(empty)
    no_commit = run_status("fresh", {}, [], [], NOW)
    assert "  no committed checkpoint yet" in render({"time": NOW, "runs": [no_commit]})


def saves() -> list[dict]:
    ok = {"save_id": "a", "tier": "memory", "step": 1, "begun": NOW, "registered": NOW, "staged": NOW + 0.2}
    ok.update(written=NOW + 0.6, ranks_written=2, stall=0.15, settled=NOW + 0.7, status="committed")
    bad = {"save_id": "b", "tier": "storage", "step": 2, "begun": NOW + 1, "registered": None, "staged": None}
    bad.update(written=None, ranks_written=0, stall=None, settled=NOW + 2, status="failed")
    return [ok, bad]


def test_moments_of_a_save():
    assert timeline.moments(saves()[0]) == {
        "begun": NOW,
        "staged": NOW + 0.2,
        "written": NOW + 0.6,
        "settled": NOW + 0.7,
    }


def test_the_timeline_is_drawn_into_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    assert timeline.draw({"run": "gpt", "saves": saves(), "events": events()}, str(path)) == 2
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    with pytest.raises(ValueError, match="run 'gpt' has no save on record to draw"):
        timeline.draw({"run": "gpt", "saves": [], "events": []}, str(tmp_path / "none.png"))
    assert not (tmp_path / "none.png").exists()
