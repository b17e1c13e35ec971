"""What every conversion shares: the ``convert()`` entry point and its checks, ``ConvertInfo``,
the defaults, and the helpers exports use to pick keys and report progress.

One module per format holds the format itself:

- ``torch_file``: one ``torch.save`` file of the full state dict, nested as it was
  saved, loadable with ``torch.load(..., weights_only=True)``.
- ``dcp_dir``: a ``torch.distributed.checkpoint`` directory (``FileSystemWriter``
  layout) that ``dcp.load`` and ``format_utils`` read; and back, including
  checkpoints saved by many FSDP ranks.
- ``safetensors_files``: tensors as safetensors files, split with a Hugging Face style
  ``model.safetensors.index.json`` when larger than ``max_shard_bytes``.

``streaming`` writes any imported source as a rayckpt checkpoint. Everything streams
tensor by tensor (imports: in groups of at most ``group_bytes``), so one process holds
about the largest tensor, never the whole model. Imports write a normal rayckpt
checkpoint with the engine's own shard writer and commit.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pyarrow.fs as pafs

from ...errors import SaveFailedError
from ...format.paths import Path, strip_prefix
from ...storage.checkpoint_dir import CheckpointDir
from ...storage.lease import is_lease_file
from ..reader import CheckpointReader, Progress, tensor_nbytes

FORMATS = ("torch", "dcp", "safetensors")
#: Hugging Face's default shard size.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
#: Imports load source tensors in groups of at most this many bytes (a larger tensor alone).
DEFAULT_GROUP_BYTES = 64 * 2**20


@dataclass(frozen=True, slots=True)
class ConvertInfo:
    src: str
    dst: str
    #: The other format: what was written (``direction="to"``) or read (``"from"``).
    format: str
    direction: str
    tensors: int
    values: int
    #: Tensor payload bytes converted.
    bytes: int
    #: Files written, relative to ``dst`` (``dst`` itself for a torch file).
    files: tuple[str, ...]


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
    """
    # The format modules import this one (ConvertInfo, the helpers below), so they are
    # imported here rather than at the top; their functions are looked up on the module
    # at call time, which is also what lets tests patch them there.
    from . import dcp_dir, safetensors_files, streaming, torch_file

    if (to is None) == (from_ is None):
        raise ValueError("give exactly one of --to FORMAT (export) or --from FORMAT (import)")
    fmt = to if to is not None else from_
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if max_shard_bytes <= 0 or group_bytes <= 0:
        raise ValueError("max_shard_bytes and group_bytes must be positive")
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
        export = {
            "torch": torch_file.export_torch,
            "dcp": dcp_dir.export_dcp,
            "safetensors": safetensors_files.export_safetensors,
        }[to]
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
    source = {
        "torch": torch_file.torch_source,
        "dcp": dcp_dir.dcp_source,
        "safetensors": safetensors_files.safetensors_source,
    }[fmt](src)
    return streaming.import_source(source, out, src, prefix, block_size, group_bytes, on_progress)


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


def selected(reader: CheckpointReader, prefix: str) -> list[tuple[str, str]]:
    """(key in the checkpoint, key in the output) for every entry under ``prefix``."""
    keys = [(k, k[len(prefix) :]) for k in reader.manifest.entries if k.startswith(prefix)]
    if not keys:
        raise ValueError(f"no key in {reader.ckdir.location} starts with prefix {prefix!r}")
    return keys


def output_path(reader: CheckpointReader, key: str, prefix: str) -> Path:
    """Where ``key`` goes in a nested export: its saved path less the parts that spell ``prefix``."""
    return strip_prefix(reader.manifest.path(key), key, prefix)


def progress_over(reader: CheckpointReader, keys: Iterable[str], on_progress: Progress | None) -> Callable[[str], None]:
    """A callback to call after each tensor key is written, reporting bytes done."""
    nbytes = {k: tensor_nbytes(reader.manifest.tensor(k)) for k in keys}
    total = sum(nbytes.values())
    done = 0

    def advance(key: str) -> None:
        nonlocal done
        done += nbytes[key]
        if on_progress:
            on_progress(done, total)

    return advance
