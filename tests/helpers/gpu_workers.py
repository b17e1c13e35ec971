"""Per-rank functions of the GPU tier (tests/gpu): FSDP2 on CUDA with nccl, or on CPU with gloo.

Ranks share the machine's GPUs round-robin (``rank % device_count``). Results come
back on the CPU (``full_state`` gathers and copies them).
"""

from __future__ import annotations

from typing import Any

import torch

import rayckpt
from rayckpt.engine.app_state import AppState
from rayckpt.testing.toy import build_fsdp, fixed_input, full_state, train_steps


def _use_device(rank: int, device: str) -> str:
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return device


def save_on(rank: int, world_size: int, path: str, device: str) -> dict[str, Any]:
    """Train 3 steps on ``device`` ("cuda" with nccl, "cpu" with gloo), save; return the full state and outputs."""
    model, optim = build_fsdp(world_size, seed=0, device=_use_device(rank, device))
    train_steps(model, optim, 3, rank)
    app = AppState(model, optim, step=3)
    rayckpt.save({"app": app}, path)
    with torch.no_grad():
        output = model(fixed_input().to(device)).float().cpu()
    return {"state": full_state(app), "output": output}


def load_on(rank: int, world_size: int, path: str, device: str) -> dict[str, Any]:
    """Build a differently initialized model on ``device``, load ``path``; return the state, outputs and devices."""
    model, optim = build_fsdp(world_size, seed=1234, device=_use_device(rank, device))
    app = AppState(model, optim, step=0)
    rayckpt.load({"app": app}, path)
    devices = sorted({p.to_local().device.type for p in model.parameters()})
    with torch.no_grad():
        output = model(fixed_input().to(device)).float().cpu()
    return {"state": full_state(app), "output": output, "step": app.extras["step"], "devices": devices}
