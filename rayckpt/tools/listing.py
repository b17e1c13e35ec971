"""Look into checkpoints without a cluster: list, inspect, verify, plan, consolidate.

One process, no process group, no Ray. Every function reads the manifest with
the engine's validation and every tensor byte through the engine's verified
reader; tensors are assembled one at a time, so memory stays about the size of
the largest tensor (``consolidate`` excepted: it returns the whole state).
Results are frozen dataclasses; the ``rayckpt`` command prints them as text or
JSON (``docs/CLI.md``).
"""

from __future__ import annotations

import os
import posixpath

import pyarrow.fs as pafs

from ..errors import CheckpointNotFoundError
from ..storage.catalog import CatalogEntry, describe, entry_order, looks_like_checkpoint
from ..storage.checkpoint_dir import CheckpointDir


def ls(storage_path: str | os.PathLike[str], run: str | None = None) -> tuple[CatalogEntry, ...]:
    """Checkpoints under ``storage_path``: ``<storage_path>/<run>/<checkpoint>`` as Ray Train lays them out.

    ``storage_path`` may also be a run directory or a checkpoint itself. With
    ``run``, only ``<storage_path>/<run>``. Sorted by run, then step.
    """
    base = CheckpointDir.resolve(storage_path)
    if base.fs.get_file_info(base.root).type != pafs.FileType.Directory:
        raise CheckpointNotFoundError(f"{base.uri}: no such directory")
    if run is not None:
        base = base.child(run)
        if base.fs.get_file_info(base.root).type != pafs.FileType.Directory:
            raise CheckpointNotFoundError(f"no run {run!r}: {base.uri} is not a directory")
    if looks_like_checkpoint(base):
        candidates = [(posixpath.basename(posixpath.dirname(base.root)), base)]
    else:
        candidates = []
        for name in base.list_dirs():
            child = base.child(name)
            if looks_like_checkpoint(child):
                candidates.append((posixpath.basename(base.root), child))
            else:
                candidates.extend((name, child.child(sub)) for sub in child.list_dirs())
    found = [e for run_name, ckdir in candidates if (e := describe(ckdir, run_name)) is not None]
    return tuple(sorted(found, key=lambda e: (e.run, *entry_order(e))))
