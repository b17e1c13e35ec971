"""The shared store of incremental saves: shard files that outlive the checkpoint directory that wrote them.

An incremental save writes its new shard files into ``<parent>/.rayckpt-shared/``,
beside the checkpoint directories (``<parent>/<checkpoint>/``), and names them in
its manifest as ``../.rayckpt-shared/<name>`` (format version 5); a chunk it did
not change is a reference to the file an earlier save wrote it in. Deleting a
checkpoint directory (Ray Train's retention, ``rayckpt rm``) therefore never
deletes bytes another checkpoint names. The store is collected by mark and sweep
(``sweep_store``): a file goes when no manifest beside the store names it, no live
save owns it (its lease) and no live save keeps it for sharing (the save's keeps
file). The rules, and what a crash at any point leaves: docs/FORMAT.md, "The shared store".
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pyarrow.fs as pafs

from ..errors import CheckpointNotFoundError
from ..format.file_paths import SHARED_DIR, SHARED_PREFIX, is_shared
from ..format.manifest import MANIFEST_NAME
from .checkpoint_dir import CheckpointDir
from .lease import LEASE_PREFIX, read_leases, release_lease, write_lease
from .names import new_save_id, shard_file_save_id

#: A sweep gives up (deleting nothing more) when its own marker has less than this left to live.
SWEEP_MARGIN_S = 15.0
#: The save id part of a sweep's marker lease in the store.
SWEEP_MARK = "sweep-"


def store_of(ckdir: CheckpointDir) -> CheckpointDir:
    """The shared store a checkpoint directory's incremental saves write to: ``<parent>/.rayckpt-shared``."""
    return ckdir.parent().child(SHARED_DIR)


def shared_path(name: str) -> str:
    """How a manifest names store file ``name``: relative to the checkpoint directory."""
    return SHARED_PREFIX + name


def store_name(path: str) -> str:
    """The store file a manifest's ``../.rayckpt-shared/<name>`` path names."""
    return path[len(SHARED_PREFIX) :]


def keeps_name(save_id: str) -> str:
    """The file in its checkpoint directory listing the store files a save in flight shares."""
    return f"{save_id}-keeps.json"


def write_keeps(ckdir: CheckpointDir, save_id: str, names: frozenset[str]) -> None:
    """Before claiming the location: record the store files ``save_id`` will share (they are kept while it is live)."""
    ckdir.makedirs()
    ckdir.write_atomic(keeps_name(save_id), json.dumps(sorted(names)).encode(), durable=False)


def is_dir(ckdir: CheckpointDir) -> bool:
    return ckdir.fs.get_file_info(ckdir.fs_path).type == pafs.FileType.Directory


def sweep_running(ckdir: CheckpointDir) -> bool:
    """Whether a collection of ``ckdir``'s store is under way (a live sweep marker): a save that sees
    one shares nothing, so no file it would share can be one the sweep decided to delete."""
    now = time.time()
    return any(x.save_id.startswith(SWEEP_MARK) and x.is_live(now) for x in read_leases(store_of(ckdir)))


def stored_refs(ckdir: CheckpointDir) -> tuple[str, frozenset[str]] | None:
    """(save id, store files it names) of the manifest in ``ckdir``; None when there is none.

    Reads only ``manifest.json``'s ``save_id`` and ``files``. Raises ``ValueError`` when the
    manifest does not parse: a collection then deletes nothing.
    """
    try:
        doc = json.loads(ckdir.read_bytes(MANIFEST_NAME))
    except CheckpointNotFoundError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), list):
        raise ValueError(f"{ckdir.location}/{MANIFEST_NAME}: no list of files")
    paths = [f.get("path") if isinstance(f, dict) else None for f in doc["files"]]
    if not all(isinstance(p, str) for p in paths):
        raise ValueError(f"{ckdir.location}/{MANIFEST_NAME}: a file without a path")
    return str(doc.get("save_id", "")), frozenset(store_name(p) for p in paths if is_shared(p))


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreSweep:
    """What a collection of a shared store found and did."""

    #: The store's location ("" when there is no store).
    path: str = ""
    #: (name, bytes) of each store file removed (or, dry run, that would be).
    removed: tuple[tuple[str, int], ...] = ()
    #: Store files kept: named by a manifest, or owned or kept by a live save.
    kept: int = 0
    #: Why nothing was removed ("" when the sweep ran).
    skipped: str = ""


def sweep_store(parent: CheckpointDir, *, dry_run: bool = False) -> StoreSweep:
    """Collect the shared store beside ``parent``'s checkpoint directories: mark and sweep.

    Call order (each step a listing or a read; the proof that no kept file is lost is in
    docs/FORMAT.md, "The shared store"):

    1. Write a sweep marker (a lease in the store): a save that sees it shares nothing.
    2. List the store's files.
    3. Mark what every live save owns (its save id) or keeps (its keeps file).
    4. Mark what every manifest beside the store names; one that does not parse stops the sweep.
    5. Mark as in 3 again: a save that went live and committed between 3 and 4 is seen.
    6. Delete each listed file left unmarked, unless the marker came near its end; delete dead markers.
    7. Delete the marker.
    """
    store = parent.child(SHARED_DIR)
    if not is_dir(store):
        return StoreSweep()
    marker = SWEEP_MARK + new_save_id()
    lease = None if dry_run else write_lease(store, marker)
    try:
        infos = store.fs.get_file_info(pafs.FileSelector(store.fs_path, allow_not_found=True))
        files = {i.base_name: i.size or 0 for i in infos if i.type == pafs.FileType.File}
        packs = {n: size for n, size in files.items() if shard_file_save_id(n) is not None}
        live, kept = _live_saves(parent)
        named: set[str] = set()
        for name in parent.list_dirs():
            try:
                refs = stored_refs(parent.child(name))
            except (ValueError, OSError) as exc:
                return StoreSweep(path=store.location, kept=len(packs), skipped=f"{exc}: nothing removed")
            if refs is not None:
                named |= refs[1]
        live2, kept2 = _live_saves(parent)
        if kept is None or kept2 is None:
            return StoreSweep(path=store.location, kept=len(packs), skipped="a live save's keeps file is unreadable")
        marked = named | kept | kept2
        owners = live | live2
        going = [(n, s) for n, s in sorted(packs.items()) if n not in marked and shard_file_save_id(n) not in owners]
        if lease is not None and time.time() > lease.expires - SWEEP_MARGIN_S:
            return StoreSweep(path=store.location, kept=len(packs), skipped="the sweep ran too long: nothing removed")
        if not dry_run:
            for name, _ in going:
                store.delete(name)
            now = time.time()
            for x in read_leases(store):
                if x.save_id != marker and not x.is_live(now):
                    store.delete(f"{LEASE_PREFIX}{x.save_id}")
        return StoreSweep(path=store.location, removed=tuple(going), kept=len(packs) - len(going))
    finally:
        if lease is not None:
            release_lease(store, marker)


def _live_saves(parent: CheckpointDir) -> tuple[set[str], set[str] | None]:
    """The saves with a live lease in any checkpoint directory of ``parent``, and the store files they keep
    (None: a keeps file of a live save does not read)."""
    now = time.time()
    live: set[str] = set()
    kept: set[str] | None = set()
    for name in parent.list_dirs():
        ckdir = parent.child(name)
        ids = {x.save_id for x in read_leases(ckdir) if x.is_live(now)}
        live |= ids
        for save_id in ids:
            try:
                data = ckdir.read_bytes(keeps_name(save_id))
            except CheckpointNotFoundError:
                continue
            try:
                names = json.loads(data)
                if kept is not None:
                    kept |= {str(n) for n in names}
            except (ValueError, TypeError):
                kept = None
    return live, kept


def settle_store(ckdir: CheckpointDir, save_id: str, shares: bool) -> StoreSweep:
    """After a commit at ``ckdir``: drop the save's keeps file (its manifest names the files now) and
    collect the store beside it, if there is one."""
    store = store_of(ckdir)
    if not shares and not is_dir(store):
        return StoreSweep()
    ckdir.delete(keeps_name(save_id))
    return sweep_store(ckdir.parent())
