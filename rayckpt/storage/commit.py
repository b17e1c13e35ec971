"""``save`` and ``load``: plan, write, commit, read.

Roles: every rank calls ``save`` / ``load`` (collective when a process group is
initialized). Rank 0 commits. Each phase ends in one all-gather that carries
failures, so an error on any rank is raised on every rank and nobody hangs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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
from ..format.shard_file import (
    WrittenChunk,
)
from .checkpoint_dir import CheckpointDir


def create_manifest(
    tensor_meta: dict[str, tuple[str, tuple[int, ...]]],
    written: Sequence[WrittenChunk],
    files: Sequence[FileEntry],
    values: dict[str, Any],
    save_id: str,
    world_size: int,
    block_size: int,
    metadata: dict[str, Any],
) -> Manifest:
    """Assemble and validate the manifest from every rank's written chunks (rank 0 / MetadataActor)."""
    chunks: dict[str, list[ChunkEntry]] = {k: [] for k in tensor_meta}
    for w in written:
        chunks[w.key].append(ChunkEntry(w.box, w.file, w.byte_offset, w.byte_length, w.checksums))
    entries: dict[str, TensorEntry | ValueEntry] = {}
    for key in sorted(tensor_meta):
        dtype, shape = tensor_meta[key]
        entries[key] = TensorEntry(dtype, shape, tuple(sorted(chunks[key], key=lambda c: c.box.offsets)))
    for key in sorted(values):
        entries[key] = ValueEntry(values[key])
    manifest = Manifest(save_id, world_size, block_size, entries, tuple(files), time.time(), user_metadata=metadata)
    problems = find_manifest_problems(manifest)
    if problems:
        raise SaveFailedError("refusing to commit an inconsistent checkpoint:\n  " + "\n  ".join(problems[:20]))
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


def read_manifest(ckdir: CheckpointDir) -> Manifest:
    """Read and validate the committed manifest of ``ckdir``."""
    where = f"{ckdir.uri}/{MANIFEST_NAME}"
    manifest = decode_manifest(ckdir.read_bytes(MANIFEST_NAME), where=where)
    problems = find_manifest_problems(manifest)
    if problems:
        shown = "\n  ".join(problems[:20])
        raise CorruptCheckpointError(f"{where}: inconsistent manifest ({len(problems)} problem(s)):\n  {shown}")
    return manifest
