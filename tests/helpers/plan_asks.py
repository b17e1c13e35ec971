"""Many small checkpoints and the load plans ranks ask of them: the plan-cache tests, with and without Ray."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

import rayckpt
from rayckpt.format.boxes import Box
from rayckpt.format.manifest import TensorEntry
from rayckpt.planning.load_plan import LoadPlan, TensorRequest, create_load_plan, dim0_box
from rayckpt.ray.metadata.plan_cache import ReadAsk
from rayckpt.storage.checkpoint_dir import CheckpointDir

VALUE_KEYS = ("step",)


def save_small_checkpoints(root: str, count: int) -> list[str]:
    """``count`` checkpoints saved by ``rayckpt.save`` under ``root``, each with its own shapes."""
    paths = []
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        state = {"w": torch.randn(40 + 7 * i, 16, generator=g), "b": torch.randn(5 + i, generator=g), "step": i}
        path = os.path.join(root, f"ckpt-{i:02d}")
        rayckpt.save(state, path)
        paths.append(path)
    return paths


@dataclass(frozen=True, slots=True)
class PlanAsk:
    """One loading rank's question to the planner (the arguments of ``read_plan``)."""

    location: str
    requests: tuple[TensorRequest, ...]
    value_keys: tuple[str, ...]
    rank: int | None
    world_size: int | None

    def read_ask(self) -> ReadAsk:
        return ReadAsk(requests=self.requests, value_keys=self.value_keys, rank=self.rank, world_size=self.world_size)


def asks_for(path: str) -> list[PlanAsk]:
    """What loads of ``path`` ask: every rank of an FSDP2 load on 3 ranks (one all-ranks plan),
    a rank with an odd box, and a rank that does not say which it is (each planned alone)."""
    m = rayckpt.read_manifest(CheckpointDir.resolve(path))
    tensors = {k: e for k, e in m.entries.items() if isinstance(e, TensorEntry)}

    def dim0(rank: int, world: int) -> tuple[TensorRequest, ...]:
        return tuple(TensorRequest(k, e.dtype, e.shape, dim0_box(e.shape, world, rank)) for k, e in tensors.items())

    odd = tuple(
        TensorRequest(k, e.dtype, e.shape, Box((1,) + (0,) * (len(e.shape) - 1), (e.shape[0] - 2,) + e.shape[1:]))
        for k, e in tensors.items()
    )
    asks = [PlanAsk(path, dim0(r, 3), VALUE_KEYS, r, 3) for r in range(3)]
    asks.append(PlanAsk(path, odd, VALUE_KEYS, 0, 3))
    asks.append(PlanAsk(path, dim0(1, 2), VALUE_KEYS, None, None))
    return asks


def expected_plan(ask: PlanAsk) -> LoadPlan:
    """The plan computed directly from storage, with no cache."""
    return create_load_plan(rayckpt.read_manifest(CheckpointDir.resolve(ask.location)), ask.requests, ask.value_keys)
