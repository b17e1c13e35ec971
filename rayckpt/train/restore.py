"""How ``Checkpointer.restore`` goes through a run's checkpoints: the order it tries them in, storage and
memory (``candidates``), and what it tells the world (``restored``, ``fell_back``).

A restore: ``rayckpt_restore_seconds`` by the tier restored from, ``rayckpt_restored_bytes`` by where the
bytes came from (this node's memory, a peer's, storage), and the MetadataActor's ``restored`` event
(``rayckpt status`` lists it). A checkpoint passed over: ``rayckpt_restore_fallbacks`` and a
``restore_fallback`` event. The metrics are recorded by the MetadataActor (``metrics.send``): a restore
happens once, as a worker starts, and must reach the export port even when the worker dies soon after.
"""

from __future__ import annotations

import logging
import posixpath
from typing import Any

from ..ray import metrics
from ..ray.metadata.actor import get_metadata_actor
from ..storage.catalog import CatalogEntry, checkpoint_step, entry_order
from .tiers import MEMORY, STORAGE

logger = logging.getLogger("rayckpt.train.checkpointer")

#: One checkpoint to try (``(path, step, tier)``) or one passed over (``(path, step, reason)``).
Tried = tuple[str, int | None, str]


def candidates(
    entries: list[CatalogEntry], held: list[CatalogEntry], reported: str | None
) -> tuple[list[Tried], list[Tried]]:
    """What ``restore`` tries, newest first: ``(path, step, tier)``; and what it passes over at
    once, ``(path, step, reason)``: checkpoints newer than those whose manifest the catalog lists corrupt.

    ``entries``: the run's catalog in storage; ``held``: its memory tier's (``[]``: none);
    ``reported``: the path of Ray Train's latest checkpoint (``None``: none). The newest
    committed checkpoint in storage comes first even when Ray Train has not registered
    it yet (a worker died right after its commit): fewer steps are lost. Ray Train's
    latest, when the catalog does not list it committed (its directory or manifest gone),
    is tried in its place, so its loss is reported, not skipped. Of two committed
    checkpoints with the same step, the one in memory comes first.
    """
    tried = [(_order(e, STORAGE), e.path, e.step, STORAGE) for e in entries if e.status == "committed"]
    tried += [(_order(e, MEMORY), e.path, e.step, MEMORY) for e in held if e.status == "committed"]
    entries = [*entries, *(e for e in held if e.status == "corrupt")]
    if reported is not None and not any(posixpath.normpath(e.path) == posixpath.normpath(reported) for e in entries):
        step = checkpoint_step(reported)
        tried.append(((step is not None, step or 0, 0, 0.0, posixpath.normpath(reported)), reported, step, STORAGE))
    tried.sort(key=lambda c: c[0], reverse=True)
    newest = tried[0][0] if tried else None
    corrupt = sorted((e for e in entries if e.status == "corrupt"), key=entry_order, reverse=True)
    passed_over = [
        (e.path, e.step, e.error or "its manifest is corrupt")
        for e in corrupt
        if newest is None or _order(e, STORAGE) > newest
    ]
    return [(path, step, tier) for _, path, step, tier in tried], passed_over


def reason(exc: BaseException) -> str:
    """An error's message on one line (a multi-rank load error lists each rank on its own), for the
    fallback WARNING and ``RestoreFailedError``."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _order(e: CatalogEntry, tier: str) -> tuple:
    """Restore's order: newest step first; of one step, memory before storage."""
    return (e.step is not None, e.step or 0, tier == MEMORY, e.created, e.path)


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


def ray_data_names() -> list[str]:
    """The Ray Data datasets this Ray Train run's workers read (``ray.train.get_dataset_shard``).

    Ray Train keeps them on its train context's dataset shard provider, an internal object:
    any change in it reads as none ([]).
    """
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return sorted(get_train_context().dataset_shard_provider._dataset_names)
    except Exception:  # noqa: BLE001 - an internal API: when it moves, nothing is warned of
        return []


def warn_ray_data(run: str, step: int | None, names: list[str]) -> None:
    """Rank 0's one WARNING at a restore of a run that reads Ray Data datasets: their position is not restored."""
    logger.warning(
        "rayckpt: run %s restored step %s, and it reads Ray Data dataset(s) %s: Ray Data keeps no position, so "
        "each worker's shard starts its dataset over (the rows consumed before the checkpoint are read again); "
        "for an exact resume read a map-style dataset through rayckpt.data.ResumableSampler (docs/data.md)",
        run,
        step,
        names,
    )
