"""The model both overlap benchmarks train and save: a stack of square ``nn.Linear`` layers with AdamW."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from rayckpt.app_state import AppState

#: Bytes of saved state per parameter: the fp32 parameter and AdamW's two fp32 moments.
STATE_BYTES_PER_PARAM = 12


@dataclass(frozen=True, slots=True)
class StackShape:
    """``layers`` square layers of ``width`` (weights and biases)."""

    width: int
    layers: int

    @property
    def params(self) -> int:
        return self.layers * (self.width * self.width + self.width)

    @property
    def state_bytes(self) -> int:
        """Bytes of params + exp_avg + exp_avg_sq (AdamW's step counters not counted)."""
        return STATE_BYTES_PER_PARAM * self.params


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model's options, the same for both benchmarks: ``--size-gb``, ``--layers``, ``--batch``."""
    parser.add_argument("--size-gb", type=float, default=1.0, help="state size in GiB (params + AdamW moments)")
    parser.add_argument("--layers", type=int, default=4, help="square Linear layers in the stack")
    parser.add_argument("--batch", type=int, default=8, help="rows per training step (per rank)")


def stack_shape(size_gb: float, layers: int) -> StackShape:
    """The widest ``layers``-layer stack whose state (params + AdamW moments) is about ``size_gb`` GiB."""
    per_layer = size_gb * 2**30 / STATE_BYTES_PER_PARAM / layers
    return StackShape(width=max(int(math.sqrt(per_layer)), 8), layers=layers)


class LinearStack(nn.Module):
    """``layers`` square ``nn.Linear`` layers with a ReLU between them."""

    def __init__(self, shape: StackShape) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(shape.width, shape.width) for _ in range(shape.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def build(shape: StackShape, device: str = "cpu", world_size: int = 1, seed: int = 0) -> tuple[Any, Any, AppState]:
    """The model, its AdamW and ``AppState(model, opt)`` (which guards the optimizer), after one
    training step so AdamW's moments exist. On several ranks FSDP2 keeps the gathered params from
    forward to backward: one all-gather a step."""
    target = torch.device("cuda", torch.cuda.current_device()) if device.startswith("cuda") else torch.device("cpu")
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(target.type, (world_size,))
        with torch.device("meta"):
            model = LinearStack(shape)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        model.to_empty(device=target)
    else:
        model = LinearStack(shape).to(target)
    gen = torch.Generator(device=target).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(std=1 / math.sqrt(shape.width), generator=gen)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    app = AppState(model, optim)
    train_step(model, optim, batch(shape, 1, device, seed))
    return model, optim, app


def batch(shape: StackShape, rows: int, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    """``rows`` random inputs (each worker its own: data parallel)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, shape.width, generator=gen).to(device)


def train_step(
    model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, before_step: Callable[[], None] | None = None
) -> float:
    """Forward, backward, ``before_step()`` (a checkpointer's wait for its staging, as torchtitan does
    before ``optimizer.step()``), then the optimizer step (whose pre-hook waits for an overlapped
    save's copy, when the optimizer is guarded). Returns the seconds ``before_step`` took.
    """
    loss = model(x).float().pow(2).mean()
    loss.backward()
    waited = 0.0
    if before_step is not None:
        start = time.perf_counter()
        before_step()
        waited = time.perf_counter() - start
    optim.step()
    optim.zero_grad()
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return waited
