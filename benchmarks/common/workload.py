"""The states the benchmarks save and load: an FSDP2 stack of uneven layers with AdamW moments (never run
forward), and a stack of square layers that trains (``build``), both with their checks."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from rayckpt.engine.app_state import AppState

NUM_LAYERS = 8


class BenchModel(nn.Module):
    """A stack of large linear layers (never run forward: only its state matters)."""

    def __init__(self, shapes: list[tuple[int, int]]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(cols, rows) for rows, cols in shapes)


def layer_shapes(size_mb: float, num_layers: int = NUM_LAYERS) -> list[tuple[int, int]]:
    """(rows, cols) per layer so that 3 fp32 copies (param, exp_avg, exp_avg_sq) of
    weights + biases total about ``size_mb`` MiB. Rows (the FSDP2 shard dim) are odd
    and not multiples of 3, so shards are uneven for 2, 3, 4 and 6 ranks and the
    shard boundaries of N and M ranks differ."""
    elements = int(size_mb * 2**20) // 12
    per_layer = max(elements // num_layers, 64)
    base = max(int(math.sqrt(per_layer)), 7)
    shapes = []
    for i in range(num_layers):
        rows = base + 6 * i
        while rows % 2 == 0 or rows % 3 == 0:
            rows += 1
        cols = max(per_layer // (rows + 1), 1)
        shapes.append((rows, cols))
    return shapes


def build_state(
    world_size: int, rank: int, seed: int, shapes: list[tuple[int, int]], device: str = "cpu"
) -> tuple[Any, Any, AppState]:
    """FSDP2 model (meta init, then only local shards materialized) + AdamW with filled moments,
    on ``device`` ("cpu", or "cuda": this process's current CUDA device, with an nccl group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    kind = "cuda" if device.startswith("cuda") else "cpu"
    mesh = init_device_mesh(kind, (world_size,))
    with torch.device("meta"):
        model = BenchModel(shapes)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    target = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    model.to_empty(device=target)
    gen = torch.Generator(device=target).manual_seed(seed * 1_000_003 + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(generator=gen)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    app = AppState(model, optim, step=7)
    app.state_dict()  # get_state_dict initializes the (empty) optimizer state with one zero-grad step
    with torch.no_grad():
        for p in model.parameters():
            st = optim.state[p]
            st["exp_avg"].to_local().normal_(generator=gen)
            st["exp_avg_sq"].to_local().uniform_(generator=gen)
            st["step"].fill_(7.0)
    return model, optim, app


def state_bytes(app: AppState, local: bool = False) -> int:
    """Bytes of every tensor in the app's state: DTensors counted globally (``numel`` is the global count),
    or with ``local=True`` only this rank's own shards."""
    from torch.utils._pytree import tree_leaves

    tensors = [t for t in tree_leaves(app.state_dict()) if isinstance(t, torch.Tensor)]
    tensors = [t.to_local() if local and hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


def zero_state(model: Any, optim: Any, app: Any) -> None:
    """Zero every local param and moment (and the steps): a load must then write all of them."""
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
            st = optim.state[p]
            st["exp_avg"].to_local().zero_()
            st["exp_avg_sq"].to_local().zero_()
            st["step"].zero_()
    app.extras["step"] = 0


def checksums(model: nn.Module, optim: torch.optim.Optimizer, compute: bool) -> dict[str, Any]:
    """Exact, order-independent sums of the raw bits of every full (unsharded, via ``DTensor.full_tensor()``)
    param and AdamW moment, and every param's step: they compare bit for bit across shardings. A collective:
    every rank calls it; only ranks with ``compute`` sum (the others get {})."""
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        full = {"param": p.full_tensor(), **{k: optim.state[p][k].full_tensor() for k in ("exp_avg", "exp_avg_sq")}}
        for k, t in full.items() if compute else ():
            bits = t.detach().reshape(-1).contiguous().view(torch.int32).to(torch.int64)
            out[f"{k}:{name}"] = [int(bits.sum()), int((bits * (torch.arange(bits.numel()) % 65521 + 1)).sum())]
        if compute:
            out[f"step:{name}"] = float(optim.state[p]["step"])
        del full
    return out


def verify_loaded(system: str, model: nn.Module, optim: torch.optim.Optimizer, app: AppState, expected: dict) -> int:
    """Compare the loaded state with the saved checksums (rank 0), then raise on every rank if it differs."""
    import torch.distributed as dist

    rank = dist.get_rank()
    got = checksums(model, optim, compute=rank == 0)
    problem = None
    bad = [k for k in expected if got.get(k) != expected[k]] if rank == 0 else []
    if bad:
        detail = "; ".join(f"{k}: saved {expected.get(k)} loaded {got.get(k)}" for k in bad[:6])
        problem = f"{system}: loaded state differs from the saved state in {len(bad)} tensor(s): {detail}"
    if app.extras.get("step") != 7:
        problem = f"{system}: extras.step loaded as {app.extras.get('step')!r}, saved 7"
    verdict = [problem]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise AssertionError(verdict[0])
    return len(expected)


#: Bytes of saved state per parameter: the fp32 parameter and AdamW's two fp32 moments.
STATE_BYTES_PER_PARAM = 12


@dataclass(frozen=True, slots=True)
class StackShape:
    """``layers`` square layers of ``width`` (weights and biases)."""

    width: int
    layers: int

    @property
    def state_bytes(self) -> int:
        """Bytes of params + exp_avg + exp_avg_sq (AdamW's step counters not counted)."""
        return STATE_BYTES_PER_PARAM * self.layers * (self.width * self.width + self.width)


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
