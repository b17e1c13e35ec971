"""``jobs/demo.py``: save a sharded FSDP2 model with N processes, load it with M, check outputs match.

On CPU with gloo, without Ray (``DESCRIPTION`` is what ``--help`` tells the user).
Also the worker functions the multi-process tests and benchmarks reuse.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


DESCRIPTION = """\
Resharding on CPU, without Ray: a toy FSDP2 model trained a few steps and saved
(with its AdamW state) by --save-ranks gloo processes, then loaded by
--load-ranks processes into a freshly initialized model. Prints, per loading
rank, whether the model's outputs match the saved model's ("Outputs MATCH") and
whether the model and optimizer state is identical, then a JSON summary. The
checkpoint goes to a temporary directory, removed at the end (also on error),
unless --dir names one to keep.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python jobs/demo.py", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--save-ranks", type=int, default=4, help="processes that save the checkpoint (default 4)")
    parser.add_argument("--load-ranks", type=int, default=3, help="processes that load it (default 3)")
    parser.add_argument(
        "--dir", default=None, help="checkpoint directory, kept afterwards (default: a temporary one, removed)"
    )
    args = parser.parse_args(argv)
    if args.dir is not None:
        return _demo(args, args.dir)
    temp = tempfile.mkdtemp(prefix="rayckpt-demo-")
    try:
        return _demo(args, os.path.join(temp, "ckpt"))
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _demo(args: argparse.Namespace, path: str) -> int:
    """Save with ``args.save_ranks``, load with ``args.load_ranks``, print the verdicts."""
    where = path if args.dir is not None else f"{path} (a temporary directory, removed at the end)"
    print(f"saving a sharded FSDP2 model + AdamW state with {args.save_ranks} processes to {where}")
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
    kept = path if args.dir is not None else None
    print(json.dumps({"checkpoint": kept, "saved_by": args.save_ranks, "loaded_by": args.load_ranks, "match": ok}))
    return 0 if ok else 1
