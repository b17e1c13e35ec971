"""The save layouts the MetadataActor keeps, so a save whose layout repeats sends only its digest.

A save's ``SaveSpec`` is mostly its *layout*: every tensor's dtype and global
shape and every key's path (``SpecLayout``, O(tensors) bytes), fixed by the
ranks' layouts (``engine.save_layout``: equal layout digests, equal tensors and
paths). The rest changes from save to save: ids, values, user metadata.

Rank 0 registers each save with the spec stripped of its layout (``split_spec``)
and a ``LayoutRef``: the layout's digest and an object-store reference to the
layout itself, put once per layout by rank 0 (``AsyncSaver``). The actor joins
the two again (``join_spec``) from its ``LayoutCache``; only when it lacks the
digest (the first save of a layout, the actor restarted, or the layout was
evicted) does it fetch the layout through the reference. So the actor receives
each layout once, and a restarted actor fetches it again instead of failing
the save.

Each rank's report is split the same way: its written chunks' keys, boxes and
files (``ChunkLayout``, fixed by the rank's plan) and what changes per save: byte
offsets and lengths, checksums, file sizes (``ShardReport``). Its ShardWriter
sends a chunk layout in full only the first time (or when the actor answers
``LAYOUT_WANTED``: it restarted, or dropped it), and the actor rebuilds the
rank's ``WrittenShard`` exactly (``join_shard``), so the committed manifest is
the same as with the full reports.

Ray-free: the reference is opaque here; the actor's shell resolves it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import numpy as np

from ...bounded import BoundedMap
from ...errors import SaveFailedError
from ...format.boxes import Box
from ...format.manifest import FileEntry
from ...format.paths import Path
from ...format.shard_file import WrittenChunk
from ...planning.save_columns import digest
from ...storage.commit import SaveSpec, WrittenShard

#: Save layouts the actor keeps (least recently used dropped first): a few runs sharing the actor.
LAYOUTS_KEPT = 4
#: Chunks of ranks' chunk layouts the actor keeps (about 40 bytes each): every rank's of a
#: 4,096-rank save of 2,000 tensors, twice; the most recent layout is kept whatever its size.
CHUNKS_KEPT = 16_000_000
#: ``MetadataActor.report_written``'s answer to a report whose chunk layout it lacks: send it in full.
LAYOUT_WANTED = "layout wanted"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SpecLayout:
    """The part of a ``SaveSpec`` its layout fixes."""

    #: Every tensor key's (dtype, global shape).
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    #: Each key's path through the nested state dict.
    paths: dict[str, Path]


@dataclass(frozen=True, slots=True)
class LayoutRef:
    """A save's layout as rank 0 sends it with every registration: its digest and where to fetch it."""

    #: ``engine.save.SaveContext.layout``: digest of every rank's layout.
    digest: bytes
    #: An object-store reference to the ``SpecLayout`` (owned by rank 0's process), nested in
    #: the call's arguments so Ray passes the reference, not the value: read only on a miss.
    ref: Any


def split_spec(spec: SaveSpec) -> tuple[SaveSpec, SpecLayout]:
    """``spec`` without its layout, and the layout."""
    return replace(spec, tensors={}, paths={}), SpecLayout(spec.tensors, spec.paths)


def join_spec(spec: SaveSpec, layout: SpecLayout) -> SaveSpec:
    """The full spec from one without its layout (``split_spec``) and the layout."""
    return replace(spec, tensors=layout.tensors, paths=layout.paths)


@dataclass(frozen=True, slots=True, eq=False)
class ChunkLayout:
    """The part of a rank's ``WrittenShard`` its plan fixes, as columns: per chunk its key,
    its box and which of the rank's files holds it."""

    keys: tuple[str, ...]
    #: Each box's rank (number of dims).
    ndims: np.ndarray
    #: Each box's offsets then sizes, one after another (int64).
    boxes: np.ndarray
    #: Index of each chunk's file in ``WrittenShard.files``.
    files: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)

    def interned(self) -> ChunkLayout:
        """This layout with its keys interned: the ranks' layouts of one save share each key's string."""
        return replace(self, keys=tuple(map(sys.intern, self.keys)))

    def digest(self) -> bytes:
        """What identifies this layout (equal for equal chunks in order)."""
        return digest(repr(self.keys).encode(), self.ndims.tobytes(), self.boxes.tobytes(), self.files.tobytes())


@dataclass(frozen=True, slots=True, eq=False, kw_only=True)
class ShardReport:
    """A rank's ``WrittenShard`` as its ShardWriter reports it: what changes per save, columns,
    and its chunk layout's digest; the layout itself only when the actor may lack it."""

    rank: int
    #: ``ChunkLayout.digest`` of its chunks.
    layout: bytes
    #: Per chunk (int64), in the order of ``WrittenShard.chunks``.
    byte_offsets: np.ndarray
    byte_lengths: np.ndarray
    #: Each chunk's checksum count (uint32), and every chunk's checksums one after another (uint64).
    checksum_counts: np.ndarray
    checksums: np.ndarray
    files: tuple[FileEntry, ...]
    chunks: ChunkLayout | None = None

    def without_layout(self) -> ShardReport:
        return replace(self, chunks=None)


def split_shard(shard: WrittenShard) -> ShardReport:
    """``shard`` as a report carrying its chunk layout (``ShardReport.without_layout`` drops it)."""
    file_index = {f.path: i for i, f in enumerate(shard.files)}
    chunks = shard.chunks
    boxes = [x for c in chunks for x in (*c.box.offsets, *c.box.sizes)]
    layout = ChunkLayout(
        tuple(c.key for c in chunks),
        np.array([c.box.ndim for c in chunks], dtype=np.uint8),
        np.array(boxes, dtype=np.int64),
        np.array([file_index[c.file] for c in chunks], dtype=np.int32),
    )
    return ShardReport(
        rank=shard.rank,
        layout=layout.digest(),
        byte_offsets=np.array([c.byte_offset for c in chunks], dtype=np.int64),
        byte_lengths=np.array([c.byte_length for c in chunks], dtype=np.int64),
        checksum_counts=np.array([len(c.checksums) for c in chunks], dtype=np.uint32),
        checksums=np.array([x for c in chunks for x in c.checksums], dtype=np.uint64),
        files=shard.files,
        chunks=layout,
    )


def join_shard(report: ShardReport, layout: ChunkLayout) -> WrittenShard:
    """The rank's ``WrittenShard`` again, from its report and its chunk layout (``split_shard``)."""
    if len(layout) != len(report.byte_offsets):
        raise ValueError(
            f"rank {report.rank}: chunk layout {report.layout.hex()} has {len(layout)} chunks, "
            f"the report {len(report.byte_offsets)}"
        )
    paths = [f.path for f in report.files]
    ends = np.cumsum(report.checksum_counts, dtype=np.int64).tolist()
    sums = report.checksums.tolist()
    flat, ndims = layout.boxes.tolist(), layout.ndims.tolist()
    offsets, lengths, files = report.byte_offsets.tolist(), report.byte_lengths.tolist(), layout.files.tolist()
    chunks, at, start = [], 0, 0
    for i, key in enumerate(layout.keys):
        n = ndims[i]
        box = Box(tuple(flat[at : at + n]), tuple(flat[at + n : at + 2 * n]))
        chunks.append(
            WrittenChunk(
                key=key,
                box=box,
                file=paths[files[i]],
                byte_offset=offsets[i],
                byte_length=lengths[i],
                checksums=tuple(sums[start : ends[i]]),
            )
        )
        at, start = at + 2 * n, ends[i]
    return WrittenShard(report.rank, tuple(chunks), report.files)


class LayoutCache(Generic[T]):
    """Layouts by digest, least recently used dropped once their total ``weight`` passes ``kept``
    (the most recent one stays). Not thread-safe: the actor uses it from its event loop only.

    Counts what it saw under ``names`` (uses, received, held), for ``MetadataActor.debug_stats``:
    uses of a digest (saves or reports that sent one), layouts received (fetched or sent in full),
    layouts held.
    """

    def __init__(
        self,
        names: tuple[str, str, str],
        kept: int = LAYOUTS_KEPT,
        weight: Callable[[T], int] = lambda _: 1,
    ) -> None:
        if kept < 1:
            raise ValueError(f"LayoutCache keeps at least one layout, got kept={kept}")
        self._names = names
        self._layouts: BoundedMap[bytes, T] = BoundedMap(kept, weight)
        self._uses = 0
        self._received = 0

    def get(self, digest: bytes) -> T | None:
        """The layout of ``digest`` if held (counted as a use)."""
        self._uses += 1
        return self._layouts.get(digest)

    def add(self, digest: bytes, layout: T) -> None:
        """Hold ``layout`` (just received) under ``digest``; drop the least recently used past ``kept``."""
        self._received += 1
        self._layouts.put(digest, layout)

    def counts(self) -> dict[str, int]:
        uses, received, held = self._names
        return {uses: self._uses, received: self._received, held: len(self._layouts)}


class SaveLayouts:
    """The MetadataActor's layouts: each save's (``specs``) and each rank's chunks (``chunks``)."""

    def __init__(self) -> None:
        self.specs: LayoutCache[SpecLayout] = LayoutCache(("layout_saves", "layouts_received", "layouts_held"))
        names = ("chunk_layout_reports", "chunk_layouts_received", "chunk_layouts_held")
        self.chunks: LayoutCache[ChunkLayout] = LayoutCache(names, CHUNKS_KEPT, len)

    def add_spec(self, digest: bytes, fetched: Any, save_id: str, run: str, step: int | None) -> SpecLayout:
        """Keep the save layout fetched from rank 0 for a save (``fetched``: what the fetch gave,
        an exception if it failed); ``SaveFailedError`` naming the save unless it is one."""
        if not isinstance(fetched, SpecLayout):
            got = f"{type(fetched).__name__}: {fetched}" if isinstance(fetched, Exception) else type(fetched).__name__
            raise SaveFailedError(
                f"save {save_id} of run {run!r} (step {step}): this MetadataActor does not hold its "
                f"layout {digest.hex()} and fetching it from rank 0 gave {got}"
            )
        self.specs.add(digest, fetched)
        return fetched

    def chunk_layout(self, report: ShardReport) -> ChunkLayout | None:
        """The chunk layout of ``report``: held, else the one it carries (kept); ``None`` if neither."""
        layout = self.chunks.get(report.layout)
        if layout is None and report.chunks is not None:
            layout = report.chunks.interned()
            self.chunks.add(report.layout, layout)
        return layout

    def counts(self) -> dict[str, int]:
        return {**self.specs.counts(), **self.chunks.counts()}
