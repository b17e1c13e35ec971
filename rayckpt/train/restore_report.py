"""What ``Checkpointer.restore`` tells the world: metrics on every rank, and on rank 0 a log line and an event.

A restore: ``rayckpt_restore_seconds`` by the tier restored from, ``rayckpt_restored_bytes`` by where the
bytes came from (this node's memory, a peer's, storage), and the MetadataActor's ``restored`` event
(``rayckpt status`` lists it). A checkpoint passed over: ``rayckpt_restore_fallbacks`` and a
``restore_fallback`` event. The metrics are recorded by the MetadataActor (``metrics.send``): a restore
happens once, as a worker starts, and must reach the export port even when the worker dies soon after.
"""

from __future__ import annotations

import logging
from typing import Any

from ..ray import metrics
from ..ray.metadata.actor import get_metadata_actor
from .tiers import MEMORY, STORAGE

logger = logging.getLogger("rayckpt.train.checkpointer")


def restored(run: str, rank: int, world_size: int, done: dict[str, Any], seconds: float) -> None:
    """Rank ``rank`` of ``world_size`` restored ``done`` (``Checkpointer.restored_from``) in ``seconds``."""
    tier, nbytes, peer = done["tier"], done["bytes_read"], done["peer_bytes"]
    metrics.send("rayckpt_restore_seconds", seconds, run=run, tier=tier)
    local = (MEMORY + "_local") if tier == MEMORY else STORAGE
    metrics.send("rayckpt_restored_bytes", nbytes - peer, run=run, tier=local)
    if peer:
        metrics.send("rayckpt_restored_bytes", peer, run=run, tier=MEMORY + "_peer")
    logger.info("rayckpt: rank %d restored step %s from %s (%s)", rank, done["step"], done["path"], tier)
    if rank == 0:
        event = {**done, "seconds": seconds, "world_size": world_size}
        get_metadata_actor().record_event.remote(run, "restored", event)


def fell_back(run: str, passed: dict[str, Any]) -> None:
    """Rank 0: restore passed over ``passed`` (``Checkpointer.fallbacks``' record) for an older checkpoint."""
    logger.warning(
        "rayckpt: run %s: cannot restore step %s from %s (%s); restoring step %s from %s instead",
        run,
        passed["step"],
        passed["path"],
        passed["reason"],
        passed["next_step"],
        passed["next"],
    )
    metrics.send("rayckpt_restore_fallbacks", 1, run=run)
    get_metadata_actor().record_event.remote(run, "restore_fallback", passed)
