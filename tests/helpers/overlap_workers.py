"""Train loops of tests/ray/test_overlap_train.py: FSDP2 and AdamW in an ``AppState``, saved with overlap
(importable by Ray Train's workers).

Each rank writes what its saves did to ``saves-<world>-<rank>.json``; rank 0 writes the full state at each
save (``state-<step>.pt``), after a restore (``restored-<world>.pt``) and after loading a checkpoint into a
fresh model (``loaded-<world>-<step>.pt``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import ray.train
import torch

import rayckpt
from rayckpt.engine.app_state import AppState
from rayckpt.testing.toy import build_fsdp, full_state, train_steps
from rayckpt.train.checkpointer import Checkpointer
from tests.helpers.copy_gate import CopyGate


def load_into_fresh_model(ckpt: Checkpointer, step: int, rank: int, world: int, out: str) -> None:
    """Load step ``step``'s checkpoint into a differently initialized model and optimizer; rank 0 writes
    their full state to ``loaded-<world>-<step>.pt``."""
    model, optim = build_fsdp(world, seed=1000 + step)
    app = AppState(model, optim, step=-1)
    rayckpt.load({"app": app}, ckpt.path(step), filesystem=ckpt.filesystem)
    dump = full_state(app)
    if rank == 0:
        torch.save({"step": app.extras["step"], "state": dump}, os.path.join(out, f"loaded-{world}-{step}.pt"))


def overlap_train_loop(config: dict[str, Any]) -> None:
    """Load each of ``config['check_steps']``, restore (if any), train to ``config['steps']`` saving at the
    steps in ``config['save_at']`` with the ``Checkpointer``'s default overlap, its copies held by a
    ``CopyGate``; write what each save did and the state at each save (see the module).

    ``memory_every`` and ``persist_every`` go to the ``Checkpointer`` (every memory save is made:
    ``memory_skip_busy=False``).
    """
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    out = config["out"]
    ckpt = Checkpointer(
        memory_every=config.get("memory_every", 0),
        persist_every=config.get("persist_every", 1),
        memory_skip_busy=False,
    )
    for step in config.get("check_steps", ()):
        load_into_fresh_model(ckpt, step, rank, world, out)
    model, optim = build_fsdp(world, seed=0)
    gate = CopyGate(optim)
    app = AppState(model, optim, step=0)
    state = {"app": app}
    restored = ckpt.restore(state)
    step = 0
    if restored is not None:
        step = app.extras["step"]
        dump = full_state(app)
        if rank == 0:
            restored_at = {"step": restored, "state": dump, "restored_from": ckpt.restored_from}
            torch.save(restored_at, os.path.join(out, f"restored-{world}.pt"))
    try:
        while step < config["steps"]:
            train_steps(model, optim, 1, rank + 100 * step)  # forward, backward, then the step opens the gate
            step += 1
            app.extras["step"] = step
            if step not in config["save_at"]:
                continue
            gate.close()
            gate.watch(ckpt.save(step, state, {"loss": float(step)}))
            dump = full_state(app)  # the state saved: the next step's forward and backward leave it as it is
            if rank == 0:
                torch.save({"step": step, "state": dump}, os.path.join(out, f"state-{step}.pt"))
    finally:
        gate.open.set()  # the last save's copy has no next step to wait for
    last = ckpt.wait()
    summary = {
        "saves": gate.saves,
        "last": {"step": last.step, "status": last.status} if last is not None else None,
        "memory_skipped": ckpt.memory_skipped,
    }
    with open(os.path.join(out, f"saves-{world}-{rank}.json"), "w") as f:
        json.dump(summary, f)
