"""Importing: a checkpoint in another format (a ``Source``) written as a rayckpt checkpoint.

The format modules only describe their source (keys, dtypes, shapes, plain values and
a loader for groups of tensors); this module plans the single-rank save, feeds the
engine's shard writer lazily in bounded groups, and commits the manifest.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...engine.state import as_bytes
from ...engine.writer import ShareSpec, write_chunks
from ...errors import CheckpointExistsError, InvalidStateError
from ...format.boxes import Box
from ...format.manifest import itemsize
from ...format.paths import Path, add_prefix
from ...format.shard_file import ChunkData, auto_block_size, storage_type
from ...format.values import encode_value
from ...planning.save_columns import create_save_plans
from ...planning.save_plan import LocalShard
from ...storage.checkpoint_dir import CheckpointDir
from ...storage.commit import SaveSpec, WrittenFiles, commit_save, new_save_id
from ...storage.lease import LeaseKeeper, claim_location, is_lease_file
from ..reader import Progress
from .common import ConvertInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class Source:
    """A checkpoint in another format, seen as flat keys."""

    format: str
    #: key -> (rayckpt dtype name, global shape)
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    #: key -> plain Python value
    values: dict[str, Any]
    #: Loads whole tensors for the given keys (a bounded group) into memory.
    load: Callable[[list[str]], dict[str, torch.Tensor]]
    #: Each key's path through the source's nested state dict, where it has one.
    paths: dict[str, Path] = field(default_factory=dict)


class _LazyChunk(ChunkData):
    """A chunk whose bytes are fetched only when the shard file writer reaches it.

    The engine's writer reads ``data`` once, just before writing the chunk, so
    passing these to ``write_chunks`` streams a whole import through it.
    """

    __slots__ = ("_fetch",)

    def __init__(self, key: str, dtype: str, box: Box, fetch: Callable[[str, Box], Any]) -> None:
        for name, value in (("key", key), ("dtype", dtype), ("box", box), ("_fetch", fetch)):
            object.__setattr__(self, name, value)

    @property
    def data(self) -> Any:  # type: ignore[override]
        return self._fetch(self.key, self.box)


class _TensorStream:
    """Hands the writer each chunk's bytes, loading tensors in bounded groups in the
    order the writer asks for them and dropping each group before loading the next."""

    def __init__(
        self,
        nbytes: dict[str, int],
        load: Callable[[list[str]], dict[str, torch.Tensor]],
        order: list[str],
        group_bytes: int,
        on_progress: Progress | None,
    ) -> None:
        self._nbytes = nbytes
        self._load = load
        self._order = order
        self._pos = {k: i for i, k in enumerate(order)}
        self._group_bytes = group_bytes
        self._on_progress = on_progress
        self._total = sum(nbytes.values())
        self._done = 0
        self._cache: dict[str, torch.Tensor] = {}

    def __call__(self, key: str, box: Box) -> Any:
        if key not in self._cache:
            group: list[str] = []
            size = 0
            for k in self._order[self._pos[key] :]:
                if group and size + self._nbytes[k] > self._group_bytes:
                    break
                group.append(k)
                size += self._nbytes[k]
            self._cache = {}
            self._cache = self._load(group)
            self._done += size
            if self._on_progress:
                self._on_progress(self._done, self._total)
        return as_bytes(self._cache[key][box.to_slices()].contiguous())


@dataclass(frozen=True, slots=True, kw_only=True)
class ImportOptions:
    """How ``import_source`` writes a source."""

    #: Put before every key.
    prefix: str = ""
    #: Bytes per block checksum; None: ``auto_block_size`` of the source's tensors, as a save picks it.
    block_size: int | None = None
    #: Source tensors are loaded in groups of at most this many bytes (a larger tensor alone).
    group_bytes: int
    on_progress: Progress | None = None


def import_source(source: Source, out: CheckpointDir, src: str, options: ImportOptions) -> ConvertInfo:
    """Write ``source`` (read from ``src``) as a rayckpt checkpoint at ``out`` saved by one rank, then commit it."""
    prefix, block_size = options.prefix, options.block_size
    if block_size is not None and block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tensors = {prefix + k: v for k, v in source.tensors.items()}
    values = {prefix + k: encode_value(v, prefix + k) for k, v in source.values.items()}
    nbytes = {k: itemsize(dtype) * math.prod(shape) for k, (dtype, shape) in tensors.items()}
    block_size = block_size or auto_block_size(sum(nbytes.values()))
    both = sorted(set(tensors) & set(values))
    if both:
        raise InvalidStateError(f"key {both[0]!r} is both a tensor and a value in {src}")

    def load(keys: list[str]) -> dict[str, torch.Tensor]:
        loaded = source.load([k[len(prefix) :] for k in keys])
        return {prefix + k: t for k, t in loaded.items()}

    plan = create_save_plans([[LocalShard(k, d, s, Box.full(s)) for k, (d, s) in tensors.items()]])[0]
    # write_chunks writes one file per storage type, in sorted type order: load in that order.
    order = list(dict.fromkeys(i.key for i in sorted(plan.items, key=lambda i: storage_type(tensors[i.key][0]))))
    stream = _TensorStream(nbytes, load, order, options.group_bytes, options.on_progress)
    chunks = [_LazyChunk(i.key, tensors[i.key][0], i.box, stream) for i in plan.items]
    metadata = {"converted_from": {"format": source.format, "path": src}}
    key_paths = {prefix + k: add_prefix(prefix, p) for k, p in source.paths.items()}
    save_id = new_save_id()
    # Claim the destination before writing: a concurrent import into it is refused (or
    # refuses this one), naming the other save; the commit refuses a checkpoint committed since.
    try:
        previous = claim_location(out, save_id, overwrite=False)
    except CheckpointExistsError as exc:
        raise ValueError(f"destination {out.location} already exists: {exc}") from None
    spec = SaveSpec(
        save_id=save_id,
        world_size=1,
        block_size=block_size,
        tensors=tensors,
        values=values,
        metadata=metadata,
        paths=key_paths,
        previous=previous,
    )
    # A failure removes the save (its files, the directory if left empty) once the lease is released.
    with WrittenFiles(out, save_id, whole_save=True) as files, LeaseKeeper(out, save_id):
        others = [n for n in out.list_files() if not is_lease_file(n)] + out.list_dirs()
        if others:
            raise ValueError(f"destination {out.location} already exists (found {others[0]}); remove it")
        shard = write_chunks(files, chunks, ShareSpec(rank=0, block_size=block_size))
        commit_save(out, spec, [shard])
    paths = tuple(f.path for f in shard.files)
    return ConvertInfo(
        src=src,
        dst=out.location,
        format=source.format,
        direction="from",
        tensors=len(tensors),
        values=len(values),
        bytes=sum(nbytes.values()),
        files=paths,
    )
