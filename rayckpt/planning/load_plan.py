"""Load (reshard) plans, N -> M: which byte ranges each rank reads. Pure: no torch.distributed, no Ray, no I/O.

``create_load_plan`` intersects the boxes a rank needs (``TensorRequest``) with
the saved chunks and returns a ``LoadPlan``: the byte ranges to read,
block-aligned for verification, coalesced and sorted by file offset. The mirror
image of ``save_plan``; ``bulk`` plans every FSDP2 rank at once and gives the
same plans.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import IncompatibleStateError
from ..format.boxes import Box, contiguous_runs, intersect
from ..format.manifest import ChunkEntry, Manifest, TensorEntry, ValueEntry, itemsize


@dataclass(frozen=True, slots=True)
class TensorRequest:
    """A rank's target tensor: what it needs filled."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    box: Box


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadItem:
    """Copy ``box`` (global) out of saved ``chunk`` into the target of ``key``."""

    key: str
    chunk: ChunkEntry
    box: Box
    #: Byte range of the needed elements, relative to the chunk's first byte.
    lo: int
    hi: int


@dataclass(frozen=True, slots=True)
class FileRead:
    """One ranged read: ``length`` bytes at ``offset`` of ``file`` serve ``items``."""

    file: str
    offset: int
    length: int
    items: tuple[ReadItem, ...]


@dataclass(frozen=True, slots=True)
class LoadPlan:
    reads: tuple[FileRead, ...]
    #: Payload bytes the rank's targets need.
    needed_bytes: int
    #: Keys the target asked for that the checkpoint lacks (only with strict=False).
    missing: tuple[str, ...] = ()

    @property
    def read_bytes(self) -> int:
        return sum(r.length for r in self.reads)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(sorted({r.file for r in self.reads}))


def check_requests(
    manifest: Manifest, requests: Iterable[TensorRequest], value_keys: Iterable[str], strict: bool
) -> list[str]:
    """Validate what a rank asks for; return the keys to skip (missing, non-strict).

    Raises one ``IncompatibleStateError`` naming every bad key.
    """
    problems: list[str] = []
    missing: list[str] = []
    for r in requests:
        e = manifest.entries.get(r.key)
        if e is None:
            missing.append(r.key)
        elif isinstance(e, ValueEntry):
            problems.append(f"key {r.key!r}: target is a tensor but the checkpoint holds a value")
        elif e.shape != r.shape:
            problems.append(f"key {r.key!r}: checkpoint shape {list(e.shape)} != target shape {list(r.shape)}")
        elif e.dtype != r.dtype:
            problems.append(
                f"key {r.key!r}: checkpoint dtype {e.dtype} != target dtype {r.dtype} "
                "(rayckpt never casts silently; convert the target or the checkpoint)"
            )
    for k in value_keys:
        e = manifest.entries.get(k)
        if e is None:
            missing.append(k)
        elif isinstance(e, TensorEntry):
            problems.append(f"key {k!r}: target is a plain value but the checkpoint holds a tensor")
    if missing and strict:
        shown = ", ".join(repr(k) for k in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        problems.insert(
            0,
            f"{len(missing)} key(s) the target asks for are not in the checkpoint: {shown}{more} "
            "(pass strict=False to skip them)",
        )
    if problems:
        raise IncompatibleStateError("state does not match checkpoint:\n  " + "\n  ".join(problems))
    return missing


class ChunkIndex:
    """Finds the saved chunks that overlap a box; bisects dim-0 tilings."""

    def __init__(self, manifest: Manifest) -> None:
        self._manifest = manifest
        self._sorted: dict[str, tuple[list[int], list[ChunkEntry]] | None] = {}

    def overlapping(self, key: str, box: Box) -> list[tuple[ChunkEntry, Box]]:
        entry = self._manifest.tensor(key)
        if key not in self._sorted:
            self._sorted[key] = _dim0_index(entry)
        index = self._sorted[key]
        if index is None:
            candidates: Sequence[ChunkEntry] = entry.chunks
        else:
            starts, chunks = index
            lo = max(bisect.bisect_right(starts, box.offsets[0]) - 1, 0)
            hi = bisect.bisect_left(starts, box.offsets[0] + box.sizes[0])
            candidates = chunks[lo:hi]
        out = []
        for c in candidates:
            common = intersect(c.box, box)
            if common is not None:
                out.append((c, common))
        return out


def _dim0_index(entry: TensorEntry) -> tuple[list[int], list[ChunkEntry]] | None:
    chunks = [c for c in entry.chunks if c.box.volume]
    if not chunks or chunks[0].box.ndim == 0:
        return None
    if any(c.box.offsets[1:] != (0,) * (c.box.ndim - 1) or c.box.sizes[1:] != entry.shape[1:] for c in chunks):
        return None
    chunks.sort(key=lambda c: c.box.offsets[0])
    return [c.box.offsets[0] for c in chunks], chunks


def create_load_plan(
    manifest: Manifest,
    requests: Sequence[TensorRequest],
    value_keys: Iterable[str] = (),
    strict: bool = True,
    coalesce_gap: int = 0,
    index: ChunkIndex | None = None,
) -> LoadPlan:
    """The reads one rank makes to fill ``requests`` from ``manifest``.

    Each read covers whole checksum blocks (so it can be verified) and nothing
    else: for dim-0 shards the bytes read exceed the bytes needed only by the
    partial blocks at the two ends of each range. Reads closer than
    ``coalesce_gap`` bytes in one file merge into one.
    """
    missing = check_requests(manifest, requests, value_keys, strict)
    skip = set(missing)
    index = index or ChunkIndex(manifest)
    bs = manifest.block_size
    spans: list[tuple[str, int, int, ReadItem]] = []
    needed = 0
    for r in requests:
        if r.key in skip or r.box.volume == 0:
            continue
        isz = itemsize(r.dtype)
        needed += r.box.volume * isz
        for chunk, common in index.overlapping(r.key, r.box):
            start, end, item = read_span(r.key, chunk, common, isz, bs)
            spans.append((chunk.file, start, end, item))
    spans.sort(key=lambda s: (s[0], s[1], s[2]))
    reads: list[FileRead] = []
    cur: list = []
    for file, start, end, item in spans:
        if cur and cur[0] == file and start <= cur[2] + coalesce_gap:
            cur[2] = max(cur[2], end)
            cur[3].append(item)
        else:
            if cur:
                reads.append(FileRead(cur[0], cur[1], cur[2] - cur[1], tuple(cur[3])))
            cur = [file, start, end, [item]]
    if cur:
        reads.append(FileRead(cur[0], cur[1], cur[2] - cur[1], tuple(cur[3])))
    return LoadPlan(tuple(reads), needed, tuple(missing))


def read_span(key: str, chunk: ChunkEntry, common: Box, isz: int, block_size: int) -> tuple[int, int, ReadItem]:
    """The file bytes [start, end) to read for the ``common`` part of ``chunk``: whole checksum blocks."""
    runs = contiguous_runs(chunk.box, common)
    lo = runs.start * isz
    hi = lo + runs.span * isz
    start = chunk.byte_offset + (lo // block_size) * block_size
    end = chunk.byte_offset + min(-(-hi // block_size) * block_size, chunk.byte_length)
    return start, end, ReadItem(key=key, chunk=chunk, box=common, lo=lo, hi=hi)


def create_load_plans(
    manifest: Manifest,
    requests_by_rank: Sequence[Sequence[TensorRequest]],
    value_keys: Iterable[str] = (),
    strict: bool = True,
) -> list[LoadPlan]:
    """Plans for every target rank at once (what the MetadataActor serves)."""
    index = ChunkIndex(manifest)
    values = tuple(value_keys)
    return [create_load_plan(manifest, reqs, values, strict, index=index) for reqs in requests_by_rank]


def dim0_boxes(shape: Sequence[int], world_size: int) -> list[Box]:
    """The boxes FSDP2 (``torch.chunk`` on dim 0) gives each of ``world_size`` ranks."""
    return [dim0_box(shape, world_size, r) for r in range(world_size)]


def dim0_box(shape: Sequence[int], world_size: int, rank: int) -> Box:
    """Rank ``rank``'s box of ``dim0_boxes(shape, world_size)``."""
    shape = tuple(shape)
    if not shape:
        return Box((), ())
    rows = shape[0]
    per = -(-rows // world_size) if rows else 0
    lo = min(rank * per, rows)
    hi = min(lo + per, rows)
    return Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:])


def is_dim0_layout(requests: Iterable[TensorRequest], rank: int, world_size: int) -> bool:
    """Whether every request is rank ``rank``'s FSDP2 dim-0 shard among ``world_size`` ranks."""
    return 0 <= rank < world_size and all(r.box == dim0_box(r.shape, world_size, rank) for r in requests)
