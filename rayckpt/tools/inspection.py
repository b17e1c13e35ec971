"""``inspect`` and ``tensor_summary``: what a checkpoint holds, from its manifest (and one tensor's values).

Frozen dataclasses; the ``rayckpt inspect`` command prints them as text or JSON.
``inspect`` reads the manifest alone and never imports torch; ``tensor_summary``
does, on first call.
"""

from __future__ import annotations

import math
import os
import posixpath
from dataclasses import dataclass
from typing import Any

from ..format.file_paths import is_shared
from ..format.manifest import FileEntry, TensorEntry
from ..format.values import decode_value
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.names import shard_file_save_id
from .opening import open_checkpoint, tensor_nbytes


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorInfo:
    key: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int
    #: How many stored chunks (shards, split pieces) make up the tensor.
    num_chunks: int
    files: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ValueInfo:
    key: str
    #: The stored JSON form (tuples and non-string keys tagged; see docs/FORMAT.md).
    value: Any

    @property
    def decoded(self) -> Any:
        return decode_value(self.value)


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointInfo:
    """What ``inspect`` finds in a manifest (no shard file is read)."""

    path: str
    save_id: str
    version: int
    created: float
    world_size: int
    block_size: int
    #: Block checksum algorithm (``xxh3_64``; ``crc32`` in version-1 checkpoints).
    checksum: str
    total_bytes: int
    user_metadata: dict[str, Any]
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorInfo, ...]
    values: tuple[ValueInfo, ...]
    #: Bytes of the chunks this save wrote, and of those it shares with the earlier saves that
    #: wrote them (an incremental save's unchanged chunks; 0 in a self-contained checkpoint).
    bytes_written: int = 0
    bytes_shared: int = 0


def inspect(ckpt: str | os.PathLike[str] | CheckpointDir) -> CheckpointInfo:
    """Keys, dtypes, global shapes, chunks, files and sizes of a checkpoint, from its manifest.

    Reads the manifest alone (no shard file) and never imports torch.

    Args:
        ckpt: A checkpoint directory: a local path, a ``pyarrow.fs`` URI, the
            ``manifest.json`` inside one, or a ``CheckpointDir``.

    Returns:
        A ``CheckpointInfo``: the save's id, format version, creation time, world
            size, block size and checksum, its files, and each tensor and plain
            value it holds.

    Raises:
        CheckpointNotFoundError: ``ckpt`` does not exist, or holds no committed
            checkpoint (no ``manifest.json``); the message says what is there.
        CorruptCheckpointError: The manifest does not parse or is inconsistent
            (``FormatVersionError``: written by an unknown format version).
    """
    ckdir, m = open_checkpoint(ckpt)
    tensors = []
    values = []
    shared = 0
    for key, e in m.entries.items():
        if isinstance(e, TensorEntry):
            shared += sum(c.byte_length for c in e.chunks if not _own(c.file, m.save_id))
            files = tuple(sorted({c.file for c in e.chunks}))
            tensors.append(
                TensorInfo(
                    key=key,
                    dtype=e.dtype,
                    shape=e.shape,
                    numel=math.prod(e.shape),
                    nbytes=tensor_nbytes(e),
                    num_chunks=len(e.chunks),
                    files=files,
                )
            )
        else:
            values.append(ValueInfo(key, e.value))
    return CheckpointInfo(
        path=ckdir.location,
        save_id=m.save_id,
        version=m.version,
        created=m.created,
        world_size=m.world_size,
        block_size=m.block_size,
        checksum=m.checksum,
        total_bytes=m.total_bytes,
        user_metadata=dict(m.user_metadata),
        files=m.files,
        tensors=tuple(tensors),
        values=tuple(values),
        bytes_written=sum(t.nbytes for t in tensors) - shared,
        bytes_shared=shared,
    )


def _own(path: str, save_id: str) -> bool:
    """Whether a chunk's file was written by save ``save_id`` (a shared store file may be an earlier save's)."""
    return not is_shared(path) or shard_file_save_id(posixpath.basename(path)) == save_id


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSummary:
    """A look at one full tensor: the ``summon_full_params`` view of a single key."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    #: Statistics in float64; ``None`` for an empty tensor. Complex tensors: over the
    #: real and imaginary parts; bool: over 0/1.
    min: float | None
    max: float | None
    mean: float | None
    #: The L2 norm of all elements.
    norm: float | None
    #: The first elements in row-major order.
    first: tuple[Any, ...]


#: Statistics walk the tensor in slices of this many elements (bounded float64 copies).
_STATS_SLICE = 1 << 20


def tensor_summary(ckpt: str | os.PathLike[str] | CheckpointDir, key: str, *, first: int = 8) -> TensorSummary:
    """Assemble ``key`` from its shards and summarize it (shape, dtype, min/max/mean/norm, first values).

    Imports torch on first call. Holds the one whole tensor in memory; the
    statistics are computed in float64 over bounded slices of it.

    Args:
        ckpt: A checkpoint directory: a local path, a ``pyarrow.fs`` URI, the
            ``manifest.json`` inside one, or a ``CheckpointDir``.
        key: The tensor's flattened key, as ``inspect`` lists it.
        first: How many leading elements (row-major) to return.

    Returns:
        A ``TensorSummary`` of the whole tensor.

    Raises:
        ValueError: ``key`` is not a tensor of the checkpoint (the message
            suggests close keys, or names the plain value it holds).
        CheckpointNotFoundError: ``ckpt`` does not exist, or holds no committed
            checkpoint (no ``manifest.json``); the message says what is there.
        CorruptCheckpointError: The manifest is inconsistent, the tensor's shard
            files cannot hold it, or a byte fails its checksum.
    """
    import torch  # here, not at the top: ``inspect`` and the CLI's other commands start without torch

    from ..engine.state import dtype_name
    from .reader import read_tensor

    t = read_tensor(ckpt, key)
    flat = t.reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    stats: list[float | None] = [None, None, None, None]
    if flat.numel():
        lo, hi, total, squares = math.inf, -math.inf, 0.0, 0.0
        for i in range(0, flat.numel(), _STATS_SLICE):
            x = flat[i : i + _STATS_SLICE].to(torch.float64)
            lo = min(lo, x.min().item())
            hi = max(hi, x.max().item())
            total += x.sum().item()
            squares += x.square().sum().item()
        stats = [lo, hi, total / flat.numel(), math.sqrt(squares)]
    head = t.reshape(-1)[:first].tolist()
    head = [str(v) if isinstance(v, complex) else v for v in head]
    lo_stat, hi_stat, mean_stat, norm_stat = stats
    return TensorSummary(
        key=key,
        dtype=dtype_name(t.dtype),
        shape=tuple(t.shape),
        numel=t.numel(),
        min=lo_stat,
        max=hi_stat,
        mean=mean_stat,
        norm=norm_stat,
        first=tuple(head),
    )
