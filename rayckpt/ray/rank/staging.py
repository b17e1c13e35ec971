"""The rank's side of staging: one reusable file in the node's shared memory per process and lane.

``save_async`` copies a rank's share once into shared memory and lets training go
on. A fresh ``ray.put`` lands in object-store pages the kernel must first map and
zero, so each rank keeps one staging file in ``/dev/shm`` (tmpfs, the memory the
object store itself uses; ``RAYCKPT_SHM_DIR`` names another directory, see
``shm``), sized to its share and reused from save to save: the copy lands in memory
already mapped. The node's ShardWriter maps the same file and writes from it
(``writer.regions``).

Lifetime: the file is unlinked the moment it is created, so it has no name to
leak: it lives as long as the rank's descriptor of it (and a writer's mapping),
and the kernel frees it when the rank's process exits, however it exits (a
normal exit, ``ray.kill`` at the end of a TorchTrainer run, ``ray.shutdown``,
SIGKILL, the OOM killer). ``release_staging`` frees it earlier. The writer opens
it through ``/proc/<rank pid>/fd/<fd>`` and checks its inode. A buffer still
read by a writer is never overwritten: a save that finds it busy moves to a new
file and lets the old one go once the writer unmaps it. Named files (left by an
older rayckpt, or by a process killed between creating and unlinking one) of
processes that are gone are removed by the node's ShardWriter, when it starts
and then periodically (``writer.regions.StaleSweeper``). Space is reserved with
``posix_fallocate``, so a full tmpfs is an error at staging time (and the save
falls back to ``ray.put``), never a ``SIGBUS`` halfway through a copy; and never from
the room of Ray's object store on the same tmpfs (``shm.shm_room``), whose pages are
taken only as objects are made: that ``ray.put`` finds them.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...engine.device import DeviceToHost, needs_bounce, pin_host_memory, unpin_host_memory
from ...engine.state import FlatState, as_bytes, flat_of
from ..shm import POPULATED, PREFIX, SHM_DIR, SHM_DIR_ENV, StagedRegion, shm_room, staging_dir

#: Where ``save_async`` stages: "auto" (the reusable buffer, else the object store), "shm", "object_store".
STAGING_ENV = "RAYCKPT_STAGING"
STAGING_MODES = ("auto", "shm", "object_store")


def staging_mode(staging: str | None) -> str:
    """``staging``, else ``RAYCKPT_STAGING``, else "auto"; checked."""
    mode = staging or os.environ.get(STAGING_ENV) or "auto"
    if mode not in STAGING_MODES:
        raise ValueError(f"staging={mode!r}: expected one of {', '.join(STAGING_MODES)}")
    return mode


_ALIGN = 64
#: ``copy_now`` spreads a share's contiguous CPU bytes over the rank's cores in slices of at most this many bytes.
SLICE_BYTES = 16 << 20
_GRANULE = 1 << 20


class StagingUnavailable(RuntimeError):
    """The shared-memory directory cannot hold this save (missing, full, not writable)."""


def layout(sizes: Sequence[int]) -> tuple[tuple[tuple[int, int], ...], int]:
    """Offsets for chunks of ``sizes`` bytes, each aligned to 64 bytes; and the total length."""
    spans, end = [], 0
    for n in sizes:
        spans.append((end, n))
        end += -(-n // _ALIGN) * _ALIGN
    return tuple(spans), end


class StagingBuffer:
    """One rank's staging file in shared memory (unlinked: nameless), grown as needed and reused."""

    def __init__(self, directory: str | None = None) -> None:
        #: Where the file is created: ``directory``, else ``staging_dir()`` (``RAYCKPT_SHM_DIR``, ``/dev/shm``).
        self.directory = directory or staging_dir()
        #: The file's descriptor in this process; the file has no other hold on it but a writer's mapping.
        self.fd: int | None = None
        #: The name it was created under (gone since): what ``/proc/<pid>/fd/<fd>`` points at.
        self.name: str | None = None
        self.inode = 0
        self.capacity = 0
        self._map: mmap.mmap | None = None
        self._pid = 0
        #: The write that still reads this file (a Ray ObjectRef), if any.
        self.busy: object | None = None
        #: The mapping's address if it is page-locked for CUDA copies (0: not pinned).
        self._pinned = 0
        #: CUDA refused to page-lock this buffer's mapping: not tried again (each try costs a failed call).
        self.pin_refused = False
        #: ``copy_now``'s threads, made on its first spread copy and kept while the buffer is.
        self._pool: ThreadPoolExecutor | None = None
        self._pool_threads = 0
        #: A ``prepare`` running in the background, what it made (or its error), and the size it makes.
        self._preparing: threading.Thread | None = None
        self._made: _Mapping | tuple[None, int] | BaseException | None = None
        self._planned = 0

    @property
    def path(self) -> str | None:
        """Where a process on this node opens the buffer (``None``: no buffer)."""
        return None if self.fd is None else f"/proc/{self._pid}/fd/{self.fd}"

    def _open(self, size: int) -> None:
        self._install(self._create(size))

    def _create(self, size: int) -> _Mapping:
        """A new nameless file of at least ``size`` bytes, its pages reserved and mapped (not yet this buffer's)."""
        capacity = granules(size)
        name = os.path.join(self.directory, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise StagingUnavailable(
                f"cannot create a staging file in {self.directory} (the staging directory: {SHM_DIR_ENV}, "
                f"default {SHM_DIR}; it must exist and be writable): {exc}"
            ) from None
        os.unlink(name)  # from here on nothing can leak: the kernel frees it with the last descriptor and mapping
        try:
            if (room := shm_room(self.directory)) < capacity:  # the pages Ray's object store may yet take
                raise OSError(errno.ENOSPC, f"{room} bytes free there beside Ray's object store")
            os.posix_fallocate(fd, 0, capacity)  # reserve the pages now: ENOSPC here, not SIGBUS later
            mapped = mmap.mmap(fd, capacity, flags=POPULATED)
        except OSError as exc:
            os.close(fd)
            raise StagingUnavailable(
                f"cannot reserve {capacity} bytes of shared memory in {self.directory} "
                f"(the staging directory: {SHM_DIR_ENV}, default {SHM_DIR}): {exc}"
            ) from None
        return _Mapping(fd=fd, name=name, inode=os.fstat(fd).st_ino, mapped=mapped, capacity=capacity)

    def _install(self, made: _Mapping, pinned: int = 0) -> None:
        # The old file is closed only now, so the new descriptor's number differs from the old one's (a writer
        # of the old file may not have opened it yet; the inode check catches later reuse).
        self.close()
        self.fd, self.name, self.inode, self._pid = made.fd, made.name, made.inode, os.getpid()
        self._map, self.capacity, self.busy, self._pinned = made.mapped, made.capacity, None, pinned

    def reserve(self, nbytes: int) -> None:
        """Make the buffer hold at least ``nbytes`` now, so the next save's copy finds it mapped."""
        self.ready()
        if self._map is None or nbytes > self.capacity:
            self._open(nbytes)

    def prepare(self, nbytes: int, pin: torch.device | None = None) -> int:
        """``reserve`` on a background thread, and page-lock the mapping for CUDA copies from device ``pin``.

        Returns at once with the capacity the buffer will have. The next ``stage``
        (or ``ready``) waits for what is left of it and raises its
        ``StagingUnavailable``. Creating and pinning a multi-GiB mapping takes
        seconds: done here, between saves, it is not in any save's stall.
        """
        self.ready()
        grow = self._map is None or nbytes > self.capacity
        if not grow and (pin is None or self._pinned or self.pin_refused):
            return self.capacity
        if grow and not (os.path.isdir(self.directory) and os.access(self.directory, os.W_OK)):
            raise StagingUnavailable(  # said now, not from the first save
                f"cannot create a staging file in {self.directory} (the staging directory: {SHM_DIR_ENV}, "
                f"default {SHM_DIR}; it must exist and be writable): not a writable directory"
            )
        self._planned = granules(nbytes) if grow else self.capacity
        current = None if grow else self._map

        def build() -> None:
            made = None
            try:
                made = self._create(nbytes) if grow else None
                pin_it = pin is not None and not self.pin_refused
                ptr = pin_host_memory((made.mapped if made else current), pin) if pin_it else 0
                self.pin_refused |= pin_it and not ptr
                self._made = (made, ptr) if made else (None, ptr)
            except BaseException as exc:  # handed to the caller of ready(); nothing is half-installed
                if made is not None:
                    made.close()
                self._made = exc

        self._preparing = threading.Thread(target=build, name="rayckpt-staging-prepare", daemon=True)
        self._preparing.start()
        return self._planned

    @property
    def preparing(self) -> bool:
        """A ``prepare`` is still running in the background."""
        return self._preparing is not None and self._preparing.is_alive()

    def holds(self, nbytes: int) -> bool:
        """The buffer holds ``nbytes`` now, or will once the ``prepare`` in progress is done."""
        return (self._planned if self._preparing is not None else self.capacity) >= nbytes

    def ready(self) -> None:
        """Wait for a ``prepare`` in progress and take what it made; raise its error, if it failed."""
        if self._preparing is None:
            return
        self._preparing.join()
        made, self._preparing, self._made, self._planned = self._made, None, None, 0
        if isinstance(made, BaseException):
            raise made
        assert made is not None
        mapping, ptr = made
        if mapping is not None:
            self._install(mapping, ptr)
        elif ptr:
            self._pinned = ptr

    def stage(self, pieces: Sequence[torch.Tensor], node_id: str, in_use: bool = False) -> StagedRegion:
        """Copy ``pieces`` (any device, any strides) into the buffer, one copy each; the region once all are in.

        ``place`` then ``copy_piece`` for each piece, waiting for the device copies before it returns.
        """
        region = self.place(pieces, node_id, in_use=in_use)
        to_host = DeviceToHost()
        for piece, span in zip(pieces, region.spans):
            self.copy_piece(piece, span, to_host)
        to_host.wait()
        return region

    def place(self, pieces: Sequence[torch.Tensor], node_id: str, in_use: bool = False) -> StagedRegion:
        """Where ``pieces`` go in the buffer (grown, or a new file, as needed); nothing is copied yet.

        ``in_use``: a writer may still read the current file, so place them in a new one.
        """
        spans, total = layout([p.numel() * p.element_size() for p in pieces])
        self.ready()
        if in_use or self._map is None or total > self.capacity:
            self._open(total)
        assert self.path is not None
        return StagedRegion(self.path, node_id, spans, self.inode)

    def copy_piece(self, piece: torch.Tensor, span: tuple[int, int], to_host: DeviceToHost) -> None:
        """Copy ``piece`` into ``span`` (offset, length) of the buffer (a ``place``'s region).

        A CPU piece is copied before this returns. A device (CUDA) piece is queued on
        ``to_host``'s side stream straight into the mapping (page-locked the first
        time, kept so while the file is reused): it is in once ``to_host.wait()`` returns.
        """
        offset, n = span
        if n == 0:
            return
        assert self._map is not None
        src = piece.detach()
        if not needs_bounce(src) and src.is_contiguous():
            # one single-threaded memcpy: torch's copy_ fans out to its intra-op threads,
            # which compete with the other ranks sharing the node's cores
            np.copyto(np.frombuffer(self._map, np.uint8, n, offset), as_bytes(src))
        elif needs_bounce(src):  # device to host directly, on a side stream
            if not (self._pinned or self.pin_refused):
                self._pinned = pin_host_memory(self._map, src.device)
                self.pin_refused = not self._pinned
            dst = torch.frombuffer(self._map, dtype=torch.uint8, count=n, offset=offset)
            to_host.copy(dst.view(src.dtype).view(src.shape), src)
        else:  # strided: torch copies it
            dst = torch.frombuffer(self._map, dtype=torch.uint8, count=n, offset=offset)
            dst.view(src.dtype).view(src.shape).copy_(src)

    def view(self, span: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
        """The bytes at ``span`` (a ``place``'s region) as a CPU tensor of ``like``'s dtype and shape (no copy)."""
        offset, n = span
        if n == 0:
            return torch.empty(like.shape, dtype=like.dtype)
        assert self._map is not None
        return torch.frombuffer(self._map, dtype=torch.uint8, count=n, offset=offset).view(like.dtype).view(like.shape)

    def copy_now(
        self,
        jobs: Sequence[tuple[torch.Tensor, tuple[int, int]]],
        to_host: DeviceToHost,
        threads: int = 1,
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """``copy_piece`` for each (piece, span); with ``threads`` > 1 (the cores this rank may use,
        ``engine.writer.parts_here``) and a share of at least twice ``SLICE_BYTES`` in contiguous CPU
        pieces, their bytes are cut into slices of at most ``SLICE_BYTES`` (one memcpy each) spread over
        that many threads: a share of many small pieces is spread as well as one of a few large ones.

        ``meanwhile``: called once on the caller's thread while those threads copy (after the copy
        where nothing is spread); the call returns when both are done, raising what either raised.
        """
        slices, rest = [], []
        for piece, (offset, n) in jobs:
            src = piece.detach()
            if threads > 1 and n and not needs_bounce(src) and src.is_contiguous():
                assert self._map is not None
                dst, data = np.frombuffer(self._map, np.uint8, n, offset), as_bytes(src)
                slices += [(dst[i : i + SLICE_BYTES], data[i : i + SLICE_BYTES]) for i in range(0, n, SLICE_BYTES)]
            else:
                rest.append((piece, (offset, n)))
        if sum(len(dst) for dst, _ in slices) < 2 * SLICE_BYTES:
            for piece, span in jobs:
                self.copy_piece(piece, span, to_host)
            if meanwhile is not None:
                meanwhile()
            return
        if self._pool is None or self._pool_threads != threads:
            self._close_pool()
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="rayckpt-stage")
            self._pool_threads = threads
        copying = [self._pool.submit(np.copyto, *s) for s in slices]
        try:
            for piece, span in rest:
                self.copy_piece(piece, span, to_host)
            if meanwhile is not None:
                meanwhile()
        finally:
            for done in copying:  # every slice copied (or failed) before the buffer is touched again
                done.result()

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def close(self) -> None:
        """Unmap and close the file; a writer that still maps it keeps reading until it unmaps.

        A ``prepare`` in progress is waited for and what it made is closed too.
        """
        self._close_pool()
        if self._preparing is not None:
            self._preparing.join()
            made, self._preparing, self._made, self._planned = self._made, None, None, 0
            if isinstance(made, tuple) and made[0] is not None:
                unpin_host_memory(made[1])
                made[0].close()
        if self._map is not None:
            unpin_host_memory(self._pinned)
            self._pinned = 0
            try:
                self._map.close()
            except BufferError:  # views still exported: the mapping goes when they do
                pass
            self._map = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd, self.name, self.inode, self.capacity = None, None, 0, 0


@dataclass(slots=True, kw_only=True)
class _Mapping:
    """A staging file made by ``StagingBuffer._create``, not yet the buffer's."""

    fd: int
    name: str
    inode: int
    mapped: mmap.mmap
    capacity: int

    def close(self) -> None:
        self.mapped.close()
        os.close(self.fd)


def granules(nbytes: int) -> int:
    """The size of a staging file that holds ``nbytes``: whole MiB, at least one."""
    return -(-max(nbytes, 1) // _GRANULE) * _GRANULE


def staged_size(pieces: Sequence[torch.Tensor]) -> int:
    """Bytes ``pieces`` take in a staging buffer (with their alignment)."""
    return layout([p.numel() * p.element_size() for p in pieces])[1]


def local_pieces(state_dict: dict[str, Any] | FlatState) -> list[Any]:
    """Every local tensor of ``state_dict`` (flattened unless it is): what this rank's staging buffer is
    sized to (a share never exceeds it)."""
    return [p.local for leaf in flat_of(state_dict).tensors.values() for p in leaf.pieces]


def of_device(pieces: list[Any]) -> Any:
    """The CUDA device of the first device piece (the staging buffer is page-locked for it), or ``None``."""
    return next((p.device for p in pieces if needs_bounce(p)), None)
