"""Per-rank functions of the incremental-save multi-process tests (module-level so the fork server can import them)."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

import rayckpt
from rayckpt.engine.app_state import AppState
from rayckpt.testing.toy import build_fsdp, full_state, train_steps

SHARED_DIR = ".rayckpt-shared"
#: A ToyModel of 4 blocks (32 -> 48 -> 32) and a head, the first 3 blocks frozen: 74% of its parameters
#: (AdamW keeps two moments of each trained one, so the frozen blocks are 48% of each rank's bytes). Wide
#: enough that each rank's file is mostly tensor bytes, not Arrow framing.
LAYERS = 4
FROZEN_BLOCKS = 3
DIM = 32
HIDDEN = 48


def frozen_fsdp(world_size: int, seed: int):
    model, optim = build_fsdp(world_size, seed=seed, layers=LAYERS, dim=DIM, hidden=HIDDEN)
    for block in model.blocks[:FROZEN_BLOCKS]:
        block.requires_grad_(False)
    return model, optim


def save_steps_worker(rank: int, world_size: int, parent: str, steps: int) -> list[dict[str, Any]]:
    """Train ``steps`` steps, an incremental save of the model and AdamW after each one; per step (rank 0):
    the path, the save id, the full state saved and the bytes of the store files the save wrote."""
    model, optim = frozen_fsdp(world_size, seed=0)
    out = []
    for step in range(steps):
        train_steps(model, optim, 1, rank, dim=DIM)
        app = AppState(model, optim, step=step)
        path = os.path.join(parent, f"step{step}")
        info = rayckpt.save({"app": app}, path, incremental=True)
        dist.barrier()  # the commit is rank 0's: every rank's view of the store is after it
        store = os.path.join(parent, SHARED_DIR)
        written = sum(
            os.path.getsize(os.path.join(store, n)) for n in os.listdir(store) if n.startswith(info.save_id + "-")
        )
        out.append({"path": path, "save_id": info.save_id, "state": full_state(app), "written": written})
    return out


def load_steps_worker(rank: int, world_size: int, paths: list[str]) -> list[dict[str, Any]]:
    """Load each of ``paths`` into a freshly initialized model (same frozen blocks): each full state and step."""
    out = []
    for path in paths:
        model, optim = frozen_fsdp(world_size, seed=1234)
        app = AppState(model, optim, step=-1)
        rayckpt.load({"app": app}, path)
        out.append({"state": full_state(app), "step": app.extras["step"]})
    return out
