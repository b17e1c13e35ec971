"""``save`` and ``load``: plan, write, commit, read.

Roles: every rank calls ``save`` / ``load`` (collective when a process group is
initialized). Rank 0 commits. Each phase ends in one all-gather that carries
failures, so an error on any rank is raised on every rank and nobody hangs.
"""

from __future__ import annotations

import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import torch

from . import planner
from .boxes import row_major_strides
from .coordinator import Coordinator, default_coordinator, gather_or_raise
from .errors import CorruptCheckpointError, InvalidStateError, RayckptError, SaveFailedError
from .manifest import (
    MANIFEST_NAME,
    Blocks,
    ChunkEntry,
    FileEntry,
    Manifest,
    TensorEntry,
    ValueEntry,
    decode_manifest,
    decode_value,
    encode_manifest,
    encode_value,
    find_manifest_problems,
)
from .planner import (
    FileRead,
    LocalShard,
    ReadItem,
    ReadPlan,
    SavePlan,
    TensorRequest,
    create_load_plan,
    create_save_plans,
)
from .shard_file import DEFAULT_BLOCK_SIZE, ChunkData, ShardReader, WrittenChunk, storage_type, write_shard_file
from .state import FlatState, TensorLeaf, as_bytes, flatten
from .storage import CheckpointDir


@dataclass(frozen=True, slots=True)
class SaveInfo:
    """What ``save`` returns on every rank."""

    path: str
    save_id: str
    bytes_written: int
    num_files: int
    world_size: int


@dataclass(frozen=True, slots=True)
class LoadInfo:
    """What ``load`` returns on every rank (figures are this rank's)."""

    path: str
    bytes_needed: int
    bytes_read: int
    num_reads: int
    missing_keys: tuple[str, ...]

    @property
    def read_amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown torch dtype {name!r} in manifest")
    return dtype


# ---------------------------------------------------------------------------
# Save


def save(
    state_dict: dict[str, Any],
    checkpoint_id: str | Any,
    *,
    process_group: Any = None,
    coordinator: Coordinator | None = None,
    filesystem: pafs.FileSystem | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    metadata: dict[str, Any] | None = None,
) -> SaveInfo:
    """Save ``state_dict`` to ``checkpoint_id`` (a path or a ``pyarrow.fs`` URI).

    Called by every rank of the process group, if one is initialized. Sharded
    DTensors are written by their owners; replicated data once. The checkpoint
    exists once ``manifest.json`` is committed by rank 0 after every rank's files
    are durable. On any rank's failure every rank raises ``SaveFailedError`` (or
    the shared error type), this save's files are removed and a previous
    checkpoint at the same location stays loadable.
    """
    coord = coordinator or default_coordinator(process_group)
    ckdir = CheckpointDir.resolve(checkpoint_id, filesystem)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")

    collected = collect_state(coord, state_dict)
    flat, save_id, values, plans = collected.flat, collected.save_id, collected.values, collected.plans
    written_files: list[str] = []

    def write() -> tuple[list[WrittenChunk], list[FileEntry]]:
        return write_plan(ckdir, plans[coord.rank], flat, save_id, coord.rank, block_size, written_files)

    try:
        results = gather_or_raise(coord, "save (writing shards)", write, SaveFailedError)

        def commit() -> int:
            if coord.rank != 0:
                return 0
            written = [w for chunks, _ in results for w in chunks]
            files = [f for _, fs in results for f in fs]
            manifest = create_manifest(
                collected.tensor_meta, written, files, values, save_id, coord.world_size, block_size, metadata or {}
            )
            commit_manifest(ckdir, manifest)
            return manifest.total_bytes

        total = gather_or_raise(coord, "save (commit)", commit, SaveFailedError)[0]
    except RayckptError:
        for rel in written_files:
            ckdir.delete(rel)
        if coord.rank == 0:
            ckdir.delete_dir_if_empty()
        raise
    num_files = sum(len(files) for _, files in results)
    return SaveInfo(ckdir.uri, save_id, total, num_files, coord.world_size)


@dataclass(slots=True)
class Collected:
    """The outcome of a save's first phase, the same on every rank except ``flat``."""

    flat: FlatState
    save_id: str
    values: dict[str, Any]
    tensor_meta: dict[str, tuple[str, tuple[int, ...]]]
    plans: list[SavePlan]
    #: Whatever each rank passed as ``extra`` to ``collect_state``, by rank.
    extras: list[Any]


def collect_state(coord: Coordinator, state_dict: dict[str, Any], extra: Any = None) -> Collected:
    """Save phase 1 (collective): flatten, share every rank's boxes, plan the writes."""
    flat_holder: list[FlatState] = []

    def collect() -> tuple[list[LocalShard], dict[str, Any], str | None, Any]:
        flat = flatten(state_dict)
        flat_holder.append(flat)
        shards = [LocalShard(t.key, t.dtype, t.shape, t.box) for t in flat.tensors.values()]
        values = {k: encode_value(v.value, k) for k, v in flat.values.items()}
        save_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}" if coord.rank == 0 else None
        return shards, values, save_id, extra

    gathered = gather_or_raise(coord, "save (collecting state)", collect, SaveFailedError)
    values = _merge_values([g[1] for g in gathered], {s.key for g in gathered for s in g[0]})
    plans = create_save_plans([g[0] for g in gathered], planner.MAX_CHUNK_BYTES)
    meta = {s.key: (s.dtype, s.shape) for g in gathered for s in g[0]}
    return Collected(flat_holder[0], gathered[0][2], values, meta, plans, [g[3] for g in gathered])


def _merge_values(per_rank: Sequence[dict[str, Any]], tensor_keys: set[str]) -> dict[str, Any]:
    """Replicated plain values: the lowest rank that has a key wins."""
    merged: dict[str, Any] = {}
    for values in per_rank:
        for k, v in values.items():
            if k in tensor_keys:
                raise InvalidStateError(f"key {k!r} is a tensor on one rank and a plain value on another")
            merged.setdefault(k, v)
    return merged


def write_plan(
    ckdir: CheckpointDir,
    plan: SavePlan,
    flat: FlatState,
    save_id: str,
    rank: int,
    block_size: int,
    written_files: list[str],
) -> tuple[list[WrittenChunk], list[FileEntry]]:
    """Write one rank's share of a save in this process."""
    return write_chunks(ckdir, create_chunk_data(plan, flat), save_id, rank, block_size, written_files)


def chunk_pieces(
    plan: SavePlan, flat: FlatState, local: dict[str, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The piece of its local tensor each item of ``plan`` saves: views, on any device.

    ``local``: the tensors to cut the pieces from (default: each leaf's own).
    """
    out = []
    for item in plan.items:
        leaf = flat.tensors[item.key]
        tensor = local[item.key] if local is not None else leaf.local.detach()
        out.append(tensor[item.box.relative_to(leaf.box).to_slices()])
    return out


def create_chunk_data(plan: SavePlan, flat: FlatState) -> list[ChunkData]:
    """The bytes of each item of ``plan``: zero-copy views of (CPU-staged) local tensors."""
    staged = stage_to_cpu(flat.tensors[item.key] for item in plan.items)
    pieces = chunk_pieces(plan, flat, staged)
    return [
        ChunkData(item.key, flat.tensors[item.key].dtype, item.box, as_bytes(piece.contiguous()))
        for item, piece in zip(plan.items, pieces)
    ]


def write_chunks(
    ckdir: CheckpointDir,
    chunks: Sequence[ChunkData],
    save_id: str,
    rank: int,
    block_size: int,
    written_files: list[str],
) -> tuple[list[WrittenChunk], list[FileEntry]]:
    """Write one rank's chunks: one Arrow file per storage type.

    Appends each file to ``written_files`` before writing it, so a failure can
    clean up. Called by a rank (in-process saves) or by a ShardWriter actor.
    """
    by_type: dict[str, list[ChunkData]] = {}
    for c in chunks:
        by_type.setdefault(storage_type(c.dtype), []).append(c)
    written: list[WrittenChunk] = []
    files: list[FileEntry] = []
    if by_type:
        ckdir.makedirs()
    for stype, data in sorted(by_type.items()):
        rel = f"{save_id}-r{rank:05d}-{stype}.arrow"
        written_files.append(rel)
        records, size = write_shard_file(ckdir, rel, data, block_size, save_id)
        written.extend(records)
        files.append(FileEntry(rel, size, rank))
    return written, files


def stage_to_cpu(leaves: Any) -> dict[str, torch.Tensor]:
    """Local tensors on the CPU: device tensors are copied (non-blocking, then one sync)."""
    staged: dict[str, torch.Tensor] = {}
    on_device = False
    for leaf in leaves:
        if leaf.key in staged:
            continue
        t = leaf.local.detach()
        if t.device.type != "cpu":
            on_device = True
            t = t.to("cpu", non_blocking=True)
        staged[leaf.key] = t
    if on_device and torch.cuda.is_available():
        torch.cuda.synchronize()
    return staged


def create_manifest(
    tensor_meta: dict[str, tuple[str, tuple[int, ...]]],
    written: Sequence[WrittenChunk],
    files: Sequence[FileEntry],
    values: dict[str, Any],
    save_id: str,
    world_size: int,
    block_size: int,
    metadata: dict[str, Any],
) -> Manifest:
    """Assemble and validate the manifest from every rank's written chunks (rank 0 / MetadataActor)."""
    chunks: dict[str, list[ChunkEntry]] = {k: [] for k in tensor_meta}
    for w in written:
        chunks[w.key].append(ChunkEntry(w.box, w.file, w.byte_offset, w.byte_length, w.checksums))
    entries: dict[str, TensorEntry | ValueEntry] = {}
    for key in sorted(tensor_meta):
        dtype, shape = tensor_meta[key]
        entries[key] = TensorEntry(dtype, shape, tuple(sorted(chunks[key], key=lambda c: c.box.offsets)))
    for key in sorted(values):
        entries[key] = ValueEntry(values[key])
    manifest = Manifest(save_id, world_size, block_size, entries, tuple(files), time.time(), user_metadata=metadata)
    problems = find_manifest_problems(manifest)
    if problems:
        raise SaveFailedError("refusing to commit an inconsistent checkpoint:\n  " + "\n  ".join(problems[:20]))
    return manifest


def commit_manifest(ckdir: CheckpointDir, manifest: Manifest) -> None:
    """The commit: write the manifest atomically, then drop files it does not name.

    Files of an older checkpoint at the same location (or of a crashed save) are
    removed only after the new manifest is durable, so some complete checkpoint is
    always on storage.
    """
    ckdir.makedirs()
    ckdir.write_atomic(MANIFEST_NAME, encode_manifest(manifest))
    keep = {f.path for f in manifest.files}
    for name in ckdir.list_files():
        if name.endswith(".arrow") and name not in keep:
            ckdir.delete(name)


def read_manifest(ckdir: CheckpointDir) -> Manifest:
    """Read and validate the committed manifest of ``ckdir``."""
    where = f"{ckdir.uri}/{MANIFEST_NAME}"
    manifest = decode_manifest(ckdir.read_bytes(MANIFEST_NAME), where=where)
    problems = find_manifest_problems(manifest)
    if problems:
        shown = "\n  ".join(problems[:20])
        raise CorruptCheckpointError(f"{where}: inconsistent manifest ({len(problems)} problem(s)):\n  {shown}")
    return manifest


# ---------------------------------------------------------------------------
# Load


def load(
    state_dict: dict[str, Any],
    checkpoint_id: str | Any,
    *,
    strict: bool = True,
    process_group: Any = None,
    coordinator: Coordinator | None = None,
    filesystem: pafs.FileSystem | None = None,
    plan_source: PlanSource | None = None,
) -> LoadInfo:
    """Fill ``state_dict`` in place from the checkpoint at ``checkpoint_id``.

    Called by every rank, with any world size: each rank reads only the byte
    ranges its own shards need. Keys the target does not ask for are ignored; a
    key it asks for that the checkpoint lacks is an error unless ``strict=False``.
    Shape or dtype mismatches are errors (never a silent cast). Stateful objects
    get ``load_state_dict`` once every rank has read its data.
    """
    coord = coordinator or default_coordinator(process_group)
    ckdir = CheckpointDir.resolve(checkpoint_id, filesystem)
    source = plan_source or plan_from_manifest
    flat_holder: list[FlatState] = []

    def read() -> LoadInfo:
        flat = flatten(state_dict)
        flat_holder.append(flat)
        plan, blocks, sizes, values = source(ckdir, flat, strict)
        return read_into(ckdir, plan, flat, blocks, sizes, values)

    info = gather_or_raise(coord, "load", read, RayckptError)[coord.rank]
    flat_holder[0].finish_load()
    return info


#: Gives a loading rank its read plan, the checksum blocks, file sizes and stored values.
PlanSource = Callable[[CheckpointDir, FlatState, bool], tuple[ReadPlan, Blocks, dict[str, int], dict[str, Any]]]


def plan_from_manifest(
    ckdir: CheckpointDir, flat: FlatState, strict: bool
) -> tuple[ReadPlan, Blocks, dict[str, int], dict[str, Any]]:
    """In-process planning: read the manifest and plan this rank's reads."""
    manifest = read_manifest(ckdir)
    plan = create_load_plan(manifest, tensor_requests(flat), flat.values.keys(), strict)
    sizes = {f.path: f.size for f in manifest.files}
    return plan, manifest.blocks, sizes, manifest_values(manifest, flat.values)


def tensor_requests(flat: FlatState) -> list[TensorRequest]:
    return [TensorRequest(t.key, t.dtype, t.shape, t.box) for t in flat.tensors.values()]


def read_into(
    ckdir: CheckpointDir,
    plan: ReadPlan,
    flat: FlatState,
    blocks: Blocks,
    file_sizes: Mapping[str, int],
    values: Mapping[str, Any],
) -> LoadInfo:
    """Carry out ``plan``: verified ranged reads copied straight into the targets.

    ``values`` maps value keys to their stored (tagged JSON) form.
    """
    reader = ShardReader(ckdir, blocks, dict(file_sizes))
    direct: list[DirectRead] = []
    rest: list[FileRead] = []
    for fr in plan.reads:
        d = _direct_read(fr, flat) if reader.can_read_direct else None
        if d is None:
            rest.append(fr)
        else:
            direct.append(d)
    try:
        _read_direct_pipelined(reader, direct)
        with warnings.catch_warnings():
            # Read-only (memory-mapped) buffers are only ever copied from.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for fr in rest:
                buf = reader.read(fr.file, fr.offset, fr.length)
                for item in fr.items:
                    reader.verify([(fr.offset, memoryview(buf))], item.key, item.chunk, item.lo, item.hi)
                    _copy_item(buf, fr.offset, item, flat.tensors[item.key])
    finally:
        reader.close()
    for key, leaf in flat.values.items():
        if key in values:
            leaf.assign(decode_value(values[key]))
    return LoadInfo(ckdir.uri, plan.needed_bytes, reader.bytes_read, len(plan.reads), plan.missing)


def manifest_values(manifest: Manifest, keys: Iterable[str]) -> dict[str, Any]:
    """The stored values of ``keys`` that the manifest has as values."""
    out = {}
    for k in keys:
        entry = manifest.entries.get(k)
        if isinstance(entry, ValueEntry):
            out[k] = entry.value
    return out


@dataclass(frozen=True, slots=True)
class DirectRead:
    """A single-item range read with one ``preadv`` straight into its target.

    The partial checksum blocks at the range's two ends go to the small
    ``head`` and ``tail`` scratch buffers, read in the same ``preadv``.
    """

    read: FileRead
    head: memoryview
    body: memoryview
    tail: memoryview

    def segments(self) -> list[tuple[int, memoryview]]:
        start = self.read.offset + len(self.head)
        return [(self.read.offset, self.head), (start, self.body), (start + len(self.body), self.tail)]


def _direct_read(fr: FileRead, flat: FlatState) -> DirectRead | None:
    """A ``DirectRead`` for ``fr`` if its one item's target is contiguous CPU memory, else None."""
    if len(fr.items) != 1:
        return None
    item = fr.items[0]
    leaf = flat.tensors[item.key]
    dst = leaf.local[item.box.relative_to(leaf.box).to_slices()]
    if item.hi - item.lo != dst.numel() * dst.element_size() or not dst.is_contiguous() or dst.device.type != "cpu":
        return None
    start = item.chunk.byte_offset + item.lo
    end = item.chunk.byte_offset + item.hi
    head = memoryview(bytearray(start - fr.offset))
    tail = memoryview(bytearray(fr.offset + fr.length - end))
    body = memoryview(dst.detach().reshape(-1).view(torch.uint8).numpy())
    return DirectRead(fr, head, body, tail)


#: Direct reads are split into pieces of at most this many bytes, spread over
#: ``READ_THREADS`` threads, so the disk has several requests in flight per rank.
READ_PIECE_BYTES = 8 * 2**20
READ_THREADS = 1


def _read_direct_pipelined(reader: ShardReader, reads: Sequence[DirectRead]) -> None:
    """Run ``reads`` on a few I/O threads while this thread verifies the finished ones, in order.

    ``preadv`` releases the GIL, so the disk, the kernel copies and the
    checksums overlap. The reads land in the targets themselves: running ahead
    costs no memory. On the first error the queued reads are cancelled.
    """
    if not reads:
        return
    with ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="rayckpt-read") as pool:
        pending = [
            [pool.submit(reader.read_direct, d.read.file, off, views) for off, views in _pieces(d)] for d in reads
        ]
        try:
            for d, futures in zip(reads, pending):
                for fut in futures:
                    fut.result()
                item = d.read.items[0]
                reader.verify(d.segments(), item.key, item.chunk, item.lo, item.hi)
        except BaseException:
            for futures in pending:
                for fut in futures:
                    fut.cancel()
            raise


def _pieces(d: DirectRead) -> list[tuple[int, list[memoryview]]]:
    """Split a direct read into (file offset, views) pieces of at most ``READ_PIECE_BYTES``."""
    max_bytes = READ_PIECE_BYTES
    out: list[tuple[int, list[memoryview]]] = []
    offset, cur, size = d.read.offset, [], 0
    for view in (d.head, d.body, d.tail):
        while len(view):
            take = min(len(view), max_bytes - size)
            cur.append(view[:take])
            view, size = view[take:], size + take
            if size == max_bytes:
                out.append((offset, cur))
                offset, cur, size = offset + size, [], 0
    if cur:
        out.append((offset, cur))
    return out


def _copy_item(buf: Any, buf_offset: int, item: ReadItem, leaf: TensorLeaf) -> None:
    start = item.chunk.byte_offset + item.lo - buf_offset
    dtype = torch_dtype(leaf.dtype)
    raw = np.frombuffer(buf, dtype=np.uint8, count=item.hi - item.lo, offset=start)
    src = torch.from_numpy(raw).view(dtype)
    src = src.as_strided(item.box.sizes, row_major_strides(item.chunk.box.sizes))
    with torch.no_grad():
        leaf.local[item.box.relative_to(leaf.box).to_slices()].copy_(src)
