"""Process bodies for the range-GET reshard test: an FSDP2 save, and a load through the counting filesystem."""

from __future__ import annotations

from typing import Any

import rayckpt
from rayckpt.engine.app_state import AppState
from rayckpt.engine.load import tensor_requests
from rayckpt.engine.state import flatten
from rayckpt.planning.load_plan import create_load_plan
from rayckpt.planning.range_gets import create_range_gets, get_parts
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.testing.toy import build_fsdp, full_state
from tests.helpers.counting_fs import counting_filesystem

#: About 9 MB of float32 parameters (28 MB with AdamW's two moments, which the
#: app state holds from the start): 1536 x 384 weights, so a 4 -> 3 reshard cuts
#: chunks mid-way and the default 64 KiB blocks stay small next to them.
MODEL = {"dim": 384, "hidden": 1536, "layers": 2}


def save_worker(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model, optim = build_fsdp(world_size, seed=0, **MODEL)
    app = AppState(model, optim, step=1)
    rayckpt.save({"app": app}, path)
    return full_state(app)


def counted_load_worker(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Load into a fresh model through the counting filesystem; return the state, figures and expected GETs."""
    model, optim = build_fsdp(world_size, seed=1234, **MODEL)
    app = AppState(model, optim, step=0)
    fs, stats = counting_filesystem()
    info = rayckpt.load({"app": app}, path, filesystem=fs)
    flat = flatten({"app": app.state_dict()})
    manifest = rayckpt.read_manifest(CheckpointDir.resolve(path))
    plan = create_load_plan(manifest, tensor_requests(flat), flat.values.keys())
    gets = create_range_gets(plan.reads)
    return {
        "state": full_state(app),
        "info": info,
        "gets": sum(len(get_parts(g)) for g in gets),
        "get_bytes": sum(g.length for g in gets),
        "requests": stats.requests,
        "bytes": stats.bytes,
        "max_in_flight": stats.max_in_flight,
    }
