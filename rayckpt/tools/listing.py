"""``ls``: the checkpoints under a storage path, laid out as Ray Train does (``<storage>/<run>/<checkpoint>``).

Uses the storage catalog, the same one the MetadataActor keeps; ``rayckpt ls``
prints it.
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

    Args:
        storage_path: A local path or ``pyarrow.fs`` URI: a storage path, a run
            directory, or a checkpoint itself.
        run: Only the checkpoints of ``<storage_path>/<run>``; None: every run's.

    Returns:
        One ``CatalogEntry`` per directory holding a manifest or shard files
            (status "committed", "incomplete" or "corrupt", with the reason),
            sorted by run, then step.

    Raises:
        CheckpointNotFoundError: ``storage_path`` (or ``<storage_path>/<run>``) is
            not a directory.
    """
    base = CheckpointDir.resolve(storage_path)
    if base.fs.get_file_info(base.fs_path).type != pafs.FileType.Directory:
        raise CheckpointNotFoundError(f"{base.location}: no such directory")
    if run is not None:
        base = base.child(run)
        if base.fs.get_file_info(base.fs_path).type != pafs.FileType.Directory:
            raise CheckpointNotFoundError(f"no run {run!r}: {base.location} is not a directory")
    if looks_like_checkpoint(base):
        candidates = [(posixpath.basename(posixpath.dirname(base.fs_path)), base)]
    else:
        candidates = []
        for name in base.list_dirs():
            child = base.child(name)
            if looks_like_checkpoint(child):
                candidates.append((posixpath.basename(base.fs_path), child))
            else:
                candidates.extend((name, child.child(sub)) for sub in child.list_dirs())
    found = [e for run_name, ckdir in candidates if (e := describe(ckdir, run_name)) is not None]
    return tuple(sorted(found, key=lambda e: (e.run, *entry_order(e))))
