"""Rank slices: one loading rank's part of a ``BulkPlan`` as numpy columns (a load without Ray).

Without Ray, each loading rank sends rank 0 a ``LoadAsk`` (a digest of what it
asks for, and whether that is its FSDP2 dim-0 shard of every tensor: a few
bytes, whatever its shard count). When every rank asks alike, rank 0 reads the
manifest once, plans every rank at once (``bulk.create_dim0_plans``) and sends
each rank only its ``RankSlice``: the columns of the chunks it reads (file,
byte offset and length, dim-0 rows, block checksums), its reads, and the
manifest facts its reads need (checksum block size and algorithm, the sizes of
its files, its plain values). The rank builds its ``LoadPlan`` from the slice
and its own specs (``RankSlice.plan``), equal to ``BulkPlan.for_rank`` and to
``create_load_plan``: no per-item object is built or pickled at rank 0.

Pure: numpy, no torch.distributed, no Ray, no I/O.
"""

from __future__ import annotations

import hashlib
import math
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format.boxes import Box
from ..format.chunk_columns import ChunkColumns
from ..format.manifest import Blocks, ChunkEntry, Manifest, itemsize, manifest_values
from .bulk import BulkPlan, TensorSpec, create_dim0_plans
from .chunk_table import SCALAR_BOX, ChunkTable, RankRows, dim0_item_bounds
from .load_plan import FileRead, LoadPlan, ReadItem, TensorRequest, is_dim0_layout


@dataclass(frozen=True, slots=True)
class LoadAsk:
    """What a loading rank sends rank 0 to plan its load: a few bytes, whatever its shard count."""

    #: ``ask_digest`` of its specs, value keys and ``strict``: ranks that ask alike send the same.
    digest: bytes
    #: Whether its requests are its FSDP2 dim-0 shards (``is_dim0_layout``).
    dim0: bool

    @staticmethod
    def of(
        requests: Sequence[TensorRequest], value_keys: Iterable[str], strict: bool, rank: int, world_size: int
    ) -> LoadAsk:
        digest = ask_digest(specs_of(requests), value_keys, strict)
        return LoadAsk(digest, is_dim0_layout(requests, rank, world_size))


def specs_of(requests: Iterable[TensorRequest]) -> tuple[TensorSpec, ...]:
    """The ``(key, dtype, shape)`` of each request, in order: what ``create_dim0_plans`` takes."""
    return tuple((r.key, r.dtype, r.shape) for r in requests)


def ask_digest(specs: Sequence[TensorSpec], value_keys: Iterable[str], strict: bool) -> bytes:
    data = pickle.dumps((tuple(specs), tuple(value_keys), strict), protocol=5)
    return hashlib.blake2b(data, digest_size=16).digest()


def asked_alike(asks: Sequence[LoadAsk]) -> bool:
    """Every rank asks for its dim-0 shards of the same specs, values and ``strict``: one bulk plan serves all."""
    return bool(asks) and all(a.dim0 and a.digest == asks[0].digest for a in asks)


@dataclass(frozen=True, eq=False, kw_only=True)
class RankSlice:
    """One rank's part of a bulk load plan: one row per item (a chunk it reads), in plan order."""

    rank: int
    world_size: int
    needed_bytes: int
    #: Keys asked for that the checkpoint lacks (only with strict=False).
    missing: tuple[str, ...]
    blocks: Blocks
    #: The plain values the rank asked for, in their stored form.
    values: dict[str, Any]
    #: The files its items read (the ``file`` column indexes these), and their sizes.
    files: tuple[str, ...]
    sizes: tuple[int, ...]
    #: Per item: the index of its key in the specs; its chunk's first dim-0 row and dim-0 size
    #: (0 and 1 for a 0-dim chunk), file, byte offset, byte length and number of block checksums.
    spec: np.ndarray
    start: np.ndarray
    rows: np.ndarray
    file: np.ndarray
    byte_offset: np.ndarray
    byte_length: np.ndarray
    num_checksums: np.ndarray
    #: Every item's chunk's block checksums back to back (uint64).
    checksums: np.ndarray
    #: Per read: its first item, byte offset and length (in the file of its first item).
    read_first: np.ndarray
    read_offset: np.ndarray
    read_length: np.ndarray
    #: The manifest's ``data_position`` (None: saved without one).
    data_position: dict[str, Any] | None = None

    @property
    def file_sizes(self) -> dict[str, int]:
        return dict(zip(self.files, self.sizes))

    @property
    def nbytes(self) -> int:
        """Bytes of the columns (what a rank receives, less a few names and values)."""
        return sum(getattr(self, name).nbytes for name in _ARRAYS)

    def plan(self, specs: Sequence[TensorSpec]) -> LoadPlan:
        """This rank's ``LoadPlan`` (``specs``: those the bulk plan was made for, as the rank asked)."""
        shapes = [s for _, _, s in specs]
        key_rows = np.array([s[0] if s else 1 for s in shapes], np.int64)
        row_bytes = np.array([math.prod(s[1:]) * itemsize(d) for _, d, s in specs], np.int64)
        per = np.array([-(-s[0] // self.world_size) if s else 0 for s in shapes], np.int64)
        step = np.where(np.array([bool(s) for s in shapes]), per, 1)
        k = self.spec
        first, count, lo, hi = dim0_item_bounds(
            self.rank, self.start, self.rows, key_rows[k], row_bytes[k], RankRows(per[k], step[k])
        )
        sums = self.checksums.tolist()
        ends = np.cumsum(self.num_checksums).tolist()
        tails = [s[1:] for s in shapes]
        zeros = [(0,) * len(t) for t in tails]
        files = self.files
        items: list[ReadItem] = []
        c0 = 0
        columns = (k, self.start, self.rows, self.file, self.byte_offset, self.byte_length, first, count, lo, hi)
        for (kid, s, n, fid, off, length, f, c, lo_, hi_), c1 in zip(zip(*(a.tolist() for a in columns)), ends):
            key, _, shape = specs[kid]
            if shape:
                tail, zero = tails[kid], zeros[kid]
                chunk_box, box = Box((s, *zero), (n, *tail)), Box((f, *zero), (c, *tail))
            else:
                chunk_box = box = SCALAR_BOX
            chunk = ChunkEntry(
                box=chunk_box, file=files[fid], byte_offset=off, byte_length=length, checksums=tuple(sums[c0:c1])
            )
            items.append(ReadItem(key=key, chunk=chunk, box=box, lo=lo_, hi=hi_))
            c0 = c1
        bounds = self.read_first.tolist() + [len(items)]
        reads = tuple(
            FileRead(items[i0].chunk.file, offset, length, tuple(items[i0:i1]))
            for i0, i1, offset, length in zip(bounds, bounds[1:], self.read_offset.tolist(), self.read_length.tolist())
        )
        return LoadPlan(reads, self.needed_bytes, self.missing)


_ARRAYS = ("spec", "start", "rows", "file", "byte_offset", "byte_length", "num_checksums", "checksums")
_ARRAYS += ("read_first", "read_offset", "read_length")


def create_rank_slices(
    manifest: Manifest,
    specs: Sequence[TensorSpec],
    world_size: int,
    value_keys: Iterable[str] = (),
    strict: bool = True,
) -> list[RankSlice] | None:
    """Every rank's slice of the bulk plan of ``specs`` over ``world_size`` FSDP2 ranks.

    Raises what ``create_dim0_plans`` raises (``IncompatibleStateError`` naming
    the key). ``None`` when the plan holds items planned per rank (keys whose
    chunks are not dim-0 slabs, specs asking for a key twice): plan those ranks
    with ``create_load_plan``.
    """
    value_keys = tuple(value_keys)
    cols = ChunkColumns.from_manifest(manifest)
    t = ChunkTable.from_manifest(manifest, cols)
    bulk = create_dim0_plans(manifest, specs, world_size, value_keys, strict, table=t)
    return slice_plan(bulk, specs, value_keys, cols)


def slice_plan(
    bulk: BulkPlan, specs: Sequence[TensorSpec], value_keys: Iterable[str], columns: ChunkColumns
) -> list[RankSlice] | None:
    """Every rank's slice of ``bulk`` (planned for ``specs`` and ``value_keys`` from the manifest
    whose chunk ``columns`` are given); ``None`` unless ``bulk.all_dim0``."""
    if not bulk.all_dim0:
        return None
    t, cols, world_size = bulk.table, columns, bulk.world_size
    manifest = t.manifest
    key_ids = {k: i for i, k in enumerate(t.keys)}
    spec_of_key = np.zeros(len(t.keys), np.int32)
    for i, (key, _, _) in enumerate(specs):
        if key in key_ids:
            spec_of_key[key_ids[key]] = i
    item_row, item_first, read_item, read_offset, read_length, read_of_rank = bulk.rank_columns()
    # Every rank's columns at once, in rank order; each slice holds views of its part.
    key = t.key[item_row]
    at = t.key_first[key] + t.index[item_row]  # the row of the columns (manifest order)
    count = cols.num_checksums[at].astype(np.int32)
    sums, sums_first = _checksums(manifest, cols)
    sums = sums[_ranges(sums_first[at], count)]
    sums_end = np.zeros(len(count) + 1, np.int64)
    np.cumsum(count, out=sums_end[1:])
    del at
    spec, file = spec_of_key[key], t.file[item_row]
    start, rows = t.start[item_row], t.rows[item_row]
    offset, length = t.byte_offset[item_row], t.byte_length[item_row]
    files = t.files
    path_size = {f.path: f.size for f in manifest.files}
    values = manifest_values(manifest, value_keys)
    out = []
    for rank, (p0, p1, q0, q1) in enumerate(
        zip(item_first.tolist(), item_first[1:].tolist(), read_of_rank.tolist(), read_of_rank[1:].tolist())
    ):
        used, local = np.unique(file[p0:p1], return_inverse=True)
        names = [files[i] for i in used.tolist()]
        out.append(
            RankSlice(
                rank=rank,
                world_size=world_size,
                needed_bytes=int(bulk.needed_bytes[rank]),
                missing=bulk.missing,
                blocks=manifest.blocks,
                values=values,
                files=tuple(names),
                sizes=tuple(path_size.get(name, 0) for name in names),
                spec=spec[p0:p1],
                start=start[p0:p1],
                rows=rows[p0:p1],
                file=local.astype(np.int32),
                byte_offset=offset[p0:p1],
                byte_length=length[p0:p1],
                num_checksums=count[p0:p1],
                checksums=sums[sums_end[p0] : sums_end[p1]],
                read_first=read_item[q0:q1] - p0,
                read_offset=read_offset[q0:q1],
                read_length=read_length[q0:q1],
                data_position=manifest.data_position,
            )
        )
    return out


def _checksums(manifest: Manifest, cols: ChunkColumns) -> tuple[np.ndarray, np.ndarray]:
    """Every chunk's block checksums back to back (uint64, rows of ``cols``), and where each row's start."""
    if cols.checksums is None:  # columns read from a stored chunk table hold them; others are built here
        cols = ChunkColumns.from_manifest(manifest, list(cols.keys), checksums=True)
    assert cols.checksums is not None
    return cols.checksums, cols.checksum_first


def _ranges(first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The indices ``first[i] .. first[i] + count[i]`` of every ``i``, back to back."""
    ends = np.cumsum(count)
    return np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(first - (ends - count), count)
