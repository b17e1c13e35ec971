"""Where a manifest's files are: inside the checkpoint directory, or (version 5) in the shared store beside it."""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from typing import Any

from .manifest_schema import SchemaError, show

#: Directory beside a run's checkpoint directories that holds the shard files incremental saves
#: write and share (``storage.shared``), and how a manifest's ``files`` name a file in it.
SHARED_DIR = ".rayckpt-shared"
SHARED_PREFIX = f"../{SHARED_DIR}/"


def is_shared(path: str) -> bool:
    """Whether a manifest's file ``path`` is in the shared store (not in the checkpoint directory)."""
    return path.startswith(SHARED_PREFIX)


def safe_file_path(path: Any, at: str) -> str:
    """Manifest paths are relative and stay inside the checkpoint directory."""
    if not isinstance(path, str) or not path:
        raise SchemaError(at, f"expected a non-empty string, got {show(path)}")
    norm = posixpath.normpath(path)
    if is_shared(path) and norm == path and "/" not in path[len(SHARED_PREFIX) :] and ":" not in path:
        return path  # a shard file in the shared store beside the checkpoint directory (version 5)
    if path.startswith(("/", "\\")) or "\\" in path or ":" in path or norm == ".." or norm.startswith("../"):
        raise SchemaError(at, f"file path {path!r} escapes the checkpoint directory; refusing to read it")
    return norm


def written_bytes(save_id: str, files: Iterable[Any]) -> int:
    """Bytes of the manifest ``files`` (``FileEntry``) that save ``save_id`` wrote: all of them but the
    shared store's files earlier saves wrote."""
    own = f"{SHARED_PREFIX}{save_id}-"
    return sum(f.size for f in files if not is_shared(f.path) or f.path.startswith(own))
