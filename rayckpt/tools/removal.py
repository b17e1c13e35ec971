"""``remove``: delete one committed checkpoint directory, never a live save's or a directory that is not one.

The removal claims the location as a save does (``storage.lease``): a save in
flight there refuses it, and a save that starts while it runs is refused in turn
until it is done. The manifest goes first, so a removal cut short leaves an
uncommitted directory that ``gc`` or the next save cleans, never a checkpoint
with missing files. Only the files listed before the claim are removed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import pyarrow.fs as pafs

from ..errors import CheckpointNotFoundError, RayckptError, SaveFailedError
from ..format.manifest import MANIFEST_NAME
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import new_save_id
from ..storage.lease import claim_location, committed_save_id, read_leases, release_lease
from ..storage.shared import StoreSweep, sweep_store
from .opening import resolve_checkpoint


class SaveInFlightError(RayckptError):
    """A checkpoint cannot be removed: a save holds a live lease on its directory."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoveReport:
    """What ``remove`` removed (or, with ``dry_run``, would remove)."""

    path: str
    #: The save id in the manifest ("(unreadable manifest)" when it cannot be parsed).
    save_id: str
    dry_run: bool
    #: File names in the directory, the manifest first.
    files: tuple[str, ...]
    bytes: int
    #: The collection of the shared store beside it that followed (incremental saves' files no
    #: checkpoint names any more); empty when there is no store, or with ``dry_run``.
    store: StoreSweep = StoreSweep()


def remove(ckpt: str | os.PathLike[str] | CheckpointDir, *, dry_run: bool = False) -> RemoveReport:
    """Remove the checkpoint directory ``ckpt`` and every file in it.

    A checkpoint whose manifest is damaged is removed like any other. Call order:

    1. List the directory's files, then refuse if a save holds a live lease there.
    2. Claim the location with a lease of its own, as a save does, so a save that
       starts meanwhile is refused until the removal is done.
    3. Delete the files listed in step 1, ``manifest.json`` first: a removal cut
       short leaves an uncommitted directory that ``gc`` or the next save cleans,
       never a checkpoint with missing files.
    4. Release the lease and remove the directory once it is empty.
    5. Collect the shared store beside it, if there is one (``storage.shared.sweep_store``):
       files of incremental saves that no checkpoint left names go; every file a kept
       checkpoint or a live save names stays.

    Args:
        ckpt: A checkpoint directory: a local path, a ``pyarrow.fs`` URI, the
            ``manifest.json`` inside one, or a ``CheckpointDir``.
        dry_run: Check and report; remove nothing.

    Returns:
        A ``RemoveReport``: the save id in the manifest, the files removed (or
            that would be) and their bytes.

    Raises:
        CheckpointNotFoundError: ``ckpt`` is not a checkpoint directory (no
            ``manifest.json``), or holds subdirectories (a run directory, say);
            nothing is removed.
        SaveInFlightError: A save is writing to ``ckpt`` (a live lease); the
            message names it, and nothing is removed.
    """
    ckdir = resolve_checkpoint(ckpt)
    infos = ckdir.fs.get_file_info(pafs.FileSelector(ckdir.fs_path))  # one listing, before the leases are read
    subdirs = sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)
    if subdirs:
        raise CheckpointNotFoundError(
            f"{ckdir.location} holds directories ({', '.join(map(repr, subdirs))}), which a rayckpt "
            "checkpoint never does: nothing removed; `rayckpt rm` takes one checkpoint directory"
        )
    sizes = {i.base_name: i.size or 0 for i in infos if i.type == pafs.FileType.File}
    names = sorted(sizes, key=lambda n: (n != MANIFEST_NAME, n))
    _refuse_live_saves(ckdir)
    report = RemoveReport(
        path=ckdir.location,
        save_id=committed_save_id(ckdir),
        dry_run=dry_run,
        files=tuple(names),
        bytes=sum(sizes.values()),
    )
    if dry_run:
        return report
    claim = new_save_id()
    try:
        claim_location(ckdir, claim, wait_s=0)
    except SaveFailedError:  # a save began since the check above: name it
        _refuse_live_saves(ckdir)
        raise SaveInFlightError(
            f"{ckdir.location}: a save claimed it while it was being removed; nothing removed"
        ) from None
    try:
        for name in names:  # the manifest first
            ckdir.delete(name)
    finally:
        release_lease(ckdir, claim)
    ckdir.delete_dir_if_empty()
    return replace(report, store=sweep_store(ckdir.parent()))


def _refuse_live_saves(ckdir: CheckpointDir) -> None:
    live = [lease for lease in read_leases(ckdir) if lease.is_live()]
    if live:
        raise SaveInFlightError(
            f"{ckdir.location}: a save is writing this checkpoint: {live[0].describe()}; nothing removed. Wait for "
            "it to finish (a lease whose process died lapses within a minute), then run `rayckpt rm` again"
        )
