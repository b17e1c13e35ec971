"""Process bodies for the gather/scatter tests: ``plan_at_root`` over a real gloo group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from rayckpt.engine.coordinator import ProcessGroupCoordinator, plan_at_root
from rayckpt.errors import IncompatibleStateError, RayckptError


def _plan(values: list[int]) -> list[tuple[int, int]]:
    """Rank r's part: (r's own value, the sum of everyone's)."""
    return [(v, sum(values)) for v in values]


def plan_worker(rank: int, world_size: int, fail: str) -> dict[str, Any]:
    """``plan_at_root`` on the world group, then on the subgroup of ranks 1..N-1 (root: global rank 1).

    ``fail``: "" (none), "local" (rank 1's local step raises) or "plan" (rank 0's planning raises).
    """
    coord = ProcessGroupCoordinator()

    def local() -> int:
        if fail == "local" and rank == 1:
            raise IncompatibleStateError("rank 1 has no such key 'w'")
        return 10 * rank

    def plan(values: list[int]) -> list[tuple[int, int]]:
        if fail == "plan":
            raise ValueError("the planner broke")
        return _plan(values)

    out: dict[str, Any] = {}
    try:
        out["world"] = plan_at_root(coord, "load (planning)", local, plan, RayckptError)
    except RayckptError as exc:
        out["error"] = (type(exc).__name__, str(exc))
    sub = dist.new_group(list(range(1, world_size)))
    if rank >= 1:
        sub_coord = ProcessGroupCoordinator(sub)
        out["sub"] = plan_at_root(sub_coord, "sub", lambda: 100 * rank, _plan, RayckptError)
    return out
