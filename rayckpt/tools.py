"""Look into checkpoints without a cluster: list, inspect, verify, plan, consolidate.

One process, no process group, no Ray. Every function reads the manifest with
the engine's validation and every tensor byte through the engine's verified
reader; tensors are assembled one at a time, so memory stays about the size of
the largest tensor (``consolidate`` excepted: it returns the whole state).
Results are frozen dataclasses; the ``rayckpt`` command prints them as text or
JSON (``docs/CLI.md``).
"""

from __future__ import annotations

import difflib
import math
import os
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import torch

from .boxes import Box
from .catalog import CatalogEntry, describe, entry_order, looks_like_checkpoint
from .engine import read_into, read_manifest, torch_dtype
from .errors import CheckpointNotFoundError
from .manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    TensorEntry,
    ValueEntry,
    decode_value,
    itemsize,
)
from .planner import ChunkIndex, TensorRequest, create_load_plan, create_load_plans, dim0_boxes
from .state import FlatState, TensorLeaf, dtype_name
from .storage import CheckpointDir

#: Called with (bytes done, bytes in all) as long operations advance.
Progress = Callable[[int, int], None]


def resolve_checkpoint(ckpt: str | os.PathLike[str] | CheckpointDir) -> CheckpointDir:
    """The checkpoint directory at ``ckpt``, or ``CheckpointNotFoundError`` saying what is there instead.

    ``ckpt`` is a local path, a ``pyarrow.fs`` URI, or the ``manifest.json`` inside one.
    """
    ckdir = ckpt if isinstance(ckpt, CheckpointDir) else CheckpointDir.resolve(ckpt)
    kind = ckdir.fs.get_file_info(ckdir.root).type
    if kind == pafs.FileType.File and posixpath.basename(ckdir.root) == MANIFEST_NAME:
        parent = posixpath.dirname(ckdir.root)
        ckdir = CheckpointDir(ckdir.fs, parent, posixpath.dirname(ckdir.uri.rstrip("/")))
        kind = pafs.FileType.Directory
    if kind == pafs.FileType.NotFound:
        raise CheckpointNotFoundError(f"{ckdir.uri}: no such file or directory")
    if kind != pafs.FileType.Directory:
        raise CheckpointNotFoundError(f"{ckdir.uri} is a file, not a rayckpt checkpoint directory")
    if not ckdir.exists(MANIFEST_NAME):
        files = ckdir.list_files()
        why = (
            "shard files but no manifest.json: a save that never committed"
            if any(f.endswith(".arrow") for f in files)
            else "no manifest.json"
        )
        raise CheckpointNotFoundError(f"{ckdir.uri} is not a rayckpt checkpoint ({why})")
    return ckdir


def open_checkpoint(ckpt: str | os.PathLike[str] | CheckpointDir) -> tuple[CheckpointDir, Manifest]:
    """The directory and validated manifest of a committed checkpoint."""
    ckdir = resolve_checkpoint(ckpt)
    return ckdir, read_manifest(ckdir)


def _no_such_key(manifest: Manifest, key: str, kind: str = "key") -> ValueError:
    close = difflib.get_close_matches(key, list(manifest.entries), n=3)
    hint = f"; did you mean {', '.join(repr(k) for k in close)}?" if close else "; `rayckpt inspect` lists the keys"
    return ValueError(f"no {kind} {key!r} in the checkpoint{hint}")


# ---------------------------------------------------------------------------
# Reading whole tensors


class CheckpointReader:
    """Assembles whole tensors of one checkpoint, one at a time, from verified ranged reads."""

    def __init__(self, ckpt: str | os.PathLike[str] | CheckpointDir) -> None:
        self.ckdir, self.manifest = open_checkpoint(ckpt)
        self._index = ChunkIndex(self.manifest)
        self._sizes = {f.path: f.size for f in self.manifest.files}

    def read_tensor(self, key: str) -> torch.Tensor:
        """The full tensor ``key``, every byte verified against its checksum."""
        entry = self.manifest.entries.get(key)
        if not isinstance(entry, TensorEntry):
            if isinstance(entry, ValueEntry):
                raise ValueError(f"key {key!r} holds a plain value ({decode_value(entry.value)!r}), not a tensor")
            raise _no_such_key(self.manifest, key, "tensor")
        target = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
        box = Box.full(entry.shape)
        flat = FlatState(tensors={key: TensorLeaf(key, target, entry.shape, box, entry.dtype)})
        request = TensorRequest(key, entry.dtype, entry.shape, box)
        plan = create_load_plan(self.manifest, [request], index=self._index)
        read_into(self.ckdir, plan, flat, self.manifest.blocks, self._sizes, {})
        return target

    def items(self, prefix: str = "", on_progress: Progress | None = None) -> Iterator[tuple[str, Any]]:
        """(key, tensor or decoded value) for every entry whose key starts with ``prefix``, in manifest order."""
        keys = [k for k in self.manifest.entries if k.startswith(prefix)]
        total = sum(tensor_nbytes(e) for k in keys if isinstance(e := self.manifest.entries[k], TensorEntry))
        done = 0
        for key in keys:
            entry = self.manifest.entries[key]
            if isinstance(entry, TensorEntry):
                # No local holds the tensor: once the caller drops it, it is freed.
                yield key, self.read_tensor(key)
                done += tensor_nbytes(entry)
                if on_progress:
                    on_progress(done, total)
            else:
                yield key, decode_value(entry.value)


def tensor_nbytes(entry: TensorEntry) -> int:
    """Bytes of the whole tensor."""
    return math.prod(entry.shape) * itemsize(entry.dtype)


def read_tensor(ckpt: str | os.PathLike[str] | CheckpointDir, key: str) -> torch.Tensor:
    """Assemble the full tensor ``key`` from its shards without loading anything else."""
    return CheckpointReader(ckpt).read_tensor(key)


def consolidate(
    ckpt: str | os.PathLike[str] | CheckpointDir, *, prefix: str = "", on_progress: Progress | None = None
) -> dict[str, Any]:
    """The full (unsharded) state dict in this process: DCP's full-state-dict / rank-0 equivalent.

    Keys are the checkpoint's flattened keys (``app.model.layers.0.weight``),
    values are whole tensors and plain Python values. With ``prefix``, only keys
    under it, with the prefix removed (``prefix="app.model."`` gives a model's
    ``state_dict``). Holds the whole selection in memory, by design.
    """
    reader = CheckpointReader(ckpt)
    return {key[len(prefix) :]: value for key, value in reader.items(prefix, on_progress)}


# ---------------------------------------------------------------------------
# inspect


@dataclass(frozen=True, slots=True)
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
    #: The stored JSON form (tuples and non-string keys tagged; see FORMAT.md).
    value: Any

    @property
    def decoded(self) -> Any:
        return decode_value(self.value)


@dataclass(frozen=True, slots=True)
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


def inspect(ckpt: str | os.PathLike[str] | CheckpointDir) -> CheckpointInfo:
    """Keys, dtypes, global shapes, chunks, files and sizes of a checkpoint, from its manifest."""
    ckdir, m = open_checkpoint(ckpt)
    tensors = []
    values = []
    for key, e in m.entries.items():
        if isinstance(e, TensorEntry):
            files = tuple(sorted({c.file for c in e.chunks}))
            tensors.append(
                TensorInfo(key, e.dtype, e.shape, math.prod(e.shape), tensor_nbytes(e), len(e.chunks), files)
            )
        else:
            values.append(ValueInfo(key, e.value))
    return CheckpointInfo(
        ckdir.uri,
        m.save_id,
        m.version,
        m.created,
        m.world_size,
        m.block_size,
        m.checksum,
        m.total_bytes,
        dict(m.user_metadata),
        m.files,
        tuple(tensors),
        tuple(values),
    )


@dataclass(frozen=True, slots=True)
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
    """Assemble ``key`` from its shards and summarize it (shape, dtype, min/max/mean/norm, first values)."""
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
    return TensorSummary(key, dtype_name(t.dtype), tuple(t.shape), t.numel(), *stats, tuple(head))


# ---------------------------------------------------------------------------
# verify


@dataclass(frozen=True, slots=True)
class RankPlan:
    rank: int
    bytes_needed: int
    #: Bytes read including the partial checksum blocks at range ends.
    bytes_read: int
    #: Ranged reads after coalescing.
    reads: int
    files: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """What loading a checkpoint into ``world_size`` FSDP ranks reads, per rank."""

    path: str
    saved_world_size: int
    world_size: int
    bytes_needed: int
    bytes_read: int
    #: bytes_read / bytes_needed over all ranks (1.0 = nothing extra).
    read_amplification: float
    #: Mean over max of bytes read per rank (1.0 = perfectly balanced).
    balance: float
    ranks: tuple[RankPlan, ...]


def plan(ckpt: str | os.PathLike[str] | CheckpointDir, world_size: int) -> ReshardPlan:
    """The reshard plan for ``world_size`` ranks, computed with no worker running.

    Assumes every tensor is sharded on dim 0 as FSDP2 does (``torch.chunk``), and
    0-dim tensors are replicated on every rank: the same plans ``load`` makes.
    """
    if world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {world_size}")
    ckdir, m = open_checkpoint(ckpt)
    tensors = [(k, e) for k, e in m.entries.items() if isinstance(e, TensorEntry)]
    boxes = {k: dim0_boxes(e.shape, world_size) for k, e in tensors}
    requests = [[TensorRequest(k, e.dtype, e.shape, boxes[k][r]) for k, e in tensors] for r in range(world_size)]
    ranks = tuple(
        RankPlan(r, p.needed_bytes, p.read_bytes, len(p.reads), p.files)
        for r, p in enumerate(create_load_plans(m, requests))
    )
    needed = sum(r.bytes_needed for r in ranks)
    read = sum(r.bytes_read for r in ranks)
    busiest = max(r.bytes_read for r in ranks)
    return ReshardPlan(
        ckdir.uri,
        m.world_size,
        world_size,
        needed,
        read,
        read / needed if needed else 1.0,
        read / world_size / busiest if busiest else 1.0,
        ranks,
    )


# ---------------------------------------------------------------------------
# ls


def ls(storage_path: str | os.PathLike[str], run: str | None = None) -> tuple[CatalogEntry, ...]:
    """Checkpoints under ``storage_path``: ``<storage_path>/<run>/<checkpoint>`` as Ray Train lays them out.

    ``storage_path`` may also be a run directory or a checkpoint itself. With
    ``run``, only ``<storage_path>/<run>``. Sorted by run, then step.
    """
    base = CheckpointDir.resolve(storage_path)
    if base.fs.get_file_info(base.root).type != pafs.FileType.Directory:
        raise CheckpointNotFoundError(f"{base.uri}: no such directory")
    if run is not None:
        base = base.child(run)
        if base.fs.get_file_info(base.root).type != pafs.FileType.Directory:
            raise CheckpointNotFoundError(f"no run {run!r}: {base.uri} is not a directory")
    if looks_like_checkpoint(base):
        candidates = [(posixpath.basename(posixpath.dirname(base.root)), base)]
    else:
        candidates = []
        for name in base.list_dirs():
            child = base.child(name)
            if looks_like_checkpoint(child):
                candidates.append((posixpath.basename(base.root), child))
            else:
                candidates.extend((name, child.child(sub)) for sub in child.list_dirs())
    found = [e for run_name, ckdir in candidates if (e := describe(ckdir, run_name)) is not None]
    return tuple(sorted(found, key=lambda e: (e.run, *entry_order(e))))
