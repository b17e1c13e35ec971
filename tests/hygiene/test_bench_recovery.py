"""The recovery benchmark's arithmetic: synthetic events in, exact phases, steps re-done and tables out.

``benchmarks.recovery.restart`` measures on a real Ray; what it reports is computed
here from event lists alone (``benchmarks.recovery.report``), so a wrong phase
boundary, a wrong "last worker" or a wrong steps-re-done count fails these tests.
"""

from __future__ import annotations

import pytest

from benchmarks.recovery.report import (
    PHASES,
    RecoveryEventsError,
    markdown,
    recovery_times,
    summarize,
)

T0 = 1_000.0


def ev(t: float, kind: str, **data) -> dict:
    return {"t": T0 + t, "kind": kind, **data}


def worker(t: float, kind: str, rank: int, world: int, attempt: int, **data) -> dict:
    return ev(t, kind, rank=rank, world=world, attempt=attempt, **data)


def run_events(world_after: int = 4, kill_at: float = 20.0, reschedule: bool = False) -> list[dict]:
    """4 workers step every second from t=1 (a save at 5 and 10), a kill at ``kill_at``, a restart."""
    out = []
    for r in range(4):
        out.append(worker(0.0 + r * 0.01, "enter", r, 4, 0, pid=100 + r, node="a" if r < 2 else "b"))
        out.append(worker(0.5, "restore_done", r, 4, 0, step=None, source_world=None, restore_s=0.01))
        for s in range(1, 20):
            if s <= kill_at - 1 or r != 1:
                out.append(worker(float(s) + r * 0.001, "step", r, 4, 0, step=s))
    out.append(ev(kill_at, "kill", how="SIGKILL worker", rank=1, pid=101))
    out.append(ev(kill_at + 2.0, "noticed", ranks=[0, 1]))
    out.append(ev(kill_at + 2.01, "state", state="RESTARTING"))
    out.append(ev(kill_at + 2.02, "state", state="SCHEDULING"))
    out.append(ev(kill_at + 2.03, "group_shutdown_done"))
    out.append(ev(kill_at + 2.04, "group_start_begin", workers=4))
    if reschedule:
        out.append(ev(kill_at + 62.04, "state", state="RESCHEDULING"))
        out.append(ev(kill_at + 62.05, "group_start_begin", workers=world_after))
        up = kill_at + 70.0
    else:
        up = kill_at + 10.0
    out.append(ev(up, "group_started"))
    out.append(ev(up + 0.1, "state", state="RUNNING"))
    for r in range(world_after):
        out.append(worker(up + 0.5 + r * 0.1, "enter", r, world_after, 1, pid=200 + r, node="a"))  # last: +0.8
        out.append(worker(up + 2.0 + r * 0.2, "restore_begin", r, world_after, 1))  # last: +2.6
        restore_done = up + 3.0 + (0.5 if r == 0 else 0.0)  # rank 0 is the last one: +3.5
        out.append(worker(restore_done, "restore_done", r, world_after, 1, step=10, source_world=4, restore_s=0.9))
        out.append(worker(up + 4.0 + r * 0.05, "step", r, world_after, 1, step=11))  # a 2nd step later
        out.append(worker(up + 5.0, "step", r, world_after, 1, step=12))
    return sorted(out, key=lambda e: e["t"])


def test_phases_end_when_the_last_worker_gets_there():
    r = recovery_times(run_events())
    up = 30.0  # the group started 10 s after the kill at 20
    assert r["phases_s"]["detect"] == pytest.approx(2.0)
    assert r["phases_s"]["restart"] == pytest.approx(up + 0.5 + 0.3 - 22.0)  # rank 3 enters last
    assert r["phases_s"]["build"] == pytest.approx(2.6 - 0.8)  # restarted -> last restore_begin
    assert r["phases_s"]["restore"] == pytest.approx(3.5 - 2.6)  # rank 0 returns from restore last
    assert r["phases_s"]["first_step"] == pytest.approx(4.15 - 3.5)  # rank 3's first step, not the 2nd step
    assert r["total_s"] == pytest.approx(sum(r["phases_s"].values()))
    assert r["total_s"] == pytest.approx(10.0 + 4.15)
    assert r["restore_share"] == pytest.approx(0.9 / 14.15)
    assert r["ray_s"] == pytest.approx(2.0 + 8.8)
    assert r["restore_own_s"] == pytest.approx(0.9)


def test_steps_redone_counts_the_steps_finished_before_the_kill_past_the_restored_step():
    r = recovery_times(run_events(kill_at=13.5))  # steps 1..13 done by every rank before the kill
    assert (r["steps_before_kill"], r["restored_step"], r["steps_redone"]) == (13, 10, 3)
    r = recovery_times(run_events(kill_at=20.0))  # the survivors got to step 19 (the killed rank to 19 too)
    assert r["steps_redone"] == 9
    assert r["step_s"] == pytest.approx(1.0)


def test_worker_counts_and_the_restored_checkpoint():
    r = recovery_times(run_events(world_after=2, reschedule=True))
    assert (r["world_before"], r["world_after"], r["source_world"]) == (4, 2, 4)
    assert r["phases_s"]["restart"] == pytest.approx(70.0 + 0.5 + 0.1 - 2.0)  # 2 workers: rank 1 enters last


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        (lambda e: e["kind"] == "kill", "one kill"),
        (lambda e: e["kind"] == "noticed", "never noticed"),
        (lambda e: e["kind"] == "restore_done" and e.get("attempt") == 1 and e["rank"] == 2, "restore_done"),
        (lambda e: e["kind"] == "enter" and e.get("attempt") == 1 and e["rank"] == 3, "ranks"),
    ],
)
def test_incomplete_events_are_refused(drop, message):
    with pytest.raises(RecoveryEventsError, match=message):
        recovery_times([e for e in run_events() if not drop(e)])


def test_restarted_workers_must_agree_on_the_restored_step():
    events = run_events()
    for e in events:
        if e["kind"] == "restore_done" and e.get("attempt") == 1 and e["rank"] == 1:
            e["step"] = 5
    with pytest.raises(RecoveryEventsError, match="restored step"):
        recovery_times(events)


def test_summary_and_markdown_over_repeats():
    repeats = [recovery_times(run_events()), recovery_times(run_events(world_after=2, reschedule=True))]
    s = summarize(repeats)
    assert s["total_s"]["min"] == pytest.approx(14.15)
    assert s["total_s"]["max"] == pytest.approx(70.0 + 4.05)  # 2 workers: rank 1's first step at +4.05
    assert s["total_s"]["median"] == pytest.approx((14.15 + 74.05) / 2)
    assert set(s["phases_s"]) == {p[0] for p in PHASES}
    assert s["worlds"] == ["4->2", "4->4"]
    report = {
        "command": "python -m benchmarks.recovery restart --size-mb 64",
        "date": "today",
        "total_runtime_s": 120.0,
        "machine": {"nproc": 2, "mem_total_gb": 24, "torch": "t", "ray": "r", "pyarrow": "p", "rayckpt": "x"},
        "config": {"size_mb": 64, "save_every": 5, "step_sleep_s": 0.5, "repeats": 2},
        "state_bytes": 64 * 2**20,
        "layer_shapes_rows_cols": [[1, 1]] * 8,
        "scenarios": {"worker-kill": {"label": "worker SIGKILLed", "repeats": repeats, "summary": s}},
        "method": ["how"],
    }
    md = markdown(report)
    assert "| worker SIGKILLed | 4->2, 4->4 | 2 (2-2) | 38.7 (8.80-68.6) |" in md
    assert "| 44.1 (14.2-74.0) |" in md
