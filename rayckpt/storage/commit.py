"""A save's life on storage, each step in one place: its id, its file names, the commit, the cleanup.

Every save path goes through here: ``rayckpt.save`` (rank 0 commits), the Ray
MetadataActor (commits once every rank's files are durable) and ``rayckpt
convert`` imports (one process). A save is ``SaveSpec`` (agreed by every rank
before anything is written) plus each rank's ``WrittenShard``;
``commit_save`` turns them into a validated manifest and writes it last,
atomically: before that write the checkpoint does not exist. A save that fails
is undone by ``remove_failed_save``.
"""

from __future__ import annotations

import gc
import os
import posixpath
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pyarrow.fs as pafs

from ..errors import CorruptCheckpointError, SaveFailedError
from ..format.chunk_columns import ChunkColumns
from ..format.chunk_rows import ChunkRows
from ..format.file_paths import is_shared, written_bytes
from ..format.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    SHARED_VERSION,
    FileEntry,
    Manifest,
    TensorEntry,
    ValueEntry,
)
from ..format.manifest_checks import find_manifest_problems
from ..format.manifest_files import decode_manifest_files, encode_manifest_files
from ..format.paths import Path
from ..format.shard_file import WrittenChunk
from ..phases import phase
from .checkpoint_dir import CheckpointDir, join_location
from .lease import LEASE_PREFIX, check_commit, read_leases
from .names import new_save_id as new_save_id
from .names import shard_file_name as shard_file_name
from .names import shard_file_save_id
from .shared import settle_store


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveSpec:
    """A save as its committer sees it (rank 0, then the MetadataActor on Ray): the ids, world size,
    block size and metadata are the same on every rank; only rank 0 holds every tensor, value and path
    (``engine.save_layout``: the others get empty ones)."""

    save_id: str
    world_size: int
    block_size: int
    #: Every tensor key's (dtype, global shape).
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    #: Plain values in their stored (tagged JSON) form.
    values: dict[str, Any]
    #: The manifest's ``user_metadata``.
    metadata: dict[str, Any] = field(default_factory=dict)
    #: Each key's path through the nested state dict (keys without one: the key alone).
    paths: dict[str, Path] = field(default_factory=dict)
    #: The save id committed at the location when this save claimed it ("" for none), from
    #: ``lease.claim_location``; the commit refuses if another save committed since.
    #: ``None``: the save did not claim the location (only the leases are checked).
    previous: str | None = None
    #: The manifest's ``data_position``: the job's place in its data (``rayckpt.data``); None: none saved.
    data_position: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class WrittenShard:
    """What one rank wrote for a save: its chunks' records and its durable files."""

    rank: int
    chunks: tuple[WrittenChunk, ...]
    files: tuple[FileEntry, ...]
    #: The save's id: an incremental save's ``files`` also name the shared files earlier saves wrote.
    save_id: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of the files this rank wrote for the save (not those it shares)."""
        return written_bytes(self.save_id, self.files)


def create_manifest(spec: SaveSpec, shards: Iterable[WrittenShard]) -> Manifest:
    """The validated manifest of a save from every rank's shard (files in rank order).

    The chunks go straight into columns (``ChunkColumns.from_chunks``: a tensor's
    chunks in box order), which the tensor entries index and the commit writes as
    the chunk table: no object per chunk is built. Raises ``SaveFailedError`` when
    the chunks do not tile every tensor exactly.
    """
    shards = sorted(shards, key=lambda s: s.rank)
    keys = sorted(spec.tensors)
    # A file in the shared store may be named by several ranks' shards (each references what it shares).
    files = tuple({f.path: f for s in shards for f in s.files}.values())
    try:
        columns = ChunkColumns.from_chunks(
            keys,
            [spec.tensors[k][0] for k in keys],
            [spec.tensors[k][1] for k in keys],
            [f.path for f in files],
            [w for s in shards for w in s.chunks],
        )
    except KeyError as exc:
        raise SaveFailedError(f"a rank wrote chunks of {exc}, which is not a tensor of this save") from None
    entries: dict[str, TensorEntry | ValueEntry] = {}
    first = columns.first.tolist()
    for i, key in enumerate(keys):
        dtype, shape = spec.tensors[key]
        rows = ChunkRows(columns, first[i], first[i] + int(columns.counts[i]))
        entries[key] = TensorEntry(dtype, shape, rows, spec.paths.get(key, (key,)))
    for key in sorted(spec.values):
        entries[key] = ValueEntry(spec.values[key], spec.paths.get(key, (key,)))
    manifest = Manifest(
        save_id=spec.save_id,
        world_size=spec.world_size,
        block_size=spec.block_size,
        entries=entries,
        files=files,
        created=time.time(),
        user_metadata=spec.metadata,
        data_position=spec.data_position,
        columns=columns,
        version=SHARED_VERSION if any(is_shared(f.path) for f in files) else FORMAT_VERSION,
    )
    problems = find_manifest_problems(manifest)
    if problems:
        raise SaveFailedError("refusing to commit an inconsistent checkpoint:\n  " + "\n  ".join(problems[:20]))
    return manifest


def commit_save(ckdir: CheckpointDir, spec: SaveSpec, shards: Iterable[WrittenShard]) -> Manifest:
    """Create the save's manifest and commit it (the committer: rank 0, the MetadataActor, an import).

    Call order, once every rank's files are durable:

    1. Build and validate the manifest from ``spec`` and every rank's shard.
    2. Check the lease: refuse when another save owns the location or committed
       there since this one claimed it (``lease.check_commit``).
    3. Write the chunk table, then ``manifest.json``, each atomically: the
       checkpoint exists from this write on.
    4. Delete the files of the checkpoint replaced and of dead saves.

    The save's lease is its owner's to release, after this returns.

    Args:
        ckdir: The checkpoint directory the save was written to.
        spec: The save as the ranks agreed on it (ids, world size, block size,
            every tensor, value and path).
        shards: Every rank's ``WrittenShard``, in any order.

    Returns:
        The committed ``Manifest``.

    Raises:
        SaveFailedError: The chunks do not tile every tensor exactly, or another
            save owns the location or committed there since this save claimed it.
            Nothing is committed.
    """
    with phase("manifest_build"):
        manifest = create_manifest(spec, shards)
    with phase("commit_check"):
        check_commit(ckdir, spec.save_id, spec.previous)
    commit_manifest(ckdir, manifest)
    return manifest


def commit_manifest(ckdir: CheckpointDir, manifest: Manifest) -> None:
    """The commit: write the manifest atomically, then drop the files of dead or superseded saves.

    Files of an older checkpoint at the same location (or of a crashed save) are
    removed only after the new manifest is durable, so some complete checkpoint is
    always on storage. A file is removed only when the manifest does not name it
    and its save holds no live lease: the files of a save still in flight (another
    job's, which its claim let through only if this save's lease had lapsed) are
    never touched. Dead leases go too.
    """
    ckdir.makedirs()
    with phase("manifest_encode"):
        files = encode_manifest_files(manifest)
    for name, data in files:  # the chunk table (version 4), then the JSON
        with phase("manifest_write" if name == MANIFEST_NAME else "chunk_table_write"):
            ckdir.write_atomic(name, data)
    with phase("sweep"):
        for name in sweepable_files(ckdir, checkpoint_files(manifest), manifest.save_id):
            ckdir.delete(name)
        settle_store(ckdir, manifest.save_id, any(is_shared(f.path) for f in manifest.files))


def checkpoint_files(manifest: Manifest) -> set[str]:
    """The files a committed checkpoint consists of besides ``manifest.json``: shard files, chunk table."""
    return {f.path for f in manifest.files} | set(manifest.table_files)


def sweepable_files(ckdir: CheckpointDir, keep: set[str], save_id: str = "") -> list[str]:
    """Shard files not in ``keep`` of saves with no live lease, and dead leases (not ``save_id``'s).

    Lists the files before reading the leases: a save writes its lease before its
    first file, so every file listed of a save in flight has a lease that is read.
    """
    names = ckdir.list_files()
    leases = read_leases(ckdir)
    now = time.time()
    live = {x.save_id for x in leases if x.is_live(now)} | {save_id}
    dead_leases = {f"{LEASE_PREFIX}{x.save_id}" for x in leases if x.save_id not in live}
    out = []
    for name in names:
        owner = shard_file_save_id(name)
        if (owner is not None and name not in keep and owner not in live) or name in dead_leases:
            out.append(name)
    return out


def remove_failed_save(ckdir: CheckpointDir, save_id: str, paths: Sequence[str] = ()) -> None:
    """Undo a save that will never commit: its files (``paths`` and any named with its id).

    The directory goes too when nothing else is left in it; a committed
    checkpoint at the same location (its manifest and files) is never touched.
    """
    for rel in paths:
        if shard_file_save_id(posixpath.basename(rel)) == save_id:  # never a shared file an earlier save wrote
            ckdir.delete(rel)
    for name in ckdir.list_files():
        if name.startswith(f"{save_id}-"):
            ckdir.delete(name)
    if MANIFEST_NAME not in ckdir.list_files():
        ckdir.delete_dir_if_empty()


class WrittenFiles:
    """The shard files one rank (or its node's ShardWriter) writes for a save, and what undoes them.

    A writer ``add``s each file before writing it. As a context manager: an exception
    leaving the block removes them, or with ``whole_save`` the whole save
    (``remove_failed_save``: every file named with its id, the directory if left empty).
    A caller that learns the outcome another way calls ``remove`` / ``remove_save`` itself.
    """

    def __init__(self, ckdir: CheckpointDir, save_id: str, *, whole_save: bool = False) -> None:
        self.ckdir = ckdir
        self.save_id = save_id
        self.whole_save = whole_save
        self._paths: list[str] = []

    @property
    def paths(self) -> tuple[str, ...]:
        """The files added, relative to ``ckdir``, in the order they were added."""
        return tuple(self._paths)

    def add(self, paths: Iterable[str]) -> None:
        self._paths.extend(paths)

    def remove(self) -> None:
        """Delete the files added (only those named with this save's id: never an earlier save's shared file)."""
        for rel in self._paths:
            if shard_file_save_id(posixpath.basename(rel)) == self.save_id:
                self.ckdir.delete(rel)

    def remove_save(self) -> None:
        """Undo the whole save: the files added and any named with its id (``remove_failed_save``)."""
        remove_failed_save(self.ckdir, self.save_id, self._paths)

    def __enter__(self) -> WrittenFiles:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.remove_save() if self.whole_save else self.remove()


def decode_stored_manifest(ckdir: CheckpointDir) -> Manifest:
    """Read and decode the manifest of ``ckdir`` and its chunk table (version 4), without the
    consistency checks ``read_manifest`` adds; a file that does not parse raises ``CorruptCheckpointError``."""
    data = ckdir.read_bytes(MANIFEST_NAME)
    where = join_location(ckdir.location, MANIFEST_NAME)
    return decode_manifest_files(data, where, ckdir.read_bytes, partial(join_location, ckdir.location))


def read_manifest(
    checkpoint: CheckpointDir | str | os.PathLike[str], filesystem: pafs.FileSystem | None = None
) -> Manifest:
    """Read and validate the committed manifest of a checkpoint, without reading any shard file.

    The manifest's consistency is checked too (dtypes, sizes, checksum counts,
    chunks tiling every tensor exactly once).

    Args:
        checkpoint: A ``CheckpointDir``, or a local path or URI (``s3://...``).
        filesystem: A ``pyarrow.fs.FileSystem`` that ``checkpoint`` is a path on,
            as for ``rayckpt.load``.

    Returns:
        The checkpoint's ``Manifest``: its save id, world size, block size, tensor
            and value entries, files and ``user_metadata``.

    Raises:
        CheckpointNotFoundError: The location holds no manifest.
        CorruptCheckpointError: The manifest (or its chunk table) does not parse,
            or is inconsistent; the message names the file and each problem.
        FormatVersionError: The manifest was written by an unknown format version.
        TypeError: ``checkpoint`` is neither a path, a URI nor a ``CheckpointDir``.
    """
    if isinstance(checkpoint, (str, os.PathLike)):
        ckdir = CheckpointDir.resolve(checkpoint, filesystem)
    elif isinstance(checkpoint, CheckpointDir):
        ckdir = checkpoint
    else:
        raise TypeError(
            f"read_manifest takes a checkpoint path, URI or CheckpointDir, got {type(checkpoint).__name__} "
            f"{checkpoint!r}"
        )
    with phase("manifest_read"):
        return _read_manifest(ckdir)


def _read_manifest(ckdir: CheckpointDir) -> Manifest:
    where = join_location(ckdir.location, MANIFEST_NAME)
    # The cyclic garbage collector stays paused through the validation too (as in ``decode_manifest``):
    # decoding a large manifest makes millions of objects, and a collector pass over them, which frees
    # none, would otherwise run in the middle of the read.
    paused = gc.isenabled()
    gc.disable()
    try:
        manifest = decode_stored_manifest(ckdir)
        problems = find_manifest_problems(manifest)
    finally:
        if paused:
            gc.enable()
    if problems:
        shown = "\n  ".join(problems[:20])
        raise CorruptCheckpointError(f"{where}: inconsistent manifest ({len(problems)} problem(s)):\n  {shown}")
    return manifest
