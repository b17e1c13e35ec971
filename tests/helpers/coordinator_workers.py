"""Process bodies for the gather/scatter tests: ``plan_at_root`` over a real gloo group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from rayckpt.engine.coordinator import ProcessGroupCoordinator, plan_at_root
from rayckpt.errors import IncompatibleStateError, RayckptError


def _plan(values: list[int]) -> list[tuple[int, int]]:
    """Rank r's part: (r's own value, the sum of everyone's)."""
    return [(v, sum(values)) for v in values]


def count_collectives() -> dict[str, int]:
    """Count this process's calls of ``torch.distributed``'s collectives and point-to-point sends, by name."""
    counts: dict[str, int] = {}
    for name in ("gather", "scatter", "broadcast", "all_gather", "all_reduce", "send", "recv"):
        real = getattr(dist, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    return counts


def payload_worker(rank: int, world_size: int, sizes: list[int]) -> dict[str, Any]:
    """``plan_at_root`` where rank r sends ``sizes[r]`` bytes and gets back everyone's total and its own bytes;
    returns what it got and the collectives it ran."""
    coord = ProcessGroupCoordinator()
    counts = count_collectives()

    def plan(values: list[bytes]) -> list[tuple[int, bytes]]:
        total = sum(len(v) for v in values)
        return [(total, v[::-1]) for v in values]

    mine = bytes([rank + 1]) * sizes[rank]
    total, back = plan_at_root(coord, "test", lambda: mine, plan, RayckptError)
    return {"total": total, "back_ok": back == mine[::-1], "counts": dict(counts)}


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
