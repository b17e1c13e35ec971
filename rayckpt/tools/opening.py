"""What a path holds and the manifest of a committed checkpoint, without torch.

``resolve_checkpoint`` and ``open_checkpoint`` are what every tool starts with;
they read only the manifest, so ``inspect``, ``plan``, ``verify`` and ``ls`` (and
the ``rayckpt`` command for them) import neither torch nor Ray.
"""

from __future__ import annotations

import math
import os
import posixpath
from collections.abc import Callable

import pyarrow.fs as pafs

from ..errors import CheckpointNotFoundError
from ..format.manifest import MANIFEST_NAME, Manifest, TensorEntry, itemsize
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import read_manifest

#: Called with (bytes done, bytes in all) as long operations advance.
Progress = Callable[[int, int], None]


def resolve_checkpoint(ckpt: str | os.PathLike[str] | CheckpointDir) -> CheckpointDir:
    """The checkpoint directory at ``ckpt``, or ``CheckpointNotFoundError`` saying what is there instead.

    Args:
        ckpt: A local path, a ``pyarrow.fs`` URI, the ``manifest.json`` inside
            one, or a ``CheckpointDir``.

    Returns:
        The directory holding the checkpoint's ``manifest.json``.

    Raises:
        CheckpointNotFoundError: Nothing is at ``ckpt``, it is a file other than a
            manifest, or it holds no ``manifest.json`` (the message says whether
            it holds an uncommitted save's shard files).
    """
    ckdir = ckpt if isinstance(ckpt, CheckpointDir) else CheckpointDir.resolve(ckpt)
    kind = ckdir.fs.get_file_info(ckdir.fs_path).type
    if kind == pafs.FileType.File and posixpath.basename(ckdir.fs_path) == MANIFEST_NAME:
        ckdir = ckdir.parent()
        kind = pafs.FileType.Directory
    if kind == pafs.FileType.NotFound:
        raise CheckpointNotFoundError(f"{ckdir.location}: no such file or directory")
    if kind != pafs.FileType.Directory:
        raise CheckpointNotFoundError(f"{ckdir.location} is a file, not a rayckpt checkpoint directory")
    if not ckdir.exists(MANIFEST_NAME):
        files = ckdir.list_files()
        why = (
            "shard files but no manifest.json: a save that never committed"
            if any(f.endswith(".arrow") for f in files)
            else "no manifest.json"
        )
        raise CheckpointNotFoundError(f"{ckdir.location} is not a rayckpt checkpoint ({why})")
    return ckdir


def open_checkpoint(ckpt: str | os.PathLike[str] | CheckpointDir) -> tuple[CheckpointDir, Manifest]:
    """The directory and validated manifest of a committed checkpoint (``resolve_checkpoint``, then
    ``storage.commit.read_manifest``, which raise ``CheckpointNotFoundError`` and ``CorruptCheckpointError``)."""
    ckdir = resolve_checkpoint(ckpt)
    return ckdir, read_manifest(ckdir)


def tensor_nbytes(entry: TensorEntry) -> int:
    """Bytes of the whole tensor."""
    return math.prod(entry.shape) * itemsize(entry.dtype)
