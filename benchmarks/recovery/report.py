"""The recovery benchmark's arithmetic and tables: events in, phases and markdown out (nothing here measures)."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common.harness import document, summary, table

#: (phase, from milestone, to milestone, label), in order: the phases add up to kill -> first step.
PHASES = (
    ("detect", "kill", "noticed", "kill -> noticed"),
    ("restart", "noticed", "entered", "noticed -> workers restarted"),
    ("build", "entered", "restore_begun", "restarted -> state built"),
    ("restore", "restore_begun", "restored", "built -> state restored"),
    ("first_step", "restored", "first_step", "restored -> first step done"),
)


class RecoveryEventsError(ValueError):
    """A repeat's events do not describe one kill and one complete recovery."""


def _one(values: set[Any], what: str) -> Any:
    if len(values) != 1:
        raise RecoveryEventsError(f"the restarted workers disagree on {what}: {sorted(values, key=str)}")
    return next(iter(values))


def recovery_times(events: list[dict[str, Any]]) -> dict[str, Any]:
    """One repeat's recovery: milestone times (seconds after the kill), phases, steps re-done, worker counts."""
    kills = [e for e in events if e["kind"] == "kill"]
    if len(kills) != 1:
        raise RecoveryEventsError(f"expected one kill event, found {len(kills)}")
    t_kill = kills[0]["t"]
    after = [e for e in events if e["t"] >= t_kill]
    entries = [e for e in after if e["kind"] == "enter"]
    if not entries:
        raise RecoveryEventsError("no worker entered the loop after the kill")
    attempt = min(e["attempt"] for e in entries)
    new = [e for e in after if e.get("attempt") == attempt and "rank" in e]
    entered = [e for e in new if e["kind"] == "enter"]
    world = _one({e["world"] for e in entered}, "the world size")
    ranks = {e["rank"] for e in entered}
    if ranks != set(range(world)):
        raise RecoveryEventsError(f"the restarted group of {world} entered with ranks {sorted(ranks)}")

    def last_of(kind: str) -> dict[str, Any]:
        """Each rank's first ``kind`` event of the new attempt; the one of the rank that got there last."""
        got: dict[int, dict[str, Any]] = {}
        for e in new:
            if e["kind"] == kind:
                got.setdefault(e["rank"], e)
        if set(got) != ranks:
            raise RecoveryEventsError(f"'{kind}' from ranks {sorted(got)} of {world} after the kill")
        return max(got.values(), key=lambda e: e["t"])

    noticed = [e for e in after if e["kind"] == "noticed"]
    if not noticed:
        raise RecoveryEventsError("the controller never noticed the failure (no 'noticed' event)")
    done = [e for e in new if e["kind"] == "restore_done"]
    restored_step = _one({e["step"] for e in done}, "the restored step")
    source_world = _one({e["source_world"] for e in done}, "the restored checkpoint's world size")
    tier = _one({e.get("tier") or "storage" for e in done}, "the restored checkpoint's tier")
    at = {"kill": t_kill, "noticed": noticed[0]["t"]}
    for milestone, kind in (("entered", "enter"), ("restore_begun", "restore_begin"), ("restored", "restore_done")):
        at[milestone] = last_of(kind)["t"]
    at["first_step"] = last_of("step")["t"]
    phases = {name: at[b] - at[a] for name, a, b, _ in PHASES}
    for name, s in phases.items():
        if s < 0:
            raise RecoveryEventsError(f"phase {name} is negative ({s:.3f} s): the events are out of order")
    before = [e for e in events if e["kind"] == "step" and e["t"] <= t_kill]
    steps_before = max((e["step"] for e in before), default=0)
    total = at["first_step"] - t_kill
    world_before = _one({e["world"] for e in events if e["kind"] == "enter" and e["t"] < t_kill}, "world")
    out = {"world_before": world_before, "world_after": world, "source_world": source_world, "restored_tier": tier}
    out |= {"restored_step": restored_step, "steps_before_kill": steps_before}
    out |= {"steps_redone": steps_before - (restored_step or 0), "phases_s": phases, "total_s": total}
    out |= {"restore_own_s": max(e["restore_s"] for e in done), "ray_s": phases["detect"] + phases["restart"]}
    out |= {"restore_share": phases["restore"] / total if total > 0 else None, "step_s": step_time(events, t_kill)}
    return out | {"kill": {k: v for k, v in kills[0].items() if k not in ("t", "kind")}}


def step_time(events: list[dict[str, Any]], t_kill: float) -> float | None:
    """Median time between rank 0's consecutive steps before the kill (saves' stalls included)."""
    ts = [e["t"] for e in events if e["kind"] == "step" and e["rank"] == 0 and e["t"] <= t_kill]
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    return statistics.median(gaps) if gaps else None


def summarize(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and min-max over repeats of each phase, the total, restore's share and the steps re-done."""
    out: dict[str, Any] = {"repeats": len(repeats)}
    out["phases_s"] = {p[0]: summary([r["phases_s"][p[0]] for r in repeats]) for p in PHASES}
    for key in ("total_s", "restore_own_s", "ray_s", "restore_share", "steps_redone"):
        out[key] = summary([r[key] for r in repeats if r[key] is not None])
    out |= {
        "worlds": sorted({f"{r['world_before']}->{r['world_after']}" for r in repeats}),
        "restored_from": sorted(
            {
                f"step {r['restored_step']} of {r['source_world']} workers"
                + (f" from {r['restored_tier']}" if r.get("restored_tier", "storage") != "storage" else "")
                for r in repeats
            }
        ),
    }
    steps = [r["step_s"] for r in repeats if r["step_s"] is not None]
    out["step_s"] = summary(steps) if steps else None
    return out


def markdown(report: dict[str, Any]) -> str:
    """The recovery section: a phase table, per scenario."""
    rows = []
    for sc in report["scenarios"].values():
        s, p = sc["summary"], sc["summary"]["phases_s"]
        rows.append(
            {"scenario": sc["label"], "workers": ", ".join(s["worlds"])}
            | {label: p[name] for name, _, _, label in PHASES}
            | {"kill -> first step": s["total_s"], "restore's share": f"{s['restore_share']['median']:.1%}"}
            | {"steps re-done": s["steps_redone"], "restored": "; ".join(s["restored_from"]), "step s": s["step_s"]}
        )
    return document("Recovery time", report, table(rows))
