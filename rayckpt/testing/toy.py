"""A toy FSDP2 model and its helpers, for tests, benchmarks and the demo.

``build_fsdp`` makes a small MLP sharded with ``fully_shard`` over the current
gloo process group plus AdamW; ``train_steps`` moves it off its initial values;
``full_state`` gathers every parameter and optimizer moment for exact checks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..engine.app_state import AppState


class ToyModel(nn.Module):
    """Blocks of uneven widths so dim-0 shards are uneven for most world sizes."""

    def __init__(self, dim: int = 10, hidden: int = 13, out: int = 7, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim)) for _ in range(layers)
        )
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build_fsdp(world_size: int, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu", **model_kw: Any):
    """A ToyModel sharded with ``fully_shard`` on each block and the root, with AdamW.

    ``device``: "cpu" (a gloo group) or "cuda" (an nccl group; the rank's current CUDA device).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = ToyModel(**model_kw).to(dtype)
    if device != "cpu":
        model = model.to(device)
    mesh = init_device_mesh(device, (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optim


def train_steps(model: nn.Module, optim: torch.optim.Optimizer, steps: int, rank: int, dim: int = 10) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        param = next(model.parameters())
        x = torch.randn(4, dim, generator=g).to(param.device, param.dtype)
        optim.zero_grad()
        model(x).float().pow(2).mean().backward()
        optim.step()


def fixed_input(dim: int = 10, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(2 * dim, dtype=torch.float32).reshape(2, dim).div(10).to(dtype)


def full_state(app: AppState) -> dict[str, torch.Tensor]:
    """Every tensor of the app's state by flattened key, unsharded (a collective), on CPU."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}

    def walk(node: Any, prefix: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            key = f"{prefix}.{k}"
            if isinstance(v, DTensor):
                out[key] = v.full_tensor().detach().cpu().clone()
            elif isinstance(v, torch.Tensor):
                out[key] = v.detach().cpu().clone()
            else:
                walk(v, key)

    walk(app.state_dict(), "app")
    return out
