"""Process bodies for the load-planning tests: a FSDP2 load that records what each rank read and received."""

from __future__ import annotations

from typing import Any

import torch

import rayckpt
from rayckpt.engine import load as engine_load
from rayckpt.engine.app_state import AppState
from rayckpt.errors import RayckptError
from rayckpt.format.manifest import MANIFEST_NAME
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.testing.toy import build_fsdp, full_state

#: ``odd_rank`` values of ``recording_load_worker``: no rank asks for an extra key, or every rank does.
NONE, EVERY = -1, -2


def recording_load_worker(rank: int, world_size: int, loads: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Each ``(path, odd_rank)`` of ``loads``: load ``path`` into a fresh FSDP2 toy model, ``odd_rank``
    asking for a tensor the checkpoint lacks too (``EVERY``: every rank, a plain value); count this rank's reads of the
    manifest file (every read of it goes through ``CheckpointDir.read_bytes``) and keep what
    ``plan_at_root`` gave it (its ``RankSlice``, or ``None`` when it planned from the manifest itself)."""
    manifest_reads: list[str] = []
    received: list[Any] = []
    read_bytes, plan_at_root = CheckpointDir.read_bytes, engine_load.plan_at_root

    def counting(self: CheckpointDir, rel: str) -> bytes:
        if rel == MANIFEST_NAME:
            manifest_reads.append(self.location)
        return read_bytes(self, rel)

    def recording(*args: Any, **kwargs: Any) -> Any:
        received.append(plan_at_root(*args, **kwargs))
        return received[-1]

    CheckpointDir.read_bytes = counting  # type: ignore[method-assign]
    engine_load.plan_at_root = recording  # type: ignore[assignment]
    results = []
    for path, odd_rank in loads:
        manifest_reads.clear()
        received.clear()
        model, optim = build_fsdp(world_size, seed=1234)
        app = AppState(model, optim, step=0)
        out: dict[str, Any] = {}
        try:
            extra = {"extra.w": torch.zeros(2)} if odd_rank == rank else {"extra.v": 7} if odd_rank == EVERY else {}
            out["info"] = rayckpt.load({"app": app, **extra}, path)
        except RayckptError as exc:
            out["error"] = (type(exc).__name__, str(exc))
        out["manifest_reads"] = len(manifest_reads)
        out["slice"] = type(received[0]).__name__ if received else None
        if "info" in out:
            out.update(state=full_state(app), step=app.extras["step"])
            if received[0] is not None:
                out.update(files=received[0].files, sizes=received[0].file_sizes)
        results.append(out)
    return results
