"""``gc``: remove what crashed saves left behind, never a committed file or a live save's.

A save that crashed (its process killed) leaves shard files no manifest names,
its lease file, and perhaps a temporary file of an interrupted atomic write. The
next commit at the same location sweeps them (``storage.commit.sweepable_files``);
``gc`` does it for checkpoints nobody saves to again. The rule is the sweep's:
a shard file goes only when the manifest does not name it and its save holds no
live lease (docs/FORMAT.md: Leases); a directory whose manifest cannot be read is left
alone.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pyarrow.fs as pafs

from ..errors import CheckpointNotFoundError, RayckptError
from ..format.manifest import MANIFEST_NAME
from ..storage.checkpoint_dir import CheckpointDir, join_location
from ..storage.commit import checkpoint_files, read_manifest, shard_file_save_id, sweepable_files
from ..storage.lease import LEASE_PREFIX, live_save_ids
from ..storage.shared import StoreSweep, sweep_store

#: What ``CheckpointDir.write_atomic`` writes before renaming (``.<name>.tmp-<8 hex>``).
_TEMP_FILE = re.compile(r"^\..+\.tmp-[0-9a-f]{8}$")


@dataclass(frozen=True, slots=True)
class RemovedFile:
    """A file ``gc`` removed (or, with ``dry_run``, would remove)."""

    path: str
    bytes: int
    why: str


@dataclass(frozen=True, slots=True, kw_only=True)
class GcReport:
    """What ``gc`` found and did under one path."""

    path: str
    dry_run: bool
    #: Directories looked at (the path and its direct subdirectories that hold checkpoint files).
    directories: int
    removed: tuple[RemovedFile, ...]
    #: Saves in flight (a live lease) whose files were kept.
    live_saves: tuple[str, ...]
    #: Directories left alone, with why ("<dir>: <reason>").
    skipped: tuple[str, ...]

    @property
    def bytes_removed(self) -> int:
        return sum(f.bytes for f in self.removed)


def gc(path: str | os.PathLike[str], *, dry_run: bool = False, filesystem: pafs.FileSystem | None = None) -> GcReport:
    """Remove orphaned files under ``path``: a checkpoint directory or a run directory of them.

    Looks at ``path`` and its direct subdirectories, and the shared store of
    incremental saves there (and beside ``path`` when it is a checkpoint:
    ``storage.shared.sweep_store``). Removes shard files that no manifest names and no
    live save owns (or, in the store, keeps), dead lease files and, in a directory
    no save is writing to, leftover temporary files; then a directory left empty
    that holds no checkpoint. A committed file, or a file of a save in flight, is
    never removed; a directory whose manifest cannot be read is left alone.

    Args:
        path: A local path or ``pyarrow.fs`` URI of a checkpoint directory or a
            directory of them.
        dry_run: Remove nothing; report what would go.
        filesystem: A ``pyarrow.fs.FileSystem`` that ``path`` is a path on.

    Returns:
        A ``GcReport``: each file removed (or that would be) and why, the saves in
            flight whose files were kept, and the directories skipped.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or is not a directory.
    """
    root = CheckpointDir.resolve(path, filesystem)
    kind = root.fs.get_file_info(root.fs_path).type
    if kind != pafs.FileType.Directory:
        what = "no such directory" if kind == pafs.FileType.NotFound else "not a directory"
        raise CheckpointNotFoundError(f"{root.location}: {what}")
    removed: list[RemovedFile] = []
    live: list[str] = []
    skipped: list[str] = []
    dirs = [d for d in [root] + [root.child(name) for name in root.list_dirs()] if _holds_checkpoint_files(d)]
    for ckdir in dirs:
        going, why_skipped = _orphans(ckdir, live)
        if why_skipped:
            skipped.append(f"{ckdir.location}: {why_skipped}")
        removed += [f for _, f in going]
        if not dry_run and going:
            for name, _ in going:  # by name: a location's query string (s3://...?endpoint_override=) is no part of it
                ckdir.delete(name)
            if not ckdir.exists(MANIFEST_NAME):
                ckdir.delete_dir_if_empty()  # what a crashed save into a new directory left
    for sweep in _sweep_stores(root, dry_run):
        if sweep.skipped:
            skipped.append(f"{sweep.path}: {sweep.skipped}")
        why = "shared shard file of save {}: no checkpoint beside the store names it, no live save owns or keeps it"
        removed += [
            RemovedFile(join_location(sweep.path, name), size, why.format(shard_file_save_id(name)))
            for name, size in sweep.removed
        ]
    return GcReport(
        path=root.location,
        dry_run=dry_run,
        directories=len(dirs),
        removed=tuple(removed),
        live_saves=tuple(sorted(set(live))),
        skipped=tuple(skipped),
    )


def _sweep_stores(root: CheckpointDir, dry_run: bool) -> list[StoreSweep]:
    """Collect the shared store of incremental saves in ``root`` and, when ``root`` is a checkpoint, beside it."""
    sweeps = [sweep_store(root, dry_run=dry_run)]
    if root.exists(MANIFEST_NAME):
        sweeps.append(sweep_store(root.parent(), dry_run=dry_run))
    return [s for s in sweeps if s.path]


def _holds_checkpoint_files(ckdir: CheckpointDir) -> bool:
    return any(
        n == MANIFEST_NAME or n.startswith(LEASE_PREFIX) or shard_file_save_id(n) is not None
        for n in ckdir.list_files()
    )


def _orphans(ckdir: CheckpointDir, live: list[str]) -> tuple[list[tuple[str, RemovedFile]], str]:
    """``ckdir``'s orphaned files (name, record), and why it was skipped ("" if it was not); adds its live
    saves to ``live``."""
    # Files, then leases, then the manifest: a save that commits and drops its lease between
    # these looks is then named by the manifest read last, so its files are never taken.
    names = ckdir.list_files()
    going = sweepable_files(ckdir, set())  # lists again, then reads the leases
    keep: set[str] = set()
    if ckdir.exists(MANIFEST_NAME):
        try:
            keep = checkpoint_files(read_manifest(ckdir))
        except RayckptError as exc:
            return [], f"manifest unreadable, nothing removed ({str(exc).splitlines()[0]})"
    going = [n for n in going if n not in keep]
    in_flight = live_save_ids(ckdir)
    live.extend(in_flight)
    if not in_flight:
        going += [n for n in names if _TEMP_FILE.match(n) and n not in going]
    removed = []
    for name in going:
        owner = shard_file_save_id(name)
        if owner is not None:
            why = f"shard file of save {owner}: no manifest names it and the save holds no live lease"
        elif name.startswith(LEASE_PREFIX):
            why = "lease of a save that is no longer live"
        else:
            why = "temporary file of an interrupted write"
        removed.append((name, RemovedFile(join_location(ckdir.location, name), ckdir.size(name) or 0, why)))
    return removed, ""
