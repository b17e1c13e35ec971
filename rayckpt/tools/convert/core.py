"""The ``convert()`` entry point: its checks, the defaults, and the table that sends each
format to its module.

One module per format holds the format itself:

- ``torch_file``: one ``torch.save`` file of the full state dict, nested as it was
  saved, loadable with ``torch.load(..., weights_only=True)``.
- ``dcp_dir``: a ``torch.distributed.checkpoint`` directory (``FileSystemWriter``
  layout) that ``dcp.load`` and ``format_utils`` read; and back, including
  checkpoints saved by many FSDP ranks.
- ``safetensors_files``: tensors as safetensors files, split with a Hugging Face style
  ``model.safetensors.index.json`` when larger than ``max_shard_bytes``.

``streaming`` writes any imported source as a rayckpt checkpoint, and ``common`` holds
what the formats share (``ConvertInfo`` and the export helpers; re-exported here).
Everything streams tensor by tensor (imports: in groups of at most ``group_bytes``), so
one process holds about the largest tensor, never the whole model. Imports write a
normal rayckpt checkpoint with the engine's own shard writer and commit.

Imports run one way only: ``core`` imports the format modules, ``streaming`` and
``common``; the format modules import ``streaming`` and ``common``; ``streaming``
imports ``common``; ``common`` imports none of them.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import uuid
from types import ModuleType
from typing import NamedTuple

import pyarrow.fs as pafs

from ...errors import SaveFailedError
from ...storage.checkpoint_dir import CheckpointDir
from ...storage.lease import is_lease_file
from ..reader import CheckpointReader, Progress
from . import dcp_dir, safetensors_files, streaming, torch_file
from .common import ConvertInfo, output_path, progress_over, selected

__all__ = [
    "DEFAULT_GROUP_BYTES",
    "DEFAULT_MAX_SHARD_BYTES",
    "FORMATS",
    "ConvertInfo",
    "convert",
    "output_path",
    "progress_over",
    "publish",
    "selected",
]


class _Format(NamedTuple):
    """Where one format's two entry points live: its module and their names in it.

    ``convert()`` looks them up on the module when it runs, so a function replaced
    on its module (a test's patch) is the one called.
    """

    module: ModuleType
    #: ``source(src) -> streaming.Source``: reads ``src`` for an import.
    source: str
    #: ``export(reader, dst, prefix, max_shard_bytes, on_progress) -> ConvertInfo``.
    export: str


#: Format name -> its module's source (import) and export functions.
_DISPATCH: dict[str, _Format] = {
    "torch": _Format(torch_file, "torch_source", "export_torch"),
    "dcp": _Format(dcp_dir, "dcp_source", "export_dcp"),
    "safetensors": _Format(safetensors_files, "safetensors_source", "export_safetensors"),
}

FORMATS = tuple(_DISPATCH)
#: Hugging Face's default shard size.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
#: Imports load source tensors in groups of at most this many bytes (a larger tensor alone).
DEFAULT_GROUP_BYTES = 64 * 2**20


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str | None = None,
    from_: str | None = None,
    prefix: str = "",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    block_size: int | None = None,
    group_bytes: int = DEFAULT_GROUP_BYTES,
    on_progress: Progress | None = None,
) -> ConvertInfo:
    """Convert between rayckpt and another format, in this process.

    ``to=FORMAT`` exports the rayckpt checkpoint ``src`` to ``dst``; ``from_=FORMAT``
    imports ``src`` (in that format) as a new rayckpt checkpoint at ``dst``, saved by
    one rank and loadable by any world size. Exactly one of the two.

    ``prefix``: exports keep only keys starting with it and strip it (``"app.model."``
    gives a plain model state dict); imports prepend it to every key. ``dst`` must
    not exist yet (an empty directory is fine). An import claims ``dst`` before
    writing (``storage.lease``): of two imports into one new directory at once,
    one commits and the other raises ``SaveFailedError`` naming the other save
    (or ``ValueError``: the destination exists) and leaves nothing behind. An
    export writes beside ``dst`` and publishes its output in one step
    (``publish``): of two exports to one ``dst`` one wins, the other raises
    ``SaveFailedError`` and removes its output.

    Args:
        src: The checkpoint to convert: a rayckpt checkpoint for ``to``, a checkpoint in
            the ``from_`` format for ``from_``.
        dst: Where the output goes; must not exist yet (an empty directory is fine).
            Exports write a local path only.
        to: Export ``src`` to this format (one of ``FORMATS``).
        from_: Import ``src`` from this format (one of ``FORMATS``).
        prefix: Exports keep only keys starting with it and strip it; imports prepend it.
        max_shard_bytes: Largest safetensors file an export writes.
        block_size: Block size of an import's shard files (``None``: chosen from the tensors).
        group_bytes: Imports load source tensors in groups of at most this many bytes.
        on_progress: Called as ``on_progress(bytes done, bytes total)`` as tensors are written.

    Returns:
        What was converted: counts, bytes, and the files written.

    Raises:
        ValueError: Not exactly one of ``to`` and ``from_``, an unknown format, a size
            that is not positive, an export to a non-local ``dst``, a ``dst`` that exists,
            a ``prefix`` that selects nothing, or a source that is not a state dict.
        SaveFailedError: Another conversion or save got to ``dst`` first; this one's
            output was removed.
        CheckpointNotFoundError: ``src`` is not there, or holds no checkpoint in that format.
        CorruptCheckpointError: An imported DCP checkpoint's metadata is unreadable.
        InvalidStateError: An import's key is both a tensor and a value, or an export's
            tensor has no safetensors dtype.
    """
    if (to is None) == (from_ is None):
        raise ValueError("give exactly one of --to FORMAT (export) or --from FORMAT (import)")
    fmt = to if to is not None else from_
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if max_shard_bytes <= 0 or group_bytes <= 0:
        raise ValueError("max_shard_bytes and group_bytes must be positive")
    entry = _DISPATCH[fmt]
    src, dst = os.fspath(src), os.fspath(dst)
    out = CheckpointDir.resolve(dst)
    if to is not None and not out.is_local:
        raise ValueError(f"--to {to} writes to a local path, not {dst}")
    kind = out.fs.get_file_info(out.fs_path).type
    # Lease files alone do not make it exist: an import in flight there is named by the claim.
    found = [n for n in out.list_files() if not is_lease_file(n)] if kind == pafs.FileType.Directory else []
    if kind != pafs.FileType.NotFound and (kind != pafs.FileType.Directory or found or out.list_dirs()):
        raise ValueError(f"destination {out.location} already exists; remove it or choose a new path")
    if to is not None:
        export = getattr(entry.module, entry.export)
        reader = CheckpointReader(src)
        reader.check_stored(prefix)  # before the destination is touched
        # Written under the same name in a private directory beside dst (the name decides the
        # layout, and torch's zip writer names its records after it), then published in one
        # step that never replaces another writer's output.
        parent, base = os.path.split(out.fs_path)
        private = os.path.join(parent, f".rayckpt-tmp-{uuid.uuid4().hex[:8]}")
        tmp = os.path.join(private, base)
        try:
            os.makedirs(private)
            info = export(reader, tmp, prefix, max_shard_bytes, on_progress)
            publish(tmp, out.fs_path)
        finally:
            shutil.rmtree(private, ignore_errors=True)
        files = tuple(out.fs_path if f == tmp else f for f in info.files)
        return dataclasses.replace(info, dst=out.fs_path, files=files)
    source = getattr(entry.module, entry.source)(src)
    options = streaming.ImportOptions(
        prefix=prefix, block_size=block_size, group_bytes=group_bytes, on_progress=on_progress
    )
    return streaming.import_source(source, out, src, options)


def publish(tmp: str, dst: str) -> None:
    """Move a finished export from ``tmp`` to ``dst`` atomically, failing if another writer got there
    first: a file by a hard link (never replaces), a directory by a rename (replaces only an empty one)."""
    try:
        if os.path.isdir(tmp):
            os.rename(tmp, dst)
        else:
            os.link(tmp, dst)
    except (FileExistsError, IsADirectoryError, NotADirectoryError) as exc:
        raise SaveFailedError(
            f"{dst}: another writer created it while this conversion ran; this conversion's output was "
            f"removed and {dst} left as that writer made it ({type(exc).__name__})"
        ) from None
    except OSError as exc:
        if exc.errno != errno.ENOTEMPTY:
            raise
        raise SaveFailedError(
            f"{dst}: another writer filled it while this conversion ran; this conversion's output was "
            f"removed and {dst} left as that writer made it"
        ) from None
