"""Reusable shared-memory staging for async saves.

``save_async`` copies a rank's share once into shared memory and lets training go
on. A fresh ``ray.put`` lands in object-store pages the kernel must map (and zero)
first: on the benchmark machine that made the copy 3-6x slower than a ``memcpy``
into memory already mapped. So each rank keeps one staging file in ``/dev/shm``
(tmpfs, the memory the object store itself uses), sized to its share and reused
from save to save; the node's ShardWriter maps the same file and writes from it.

Lifetime: the buffer lives as long as the rank's process (``release_staging``
frees it earlier); a buffer still read by a writer is never overwritten: a save
that finds it busy moves to a new file and lets the old one go once the writer
unmaps it. Files of processes that died are removed by the node's ShardWriter
(``sweep_stale``). Space is reserved with ``posix_fallocate``, so a full tmpfs
is an error at staging time (and the save falls back to ``ray.put``), never a
``SIGBUS`` halfway through a copy.
"""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ..engine.state import as_bytes

SHM_DIR = "/dev/shm"
PREFIX = "rayckpt-stage-"
_ALIGN = 64
_GRANULE = 1 << 20
#: Shared mappings with their page tables filled in one call: faulting page by page
#: inside ``write()`` made the writer's writes 1.3-1.7x slower (benchmarks/NOTES.md).
_POPULATED = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class StagingUnavailable(RuntimeError):
    """The shared-memory directory cannot hold this save (missing, full, not writable)."""


@dataclass(frozen=True, slots=True)
class StagedRegion:
    """Where a rank's staged chunks are: what a ShardWriter on the same node needs."""

    path: str
    node_id: str
    #: (offset, length) in the file of each chunk, in the save plan's order.
    spans: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.spans)


def layout(sizes: Sequence[int]) -> tuple[tuple[tuple[int, int], ...], int]:
    """Offsets for chunks of ``sizes`` bytes, each aligned to 64 bytes; and the total length."""
    spans, end = [], 0
    for n in sizes:
        spans.append((end, n))
        end += -(-n // _ALIGN) * _ALIGN
    return tuple(spans), end


class StagingBuffer:
    """One rank's staging file in shared memory, grown as needed and reused."""

    def __init__(self, directory: str = SHM_DIR) -> None:
        self.directory = directory
        self.path: str | None = None
        self.capacity = 0
        self._map: mmap.mmap | None = None
        #: The write that still reads this file (a Ray ObjectRef), if any.
        self.busy: object | None = None

    def _open(self, size: int) -> None:
        self.close()
        capacity = -(-max(size, 1) // _GRANULE) * _GRANULE
        path = os.path.join(self.directory, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise StagingUnavailable(f"cannot create a staging file in {self.directory}: {exc}") from None
        try:
            os.posix_fallocate(fd, 0, capacity)  # reserve the pages now: ENOSPC here, not SIGBUS later
            self._map = mmap.mmap(fd, capacity, flags=_POPULATED)
        except OSError as exc:
            os.unlink(path)
            raise StagingUnavailable(
                f"cannot reserve {capacity} bytes of shared memory in {self.directory}: {exc}"
            ) from None
        finally:
            os.close(fd)
        self.path, self.capacity, self.busy = path, capacity, None

    def reserve(self, nbytes: int) -> None:
        """Make the buffer hold at least ``nbytes`` now, so the next save's copy finds it mapped."""
        if self._map is None or nbytes > self.capacity:
            self._open(nbytes)

    def stage(self, pieces: Sequence[torch.Tensor], node_id: str, in_use: bool = False) -> StagedRegion:
        """Copy ``pieces`` (any device, any strides) into the buffer, one copy each.

        ``in_use``: a writer may still read the current file, so stage into a new one.
        """
        spans, total = layout([p.numel() * p.element_size() for p in pieces])
        if in_use or self._map is None or total > self.capacity:
            self._open(total)
        assert self._map is not None and self.path is not None
        for piece, (offset, n) in zip(pieces, spans):
            if n == 0:
                continue
            src = piece.detach()
            if src.device.type == "cpu" and src.is_contiguous():
                # one single-threaded memcpy: torch's copy_ fans out to its intra-op threads,
                # which ranks sharing the node's cores made 2-4x slower (benchmarks/NOTES.md)
                np.copyto(np.frombuffer(self._map, np.uint8, n, offset), as_bytes(src))
            else:  # strided or on a device: torch copies it, device to host directly
                dst = torch.frombuffer(self._map, dtype=torch.uint8, count=n, offset=offset)
                dst.view(src.dtype).view(src.shape).copy_(src)
        return StagedRegion(self.path, node_id, spans)

    def close(self) -> None:
        """Unmap and remove the file; a writer that still maps it keeps reading until it unmaps."""
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # views still exported: the mapping goes when they do
                pass
            self._map = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path, self.capacity = None, 0


def staged_size(pieces: Sequence[torch.Tensor]) -> int:
    """Bytes ``pieces`` take in a staging buffer (with their alignment)."""
    return layout([p.numel() * p.element_size() for p in pieces])[1]


@contextmanager
def open_region(region: StagedRegion) -> Iterator[list[memoryview]]:
    """Read-only views of a staged region's chunks (for the ShardWriter)."""
    try:
        fd = os.open(region.path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"staging file {region.path} is gone: the rank that staged it released it or exited"
        ) from None
    try:
        size = os.fstat(fd).st_size
        end = max((o + n for o, n in region.spans), default=0)
        if end > size:
            raise ValueError(f"staging file {region.path} has {size} bytes, the region needs {end}")
        mapped = mmap.mmap(fd, size, flags=_POPULATED, prot=mmap.PROT_READ) if size else None
    finally:
        os.close(fd)
    if mapped is None:
        yield [memoryview(b"") for _ in region.spans]
        return
    whole = memoryview(mapped)
    views = [whole[o : o + n] for o, n in region.spans]
    try:
        yield views
    finally:
        for v in views:
            v.release()
        whole.release()
        try:
            mapped.close()
        except BufferError:  # a caller kept a view: the mapping goes when it does
            pass


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove staging files whose process is gone; return their names."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid_text = name[len(PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
