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

import rayckpt

from ..engine.app_state import AppState
from ..storage.checkpoint_dir import CheckpointDir
from ..testing.multiproc import run_ranks
from ..testing.toy import build_fsdp, fixed_input, full_state, train_steps


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
    manifest = rayckpt.read_manifest(CheckpointDir.resolve(path))
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
