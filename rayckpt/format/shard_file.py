"""Shard files: uncompressed Arrow IPC files of flat primitive arrays.

Each record batch holds one chunk: a single column ``data`` whose array is the
chunk's elements in row-major order, tagged with the key, torch dtype and box in
the batch's custom metadata so any Arrow reader can make sense of it. A file
holds one Arrow storage type (an IPC file has one schema), so a rank writes one
file per storage type it has.

Writes go straight from the caller's memory to the file (no serialized copy);
reads are ranged reads of the exact bytes, zero-copy on memory-mapped files, and
verified against per-block checksums (XXH3-64; CRC-32 in version-1 checkpoints).
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
import xxhash

from ..errors import CorruptCheckpointError
from .boxes import Box
from .manifest import DEFAULT_CHECKSUM, DTYPES, FORMAT_VERSION, Blocks


class ShardFiles(Protocol):
    """Where shard files are read and written: what this module needs of a checkpoint directory.

    ``rayckpt.storage.checkpoint_dir.CheckpointDir`` is the one implementation; the
    format layer names only the calls it makes, so it never imports storage.
    """

    location: str

    @property
    def is_local(self) -> bool: ...

    def path(self, rel: str) -> str: ...

    def open_output(self, rel: str) -> Any: ...

    def sync_file(self, rel: str) -> None: ...

    def start_sync(self, rel: str, offset: int, length: int) -> None: ...

    def open_input(self, rel: str) -> Any: ...

    def held_descriptor(self, rel: str) -> int | None: ...

    def size(self, rel: str) -> int | None: ...

    def refuse_link(self, rel: str) -> None: ...


#: Bytes per block checksum, the least a save picks by itself (``auto_block_size``).
DEFAULT_BLOCK_SIZE = 64 * 1024
#: The most block checksums ``auto_block_size`` gives a checkpoint: 2**19, 4 MiB of them.
MAX_AUTO_BLOCKS = 1 << 19


def auto_block_size(state_bytes: int) -> int:
    """A save's block size when the caller names none: 64 KiB, doubled while the state would
    have more than ``MAX_AUTO_BLOCKS`` blocks (states past 32 GiB).

    A ranged read covers whole blocks, so a larger block reads more around a reshard's
    cuts; each block costs 8 bytes of the manifest's chunk table, the largest part of it
    at small rank counts. States up to 32 GiB keep 64 KiB, where the extra bytes a
    reshard reads at its cuts are negligible; past that, doubling the block size keeps
    the chunk table's checksums at most ``MAX_AUTO_BLOCKS`` (4 MiB) however large the
    state grows (docs/benchmarks.md).
    """
    size = DEFAULT_BLOCK_SIZE
    while state_bytes > size * MAX_AUTO_BLOCKS:
        size *= 2
    return size


_ARROW_TYPES = {
    "double": pa.float64(),
    "float": pa.float32(),
    "halffloat": pa.float16(),
    "int64": pa.int64(),
    "int32": pa.int32(),
    "int16": pa.int16(),
    "int8": pa.int8(),
    "uint64": pa.uint64(),
    "uint32": pa.uint32(),
    "uint16": pa.uint16(),
    "uint8": pa.uint8(),
}


def storage_type(dtype: str) -> str:
    """The Arrow type name a torch dtype is stored as."""
    return DTYPES[dtype][1]


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """A chunk to write, without its bytes: which tensor, its dtype and its global box."""

    key: str
    dtype: str
    box: Box

    def with_data(self, data: Any) -> ChunkData:
        return ChunkData(self.key, self.dtype, self.box, data)


@dataclass(frozen=True, slots=True)
class ChunkData:
    """A chunk to write: its raw bytes (any buffer-protocol object) and where it goes."""

    key: str
    dtype: str
    box: Box
    data: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class WrittenChunk:
    key: str
    box: Box
    file: str
    byte_offset: int
    byte_length: int
    checksums: tuple[int, ...]
    #: XXH3-128 of the chunk's bytes, when the save asked for it (an incremental save: the
    #: next save compares against it); b"" otherwise. Never stored in the checkpoint.
    fingerprint: bytes = b""


def fingerprint(data: memoryview) -> bytes:
    """A chunk's XXH3-128 (seed 0): what an incremental save matches an unchanged chunk by."""
    return xxhash.xxh3_128_digest(data)


def _sums(raw: memoryview, block_size: int, with_fingerprint: bool) -> tuple[tuple[int, ...], bytes]:
    return block_checksums(raw, block_size), fingerprint(raw) if with_fingerprint else b""


#: One-shot checksum of a buffer, by ``Manifest.checksum`` name.
_CHECKSUM_OF = {"xxh3_64": xxhash.xxh3_64_intdigest, "crc32": zlib.crc32}


def block_checksums(data: memoryview, block_size: int, checksum: str = DEFAULT_CHECKSUM) -> tuple[int, ...]:
    """The ``checksum`` of each ``block_size`` block of ``data``, the last one partial."""
    one = _CHECKSUM_OF[checksum]
    return tuple(one(data[i : i + block_size]) for i in range(0, len(data), block_size))


def checksum_of(parts: Sequence[memoryview], checksum: str) -> int:
    """The ``checksum`` of the concatenation of ``parts`` (one block, maybe split over buffers)."""
    if len(parts) == 1:
        return _CHECKSUM_OF[checksum](parts[0])
    if checksum == "crc32":
        value = 0
        for p in parts:
            value = zlib.crc32(p, value)
        return value
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


#: A shard file's written bytes are sent on to the disk (``start_sync``) every this many.
SYNC_AHEAD_BYTES = 16 << 20


def write_shard_file(
    ckdir: ShardFiles,
    rel: str,
    chunks: Sequence[ChunkData],
    block_size: int,
    save_id: str,
    fingerprints: Callable[[ChunkData], bool] | bool = False,
) -> tuple[list[WrittenChunk], int]:
    """Write ``chunks`` (all of one storage type) to ``rel``; fsync; return records and size.

    ``fingerprints``: also give each record (True: every one; a predicate: those of the chunks it
    picks) its chunk's XXH3-128, computed with the checksums.
    """
    arrow_name = storage_type(chunks[0].dtype)
    arrow_type = _ARROW_TYPES[arrow_name]
    width = arrow_type.bit_width // 8
    schema = pa.schema(
        [pa.field("data", arrow_type, nullable=False)],
        metadata={"rayckpt.version": str(FORMAT_VERSION), "rayckpt.save_id": save_id},
    )
    for c in chunks:
        if storage_type(c.dtype) != arrow_name:
            raise ValueError(f"chunk {c.key!r} ({c.dtype}) does not belong in a {arrow_name} file")
    raws = [memoryview(c.data).cast("B") for c in chunks]
    offsets: list[int] = []
    synced = 0
    # The checksums run on their own thread while this one writes (both release the GIL): the
    # source bytes are read twice at once, not one pass after the other.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayckpt-sum") as summer:
        wanted = [fingerprints(c) if callable(fingerprints) else fingerprints for c in chunks]
        sums = [summer.submit(_sums, raw, block_size, want) for raw, want in zip(raws, wanted)]
        try:
            with ckdir.open_output(rel) as sink:
                with pa.ipc.new_file(sink, schema) as writer:
                    for c, raw in zip(chunks, raws):
                        array = pa.Array.from_buffers(arrow_type, len(raw) // width, [None, pa.py_buffer(raw)])
                        meta = {
                            "key": c.key,
                            "dtype": c.dtype,
                            "offsets": json.dumps(list(c.box.offsets)),
                            "sizes": json.dumps(list(c.box.sizes)),
                        }
                        writer.write_batch(pa.record_batch([array], schema=schema), custom_metadata=meta)
                        # The body (no validity buffer) ends the message, padded to 8 bytes.
                        offsets.append(sink.tell() - (-(-len(raw) // 8) * 8))
                        if sink.tell() - synced >= SYNC_AHEAD_BYTES:  # to the disk while the rest is written
                            ckdir.start_sync(rel, synced, sink.tell() - synced)
                            synced = sink.tell()
                size = sink.tell()
        except BaseException:
            for fut in sums:
                fut.cancel()
            raise
        written = [
            WrittenChunk(
                key=c.key,
                box=c.box,
                file=rel,
                byte_offset=offset,
                byte_length=len(raw),
                checksums=fut.result()[0],
                fingerprint=fut.result()[1],
            )
            for c, raw, offset, fut in zip(chunks, raws, offsets, sums)
        ]
    ckdir.sync_file(rel)
    return written, size


class ShardReader:
    """Ranged, verified reads from the shard files of one checkpoint (one rank's reader).

    Two ways to read: ``read`` returns a buffer (a zero-copy slice of a memory map
    for local files, a ranged read elsewhere); ``read_direct`` (local files only)
    reads with one ``preadv`` straight into caller memory, e.g. the target tensor,
    so no page faults and no intermediate copy. ``fetch`` (any filesystem) is a
    ranged read that may run on several threads at once: the remote path's GETs.
    """

    def __init__(self, ckdir: ShardFiles, blocks: Blocks, file_sizes: dict[str, int]) -> None:
        self.ckdir = ckdir
        self.block_size = blocks.size
        self.checksum = blocks.checksum
        self._sizes = file_sizes
        self._open: dict[str, Any] = {}
        #: File -> the descriptor ``read_direct`` reads it through (None: a file read through ``read``).
        self._fds: dict[str, int | None] = {}
        #: File -> its size on storage (None: missing), stat'ed once per reader by ``check_ranges``.
        self._stored: dict[str, int | None] = {}
        self._lock = threading.Lock()
        #: Bytes of the ranges ``read`` and ``read_direct`` returned.
        self.bytes_read = 0
        #: Bytes transferred from storage by every call (``fetch``'s gap bytes included).
        self.bytes_fetched = 0
        #: Read requests made to storage (one per call: a GET on object storage).
        self.requests = 0

    def reads_direct(self, rel: str) -> bool:
        """``read_direct`` can read ``rel``: a local file, or a memory-tier file held on this node."""
        if not hasattr(os, "preadv"):
            return False
        return self.ckdir.is_local or self._held(rel) is not None

    def _held(self, rel: str) -> int | None:
        """The descriptor of memory-tier file ``rel`` held on this node, opened once (None: not held here)."""
        with self._lock:
            if rel in self._fds:
                return self._fds[rel]
        fd = self.ckdir.held_descriptor(rel)
        with self._lock:
            if rel in self._fds:  # another thread opened it meanwhile
                if fd is not None:
                    os.close(fd)
                return self._fds[rel]
            self._fds[rel] = fd
        if fd is not None:
            self._check_size(rel, os.fstat(fd).st_size)
        return fd

    def _missing(self, rel: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"shard file {rel!r} is missing from {self.ckdir.location}; the checkpoint is incomplete"
        )

    def _check_size(self, rel: str, actual: int) -> None:
        if actual != self._sizes.get(rel, actual):
            raise CorruptCheckpointError(
                f"shard file {rel!r} in {self.ckdir.location} has {actual} bytes but the manifest "
                f"recorded {self._sizes[rel]}: truncated or replaced"
            )

    def _truncated(self, rel: str, offset: int, length: int, size: int) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"shard file {rel!r}: bytes [{offset}, {offset + length}) are past its end ({size} bytes): truncated"
        )

    def check_ranges(self, ranges: Iterable[tuple[str, int, int]]) -> None:
        """Before reading anything: each file of ``(file, offset, length)`` ranges exists on
        storage with its recorded size (one stat per file) and holds its ranges.

        So a load fails before it writes a byte into its targets, and a tool
        before it allocates, when the files do not match the manifest.
        """
        last: dict[str, tuple[int, int]] = {}  # file -> (end, offset) of its range that ends last
        for rel, offset, length in ranges:
            last[rel] = max(last.get(rel, (0, 0)), (offset + length, offset))
        for rel, (end, offset) in last.items():
            if rel not in self._stored:
                # On object storage opening the file is its one HEAD request (its size
                # comes with it), and the file stays open for the reads that follow.
                if self.ckdir.is_local:
                    self._stored[rel] = self.ckdir.size(rel)
                elif (fd := self._held(rel)) is not None:  # held in this node's memory: read with preadv
                    self._stored[rel] = os.fstat(fd).st_size
                else:
                    self._stored[rel] = self._input(rel).size()
            actual = self._stored[rel]
            if actual is None:
                raise self._missing(rel)
            self._check_size(rel, actual)
            if end > actual:
                raise self._truncated(rel, offset, end - offset, actual)

    def _input(self, rel: str) -> Any:
        with self._lock:
            f = self._open.get(rel)
            if f is None:
                try:
                    f = self.ckdir.open_input(rel)
                except FileNotFoundError:
                    raise self._missing(rel) from None
                self._check_size(rel, f.size())
                self._open[rel] = f
            return f

    def _count(self, read: int, fetched: int) -> None:
        with self._lock:
            self.bytes_read += read
            self.bytes_fetched += fetched
            self.requests += 1

    def read(self, rel: str, offset: int, length: int) -> pa.Buffer:
        f = self._input(rel)
        f.seek(offset)
        buf = f.read_buffer(length)  # zero-copy slice of the mapping for local files
        if buf.size != length:
            raise self._truncated(rel, offset, length, f.size())
        self._count(length, length)
        return buf

    def fetch(self, rel: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` with one positional read (thread-safe: no shared file position).

        Counts the bytes as fetched, not read: the caller (``read_into``) knows
        which of them its ranges needed.
        """
        f = self._input(rel)
        buf = f.read_at(length, offset)  # bytes: pyarrow has no positional read_buffer
        if len(buf) != length:
            raise self._truncated(rel, offset, length, f.size())
        self._count(0, length)
        return buf

    def read_direct(self, rel: str, offset: int, views: list[memoryview]) -> None:
        """Fill ``views`` (in order) from the file's bytes starting at ``offset``."""
        fd = self._fds.get(rel) if self.ckdir.is_local else self._held(rel)
        if fd is None:
            self.ckdir.refuse_link(rel)
            try:
                fd = os.open(self.ckdir.path(rel), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            except FileNotFoundError:
                raise self._missing(rel) from None
            self._fds[rel] = fd
            self._check_size(rel, os.fstat(fd).st_size)
        length = sum(len(v) for v in views)
        done = 0
        while done < length:
            # preadv may return short; continue from where it stopped.
            rest, skip = [], done
            for v in views:
                if skip >= len(v):
                    skip -= len(v)
                    continue
                rest.append(v[skip:])
                skip = 0
            n = os.preadv(fd, rest, offset + done)
            if n == 0:
                raise self._truncated(rel, offset, length, os.fstat(fd).st_size)
            done += n
        self._count(length, length)

    def verify(self, segments: list[tuple[int, memoryview]], key: str, chunk: Any, lo: int, hi: int) -> None:
        """Check the blocks of ``chunk`` that overlap chunk bytes [lo, hi).

        ``segments`` are (file offset, bytes) pieces that together hold every byte
        of those blocks, in file order.
        """
        bs = self.block_size
        for b in range(lo // bs, -(-hi // bs)):
            start = chunk.byte_offset + b * bs
            end = min(start + bs, chunk.byte_offset + chunk.byte_length)
            parts = []
            for seg_start, view in segments:
                a, e = max(start, seg_start), min(end, seg_start + len(view))
                if a < e:
                    parts.append(view[a - seg_start : e - seg_start])
            got = checksum_of(parts, self.checksum)
            if got != chunk.checksums[b]:
                raise CorruptCheckpointError(
                    f"checksum mismatch in shard file {chunk.file!r}, key {key!r}, bytes "
                    f"[{start}, {end}) (block {b} of the chunk at offsets {list(chunk.box.offsets)}): "
                    f"stored {self.checksum} {chunk.checksums[b]:#x}, read {got:#x}; the file is corrupt"
                )

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._fds.clear()
