"""Process bodies for the save plan cache test: three saves over a real gloo group, each loaded back."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import rayckpt
from rayckpt.engine.save import PROCESS_PLANS


def _state(mesh: Any, rank: int, step: int, extra: bool) -> dict[str, Any]:
    """A dim-0 sharded weight, a replicated bias, a plain value; ``extra``: a tensor of this rank's own."""
    g = torch.Generator().manual_seed(step)
    state: dict[str, Any] = {
        "w": distribute_tensor(torch.randn(10, 3, generator=g), mesh, [Shard(0)]),
        "b": distribute_tensor(torch.randn(5, generator=g), mesh, [Replicate()]),
        "step": step,
    }
    if extra:
        state[f"own.r{rank}"] = torch.full((4,), float(step + rank))
    return state


def _zeros(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def local(v: Any) -> Any:
        return v.to_local() if hasattr(v, "to_local") else v

    return a.keys() == b.keys() and all(
        torch.equal(local(a[k]), local(b[k])) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def cached_saves_worker(rank: int, world_size: int, path: str) -> list[dict[str, Any]]:
    """Save at steps 1 and 2 (same layout), then 3 with rank 2 alone holding one more tensor.

    Per save: this process's plan counts after it, and whether loading it back gave what was saved.
    """
    mesh = init_device_mesh("cpu", (world_size,))
    out = []
    for step, extra in ((1, False), (2, False), (3, rank == 2)):
        saved = _state(mesh, rank, step, extra)
        rayckpt.save(saved, path)
        counts = PROCESS_PLANS.counts()
        stats = {"planned": counts.planned, "cached": counts.cached}
        target = _zeros(_state(mesh, rank, 0, extra))
        rayckpt.load(target, path)
        out.append({"stats": stats, "loaded": _equal(target, saved)})
    return out
