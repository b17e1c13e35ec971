"""The read step: carry out a ``LoadPlan`` with verified ranged reads straight into the targets.

Local files: each single-item range is one ``preadv`` into the target tensor's
memory (partial checksum blocks at its ends into small scratch buffers), split
into pieces on an I/O thread that runs ahead while this thread verifies the
finished ones in order. Other reads (remote filesystems, strided targets) read
the range, verify it and copy. ``LoadInfo`` is what a rank read.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..format.boxes import row_major_strides
from ..format.manifest import Blocks
from ..format.shard_file import ShardReader
from ..format.values import decode_value
from ..planning.load_plan import FileRead, LoadPlan, ReadItem
from ..storage.checkpoint_dir import CheckpointDir
from .state import FlatState, TensorLeaf, torch_dtype


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


def read_into(
    ckdir: CheckpointDir,
    plan: LoadPlan,
    flat: FlatState,
    blocks: Blocks,
    file_sizes: Mapping[str, int],
    values: Mapping[str, Any],
    reader: ShardReader | None = None,
) -> LoadInfo:
    """Carry out ``plan``: verified ranged reads copied straight into the targets.

    ``values`` maps value keys to their stored (tagged JSON) form. Before the
    first read, every file the plan reads is checked on storage (exists, has
    its recorded size, holds the ranges), so a mismatch fails with nothing
    written into the targets. ``reader``: one to reuse (the tools read many
    tensors with one, which stats each file once); it is closed, not dropped.
    """
    reader = reader or ShardReader(ckdir, blocks, dict(file_sizes))
    reader.check_ranges((fr.file, fr.offset, fr.length) for fr in plan.reads)
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
    return LoadInfo(ckdir.location, plan.needed_bytes, reader.bytes_read, len(plan.reads), plan.missing)


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
        leaf.region(item.box).copy_(src)
