"""The order in which ``Checkpointer.restore`` tries a run's checkpoints, storage and memory."""

from __future__ import annotations

import posixpath

from ..storage.catalog import CatalogEntry, checkpoint_step, entry_order
from .tiers import MEMORY, STORAGE

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
