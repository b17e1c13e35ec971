"""Save a sharded FSDP2 model with N processes, load it with M, check outputs match.

The seeds' check ("outputs MATCH after load"), on CPU with gloo. Also the worker
functions the multi-process tests and benchmarks reuse.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import torch
import torch.nn as nn

import rayckpt

from .app_state import AppState
from .multiproc import run_ranks


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


def build_fsdp(world_size: int, seed: int, dtype: torch.dtype = torch.float32, **model_kw: Any):
    """A ToyModel sharded with ``fully_shard`` on each block and the root, with AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = ToyModel(**model_kw).to(dtype)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optim


def train_steps(model: nn.Module, optim: torch.optim.Optimizer, steps: int, rank: int, dim: int = 10) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(4, dim, generator=g).to(next(model.parameters()).dtype)
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


def save_worker(
    rank: int, world_size: int, path: str, steps: int = 3, dtype: str = "float32", block_size: int | None = None
) -> dict[str, Any]:
    """Train ``steps`` steps on ``world_size`` ranks, save; return the full state and outputs."""
    dt = getattr(torch, dtype)
    model, optim = build_fsdp(world_size, seed=0, dtype=dt)
    train_steps(model, optim, steps, rank)
    app = AppState(model, optim, step=steps)
    kwargs = {"block_size": block_size} if block_size else {}
    rayckpt.save({"app": app}, path, **kwargs)
    with torch.no_grad():
        output = model(fixed_input(dtype=dt)).float()
    return {"state": full_state(app), "output": output}


def load_worker(rank: int, world_size: int, path: str, dtype: str = "float32") -> dict[str, Any]:
    """Build a fresh, differently initialized model on ``world_size`` ranks and load ``path``."""
    dt = getattr(torch, dtype)
    model, optim = build_fsdp(world_size, seed=1234, dtype=dt)
    app = AppState(model, optim, step=0)
    info = rayckpt.load({"app": app}, path)
    with torch.no_grad():
        output = model(fixed_input(dtype=dt)).float()
    return {"state": full_state(app), "output": output, "step": app.extras["step"], "info": info}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--save-ranks", type=int, default=4)
    parser.add_argument("--load-ranks", type=int, default=3)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    args = parser.parse_args(argv)
    path = args.dir or os.path.join(tempfile.mkdtemp(prefix="rayckpt-demo-"), "ckpt")
    print(f"saving a sharded FSDP2 model + AdamW state with {args.save_ranks} processes to {path}")
    saved = run_ranks(save_worker, args.save_ranks, path)
    manifest = rayckpt.read_manifest(rayckpt.storage.CheckpointDir.resolve(path))
    print(f"committed: {len(manifest.files)} Arrow shard files, {manifest.total_bytes} bytes")
    print(f"loading it into a fresh model with {args.load_ranks} processes")
    loaded = run_ranks(load_worker, args.load_ranks, path)
    before = saved[0]["output"]
    ok = True
    for rank, result in enumerate(loaded):
        match = torch.allclose(before, result["output"], rtol=1e-5, atol=1e-7)
        same_state = all(torch.equal(saved[0]["state"][k], v) for k, v in result["state"].items())
        ok &= match and same_state
        verdict = "Outputs MATCH" if match else "Outputs DIFFER"
        print(
            f"[rank {rank}] {verdict}; model + optimizer state "
            f"{'identical' if same_state else 'DIFFERENT'}; read {result['info'].bytes_read} of "
            f"{result['info'].bytes_needed} needed bytes"
        )
    print(json.dumps({"checkpoint": path, "saved_by": args.save_ranks, "loaded_by": args.load_ranks, "match": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
