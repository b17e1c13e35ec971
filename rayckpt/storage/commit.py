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

import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptCheckpointError, SaveFailedError
from ..format.manifest import (
    MANIFEST_NAME,
    ChunkEntry,
    FileEntry,
    Manifest,
    TensorEntry,
    ValueEntry,
    decode_manifest,
    encode_manifest,
    find_manifest_problems,
)
from ..format.paths import Path
from ..format.shard_file import WrittenChunk
from .checkpoint_dir import CheckpointDir


def new_save_id() -> str:
    """A save's id: its start time and a random suffix (``20260101T120000-1a2b3c4d``).

    Shard files start with it, so a failed save's files can be found by prefix.
    """
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"


def shard_file_name(save_id: str, rank: int, storage_type: str) -> str:
    """The shard file ``rank`` writes for one storage type (FORMAT.md: file naming)."""
    return f"{save_id}-r{rank:05d}-{storage_type}.arrow"


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """What every rank agrees on before writing: the same on every rank, sent to the committer."""

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


@dataclass(frozen=True, slots=True)
class WrittenShard:
    """What one rank wrote for a save: its chunks' records and its durable files."""

    rank: int
    chunks: tuple[WrittenChunk, ...]
    files: tuple[FileEntry, ...]

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)


def create_manifest(spec: SaveSpec, shards: Iterable[WrittenShard]) -> Manifest:
    """The validated manifest of a save from every rank's shard (files in rank order).

    Raises ``SaveFailedError`` when the chunks do not tile every tensor exactly.
    """
    shards = sorted(shards, key=lambda s: s.rank)
    chunks: dict[str, list[ChunkEntry]] = {k: [] for k in spec.tensors}
    for w in (w for s in shards for w in s.chunks):
        chunks[w.key].append(ChunkEntry(w.box, w.file, w.byte_offset, w.byte_length, w.checksums))
    entries: dict[str, TensorEntry | ValueEntry] = {}
    for key in sorted(spec.tensors):
        dtype, shape = spec.tensors[key]
        chunks_in_order = tuple(sorted(chunks[key], key=lambda c: c.box.offsets))
        entries[key] = TensorEntry(dtype, shape, chunks_in_order, spec.paths.get(key, (key,)))
    for key in sorted(spec.values):
        entries[key] = ValueEntry(spec.values[key], spec.paths.get(key, (key,)))
    files = tuple(f for s in shards for f in s.files)
    manifest = Manifest(
        spec.save_id, spec.world_size, spec.block_size, entries, files, time.time(), user_metadata=spec.metadata
    )
    problems = find_manifest_problems(manifest)
    if problems:
        raise SaveFailedError("refusing to commit an inconsistent checkpoint:\n  " + "\n  ".join(problems[:20]))
    return manifest


def commit_save(ckdir: CheckpointDir, spec: SaveSpec, shards: Iterable[WrittenShard]) -> Manifest:
    """Create the save's manifest and commit it (the committer: rank 0, the MetadataActor, an import)."""
    manifest = create_manifest(spec, shards)
    commit_manifest(ckdir, manifest)
    return manifest


def commit_manifest(ckdir: CheckpointDir, manifest: Manifest) -> None:
    """The commit: write the manifest atomically, then drop files it does not name.

    Files of an older checkpoint at the same location (or of a crashed save) are
    removed only after the new manifest is durable, so some complete checkpoint is
    always on storage.
    """
    ckdir.makedirs()
    ckdir.write_atomic(MANIFEST_NAME, encode_manifest(manifest))
    keep = {f.path for f in manifest.files}
    for name in ckdir.list_files():
        if name.endswith(".arrow") and name not in keep:
            ckdir.delete(name)


def remove_failed_save(ckdir: CheckpointDir, save_id: str, paths: Sequence[str] = ()) -> None:
    """Undo a save that will never commit: its files (``paths`` and any named with its id).

    The directory goes too when nothing else is left in it; a committed
    checkpoint at the same location (its manifest and files) is never touched.
    """
    for rel in paths:
        ckdir.delete(rel)
    for name in ckdir.list_files():
        if name.startswith(f"{save_id}-"):
            ckdir.delete(name)
    if MANIFEST_NAME not in ckdir.list_files():
        ckdir.delete_dir_if_empty()


def read_manifest(ckdir: CheckpointDir) -> Manifest:
    """Read and validate the committed manifest of ``ckdir``."""
    where = f"{ckdir.location}/{MANIFEST_NAME}"
    manifest = decode_manifest(ckdir.read_bytes(MANIFEST_NAME), where=where)
    problems = find_manifest_problems(manifest)
    if problems:
        shown = "\n  ".join(problems[:20])
        raise CorruptCheckpointError(f"{where}: inconsistent manifest ({len(problems)} problem(s)):\n  {shown}")
    return manifest
