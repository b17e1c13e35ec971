"""Rank functions for tests/faults (run by ``run_ranks``): saves where a peer dies."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

import rayckpt
from rayckpt.engine import save as save_module


def peer_state(rank: int, world_size: int, version: int) -> dict[str, Any]:
    """Rank ``rank``'s state at ``version``: a per-rank tensor, a replicated one, a value."""
    g = torch.Generator().manual_seed(1000 * version + rank)
    return {
        "w": {f"r{rank}": torch.randn(64, 8, generator=g)},
        "shared": torch.arange(16, dtype=torch.float32) * version,
        "step": version,
    }


def full_peer_state(world_size: int, version: int) -> dict[str, Any]:
    """The state every rank saved at ``version``, as one process loads it."""
    ranks = [peer_state(r, world_size, version) for r in range(world_size)]
    return {"w": {k: v for s in ranks for k, v in s["w"].items()}, "shared": ranks[0]["shared"], "step": version}


def peer_death_worker(rank: int, world_size: int, path: str, version: int, kill: bool) -> dict[str, Any]:
    """Save ``version``; with ``kill`` the last rank is SIGKILLed in its write step once every
    other rank's shard file of this save is on storage (so theirs must be cleaned up)."""
    if kill and rank == world_size - 1:
        real = save_module.write_own_share

        def write_then_die(files, ctx):
            real(files, ctx)
            others = [f"{ctx.spec.save_id}-r{r:05d}-" for r in range(world_size - 1)]
            while not all(any(n.startswith(p) for n in os.listdir(path)) for p in others):
                time.sleep(0.01)
            time.sleep(0.2)  # their write steps return: they wait in the collective for this rank
            os.kill(os.getpid(), signal.SIGKILL)

        save_module.write_own_share = write_then_die
    try:
        info = rayckpt.save(peer_state(rank, world_size, version), path)
    except Exception as exc:  # noqa: BLE001 - the test looks at the type and the message
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None, "save_id": info.save_id}
