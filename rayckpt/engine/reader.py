"""The read step: carry out a ``LoadPlan`` with verified ranged reads straight into the targets.

Local files: each single-item range is one ``preadv`` into the target tensor's
memory (partial checksum blocks at its ends into small scratch buffers), split
into pieces on an I/O thread that runs ahead while this thread verifies the
finished ones in order. Remote filesystems (object storage): neighbouring
ranges are coalesced into ranged GETs (``planning.range_gets``), each fetched as
requests of at most ``GET_PART_BYTES``, up to ``GET_CONCURRENCY`` in flight per
rank; a GET's ranges are verified per block and copied into the targets on the
thread that brings its last part. Other local reads (strided targets) read the range
(a memory-map slice), verify it and copy. Targets on a device (CUDA) take the
last two paths: verified in host memory, then copied through ``HostToDevice``'s
bounded pinned slots (``engine/device.py``). ``LoadInfo`` is what a rank read.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..format.boxes import row_major_strides
from ..format.manifest import Blocks
from ..format.shard_file import ShardReader
from ..format.values import decode_value
from ..phases import current, phase
from ..planning import range_gets
from ..planning.load_plan import FileRead, LoadPlan, ReadItem
from ..planning.range_gets import RangeGet, create_range_gets, get_parts
from ..storage.checkpoint_dir import CheckpointDir
from .device import HostToDevice, needs_bounce
from .state import FlatState, TensorLeaf, torch_dtype


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadInfo:
    """What ``load`` returns on every rank: what this rank needed, read and fetched, and where its time went.

    How the counts relate: ``docs/guarantees.md``, "What LoadInfo counts".
    """

    #: The checkpoint's location, credentials redacted.
    path: str
    #: Payload bytes this rank's targets needed.
    bytes_needed: int
    #: Bytes of the plan's ranges (whole checksum blocks around the needed bytes).
    bytes_read: int
    #: Ranges in the plan.
    num_reads: int
    #: Keys the target asked for that the checkpoint lacks, left as they were (``strict=False``).
    missing_keys: tuple[str, ...]
    #: Read requests made to storage: GETs on object storage (several ranges may
    #: share one), ``preadv`` calls and memory-map reads on local files.
    requests: int = 0
    #: Bytes transferred from storage: ``bytes_read`` plus the gap bytes that
    #: coalesced GETs fetched and discarded (equal to ``bytes_read`` on local files).
    bytes_fetched: int = 0
    #: Where this rank's time went, in seconds (``rayckpt.phases``): ``plan`` (the planning collectives;
    #: rank 0's ``manifest_read`` apart), ``plan_local`` (this rank's plan from its slice), ``check`` (each
    #: file's size checked before any read), ``read`` (waiting on reads), ``verify`` (checksums), ``copy``
    #: (into the targets), ``gather_reads`` (waiting for the other ranks), ``finish`` (Stateful
    #: ``load_state_dict``), ``other``, ``total``; ``verify_copy_threads``: checksums and copies done on
    #: the object-store read threads (thread-seconds inside ``read``, not in ``total``).
    phases: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def read_amplification(self) -> float:
        """Bytes fetched from storage per byte needed (1.0 = nothing extra)."""
        return self.bytes_fetched / self.bytes_needed if self.bytes_needed else 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RankRead:
    """What one rank's reads need: its plan, and from the manifest the checksum blocks, the file
    sizes and the stored values."""

    plan: LoadPlan
    blocks: Blocks
    file_sizes: Mapping[str, int]
    #: Value keys to their stored (tagged JSON) form.
    values: Mapping[str, Any] = field(default_factory=dict)
    #: The manifest's ``data_position`` (None: saved without one).
    data_position: dict[str, Any] | None = None


def read_into(
    ckdir: CheckpointDir,
    read: RankRead,
    flat: FlatState,
    reader: ShardReader | None = None,
    to_device: HostToDevice | None = None,
) -> LoadInfo:
    """Carry out ``read.plan``: verified ranged reads copied straight into the targets.

    Before the
    first read, every file the plan reads is checked on storage (exists, has
    its recorded size, holds the ranges), so a mismatch fails with nothing
    written into the targets. ``reader``: one to reuse (the tools read many
    tensors with one, which stats each file once); it is closed, not dropped.
    Targets on a device (CUDA) are read into host memory, verified there and
    copied through ``to_device``'s bounded pinned slots; every copy is done
    when this returns.
    """
    plan, values = read.plan, read.values
    reader = reader or ShardReader(ckdir, read.blocks, dict(read.file_sizes))
    fetched, requests = reader.bytes_fetched, reader.requests
    with phase("check"):
        reader.check_ranges((fr.file, fr.offset, fr.length) for fr in plan.reads)
    to_device = to_device or HostToDevice()
    direct: list[DirectRead] = []
    rest: list[FileRead] = []
    for fr in plan.reads:
        d = _direct_read(fr, flat) if reader.reads_direct(fr.file) else None
        if d is None:
            rest.append(fr)
        else:
            direct.append(d)
    try:
        with phase("read"):
            _read_direct_pipelined(reader, direct)
            with warnings.catch_warnings():
                # Read-only (memory-mapped) buffers are only ever copied from.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                if ckdir.reads_in_place:
                    for fr in rest:
                        buf = reader.read(fr.file, fr.offset, fr.length)
                        _verify_and_copy(reader, buf, fr.offset, fr, flat, to_device)
                else:
                    _read_gets(reader, create_range_gets(rest), flat, to_device)
    finally:
        with phase("copy"):
            to_device.finish()
        reader.close()
    for key, leaf in flat.values.items():
        if key in values:
            leaf.assign(decode_value(values[key]))
    return LoadInfo(
        path=ckdir.location,
        bytes_needed=plan.needed_bytes,
        bytes_read=plan.read_bytes,
        num_reads=len(plan.reads),
        missing_keys=plan.missing,
        requests=reader.requests - requests,
        bytes_fetched=reader.bytes_fetched - fetched,
    )


def _verify_and_copy(
    reader: ShardReader, buf: Any, buf_offset: int, fr: FileRead, flat: FlatState, to_device: HostToDevice
) -> None:
    """Verify the blocks of each item of ``fr`` in ``buf`` (file bytes from ``buf_offset``), then copy it."""
    for item in fr.items:
        with phase("verify"):
            reader.verify([(buf_offset, memoryview(buf))], item.key, item.chunk, item.lo, item.hi)
        with phase("copy"):
            _copy_item(buf, buf_offset, item, flat.tensors[item.key], to_device)


def _read_gets(reader: ShardReader, gets: Sequence[RangeGet], flat: FlatState, to_device: HostToDevice) -> None:
    """Run ``gets`` as their parts' requests on ``GET_CONCURRENCY`` threads.

    A GET's parts (``get_parts``) fill one buffer, allocated when its first
    part arrives; the thread that brings the last part verifies and copies
    the GET's ranges, then lets the buffer go. Requests are queued in plan
    order, so only the few GETs whose parts are in flight hold buffers:
    memory stays bounded by about the pool size times ``MAX_GET_BYTES`` (or
    the largest single range). Targets of different ranges never overlap, so
    the copies need no lock. On the first error (in plan order) the queued
    requests are cancelled.
    """

    clock = current()  # the pool's threads add their checksum and copy seconds to the load's phases

    def one(asm: _Assembly, offset: int, length: int) -> None:
        buf = asm.add(offset, reader.fetch(asm.get.file, offset, length))
        if buf is not None:
            began = time.perf_counter()
            for fr in asm.get.reads:
                _verify_and_copy(reader, buf, asm.get.offset, fr, flat, to_device)
            if clock is not None:
                clock.add("verify_copy_threads", time.perf_counter() - began)

    if not gets:
        return
    with ThreadPoolExecutor(max_workers=range_gets.GET_CONCURRENCY, thread_name_prefix="rayckpt-get") as pool:
        futures = []
        for get in gets:
            parts = get_parts(get, range_gets.GET_PART_BYTES)
            asm = _Assembly(get, len(parts))
            futures += [pool.submit(one, asm, offset, length) for offset, length in parts]
        try:
            for fut in futures:
                fut.result()
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise


class _Assembly:
    """The parts of one GET coming together; ``add`` returns its bytes once all are in."""

    def __init__(self, get: RangeGet, parts: int) -> None:
        self.get = get
        self.parts = self.left = parts
        self.buf: np.ndarray | None = None
        self.lock = threading.Lock()

    def add(self, offset: int, data: bytes) -> Any:
        if self.parts == 1:
            return data  # a GET of one part: its bytes as fetched, no copy
        with self.lock:
            if self.buf is None:
                self.buf = np.empty(self.get.length, dtype=np.uint8)
            buf = self.buf
        start = offset - self.get.offset
        buf[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)
        with self.lock:
            self.left -= 1
            if self.left:
                return None
            self.buf = None  # the caller holds the only reference now
            return buf


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
    dst = flat.tensors[item.key].region(item.box)
    if item.hi - item.lo != dst.numel() * dst.element_size() or not dst.is_contiguous() or needs_bounce(dst):
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
                with phase("verify"):
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


def _copy_item(buf: Any, buf_offset: int, item: ReadItem, leaf: TensorLeaf, to_device: HostToDevice) -> None:
    start = item.chunk.byte_offset + item.lo - buf_offset
    dtype = torch_dtype(leaf.dtype)
    raw = np.frombuffer(buf, dtype=np.uint8, count=item.hi - item.lo, offset=start)
    src = torch.from_numpy(raw).view(dtype)
    src = src.as_strided(item.box.sizes, row_major_strides(item.chunk.box.sizes))
    with torch.no_grad():
        to_device.copy(leaf.region(item.box), src)
