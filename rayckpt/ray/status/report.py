"""What the MetadataActor tells ``rayckpt status``: each run's newest checkpoint per tier, saves in flight,
recent failures and restores. Ray-free: made from what the actor holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..records import run_and_tier


@dataclass(frozen=True)
class Newest:
    """A run's newest committed checkpoint in one tier: its step, where it is, when it committed (Unix seconds)."""

    step: int | None
    path: str
    at: float


#: Failures and restores shown per run.
RECENT = 5


def phase(save: dict[str, Any]) -> str:
    """Where a save in flight is (``CommitTracker.in_flight``'s record): registering, writing k of n, committing."""
    if save["committing"]:
        return "committing"
    if not save["registered"]:
        return f"registering ({save['written']} rank(s) written)"
    return f"writing ({save['written']} of {save['world_size']} ranks written)"


def run_status(
    run: str,
    newest: dict[str, Newest],
    in_flight: list[dict[str, Any]],
    events: list[dict[str, Any]],
    now: float,
) -> dict[str, Any]:
    """One run's status.

    Args:
        run: the run's name.
        newest: tier -> its newest committed checkpoint.
        in_flight: its saves in flight, both tiers (``CommitTracker.in_flight`` records, tracked run names).
        events: its events, both tiers, oldest first (``MetadataActor.events``, each with its ``tier``).
        now: the time ages are counted to.
    """
    tiers = {
        tier: {"step": n.step, "path": n.path, "committed_at": n.at, "age_s": max(0.0, now - n.at)}
        for tier, n in sorted(newest.items())
    }
    flying = [
        {
            "save_id": s["save_id"],
            "tier": run_and_tier(s["run"])[1],
            "step": s["step"],
            "phase": phase(s),
            "age_s": max(0.0, now - s["started"]),
        }
        for s in in_flight
    ]
    failures = [
        {"time": e["time"], "tier": e["tier"], "step": e.get("step"), "save_id": e.get("save_id"), "error": e["error"]}
        for e in events
        if e["kind"] == "failed"
    ][-RECENT:]
    restores = [
        {k: e.get(k) for k in ("time", "tier", "step", "seconds", "bytes_read", "peer_bytes", "world_size", "path")}
        for e in events
        if e["kind"] == "restored"
    ][-RECENT:]
    starts = [e for e in events if e["kind"] == "started"]
    return {
        "run": run,
        "tiers": tiers,
        "in_flight": flying,
        "failures": failures,
        "restores": restores,
        "restarts": max((e.get("restarts", 0) for e in starts), default=0),
        "fallbacks": sum(e["kind"] == "restore_fallback" for e in events),
    }
