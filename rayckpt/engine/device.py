"""Copies between host memory and tensors that live on a device (CUDA), for saves and loads.

Reads and writes happen in host memory: a CUDA tensor cannot be the target of
``preadv`` nor be viewed by numpy. So a load into a device target reads and
verifies the bytes on the host, then copies them through a small pinned bounce
buffer (``HostToDevice``: a few reused slots, bounded) to the device with
``non_blocking=True`` on a side stream; a save copies device pieces into host
memory (``DeviceToHost``) on a side stream and waits on one recorded event
before the bytes are hashed or written. CPU tensors take none of this: their
copies are a plain ``copy_``.

The CUDA calls are only made for CUDA tensors, so the host-side logic (which
pieces go through which slot, the bounds) runs on the CPU too when a test
forces it (``force=True``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: Bytes of one bounce slot; a load into device targets holds at most ``BOUNCE_SLOTS`` of them.
BOUNCE_BYTES = 64 * 2**20
BOUNCE_SLOTS = 2


def needs_bounce(t: torch.Tensor) -> bool:
    """True if ``t``'s memory is not host memory, so reads and writes go through a host buffer."""
    return t.device.type != "cpu"


def bounded_pieces(dst: torch.Tensor, src: torch.Tensor, max_bytes: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Split a copy ``src -> dst`` (same shape, any strides) into pieces of at most ``max_bytes``.

    Pieces are runs of whole rows along the first dimension; a row larger than
    ``max_bytes`` is split along the next dimension, down to single elements.
    """
    nbytes = src.numel() * src.element_size()
    if nbytes <= max_bytes or src.dim() == 0:
        yield dst, src
        return
    row = nbytes // src.shape[0]
    if row <= max_bytes:
        step = max_bytes // row
        for start in range(0, src.shape[0], step):
            yield dst[start : start + step], src[start : start + step]
    else:
        for i in range(src.shape[0]):
            yield from bounded_pieces(dst[i], src[i], max_bytes)


def _pinned(nbytes: int, device: torch.device) -> torch.Tensor:
    """Host memory for copies with ``device``: pinned (page-locked) for a CUDA device."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


class HostToDevice:
    """One load's copies of verified host bytes into its targets (called by the rank, on any reader thread).

    A target not in host memory gets its bytes through ``slots`` pinned slots of
    at most ``slot_bytes`` each, used in turn: the host copy into a slot waits
    for that slot's previous device copy (its event), so the next piece's host
    copy overlaps the current piece's transfer. ``finish`` waits for every
    transfer and frees the slots; ``read_into`` calls it before it returns.
    """

    def __init__(self, slot_bytes: int | None = None, slots: int = BOUNCE_SLOTS, force: bool = False) -> None:
        self.slot_bytes = slot_bytes or BOUNCE_BYTES
        #: Send CPU targets through the slots too (tests of the host-side logic).
        self.force = force
        self._slots: list[torch.Tensor | None] = [None] * slots
        self._events: list[Any] = [None] * slots
        self._next = 0
        self._stream: Any = None
        self._lock = threading.Lock()
        #: Pieces copied through a slot, and the largest slot allocated (bytes).
        self.pieces = 0
        self.peak_slot_bytes = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the host tensor ``src`` into ``dst`` (a target's region, same shape)."""
        if not (self.force or needs_bounce(dst)):
            dst.copy_(src)
            return
        with self._lock, torch.no_grad():
            for d, s in bounded_pieces(dst, src, self.slot_bytes):
                self._copy_piece(d, s)

    def _copy_piece(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        i, self._next = self._next, (self._next + 1) % len(self._slots)
        if self._events[i] is not None:
            self._events[i].synchronize()  # the slot's previous transfer is done
            self._events[i] = None
        nbytes = src.numel() * src.element_size()
        slot = self._slots[i]
        if slot is None or slot.numel() < nbytes:
            slot = self._slots[i] = _pinned(max(nbytes, 1), dst.device)
            self.peak_slot_bytes = max(self.peak_slot_bytes, slot.numel())
        host = slot[:nbytes].view(src.dtype).view(src.shape)
        host.copy_(src)
        self.pieces += 1
        if dst.device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(dst.device)
                # the targets' own pending work (allocation, zeroing) comes first
                self._stream.wait_stream(torch.cuda.current_stream(dst.device))
            with torch.cuda.stream(self._stream):
                dst.copy_(host, non_blocking=True)
                self._events[i] = self._stream.record_event()
        else:
            dst.copy_(host)

    def finish(self) -> None:
        """Wait for every transfer (the targets hold their bytes on return) and free the slots."""
        if self._stream is not None:
            self._stream.synchronize()
        self._slots = [None] * len(self._slots)
        self._events = [None] * len(self._events)


class DeviceToHost:
    """One save's copies of device pieces into host memory (called by the rank that saves).

    Each ``copy`` runs on a side stream that first waits for the work already
    queued on the piece's current stream (the training step that wrote it);
    ``wait`` blocks on one event recorded after the last copy, so the host
    bytes are complete before anything hashes or writes them. The training
    stream itself is never synchronized.
    """

    def __init__(self, force: bool = False) -> None:
        #: Treat CPU sources as device ones (tests of the host-side logic).
        self.force = force
        self._stream: Any = None
        self.copies = 0
        #: Strided sources made contiguous on the device before their copy to the host.
        self.gathers = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (any strides) into the contiguous host tensor ``dst`` (same shape); done once ``wait`` returns.

        A strided device source is first made contiguous on the device (on the side
        stream, a temporary of the piece's size): CUDA refuses a strided
        device-to-host copy into page-locked memory registered with
        ``cudaHostRegister`` (``cudaErrorInvalidValue``), the staging buffer's case.
        """
        if not (self.force or needs_bounce(src)):
            dst.copy_(src)
            return
        self.copies += 1
        with self._side_stream(src.device), torch.no_grad():
            dense = src
            if not src.is_contiguous():
                dense = src.contiguous()  # allocated on the side stream: freed only after the copy below
                self.gathers += 1
            dst.copy_(dense, non_blocking=True)
            if src.device.type == "cuda":
                src.record_stream(self._stream)  # the allocator keeps src's memory until the copy is done

    def _side_stream(self, device: torch.device) -> Any:
        if device.type != "cuda":
            return nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        return torch.cuda.stream(self._stream)

    def wait(self) -> None:
        """Block until every copy so far is in host memory."""
        if self._stream is not None:
            self._stream.record_event().synchronize()


def host_like(t: torch.Tensor) -> torch.Tensor:
    """A host tensor for ``t``'s bytes (same shape, contiguous): pinned if ``t`` is on a CUDA device."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")


def pin_host_memory(buf: Any, device: torch.device | None = None) -> int:
    """Page-lock the host buffer ``buf`` (an mmap) for CUDA copies; its address, or 0 if it cannot be.

    Pinned memory lets a device-to-host ``copy_`` run asynchronously with
    ``non_blocking=True``; without it the copy is still correct, only staged
    through the driver's own buffer. ``device``: the CUDA device the copies come
    from, made current first (a background thread's current device is device 0).
    Undo with ``unpin_host_memory`` before unmapping. Where CUDA refuses (Linux
    page-locks no file mapping outside tmpfs), one WARNING says so and this
    thread's CUDA error is cleared, so no later kernel launch fails with it.
    """
    if not torch.cuda.is_available():
        return 0
    view = torch.frombuffer(buf, dtype=torch.uint8)
    ptr, nbytes = view.data_ptr(), view.numel()
    del view
    cuda = device is not None and device.type == "cuda"
    with torch.cuda.device(device) if cuda else nullcontext():
        rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)  # a cudaError (its name: cudaGetErrorString)
        if int(rc) == 0:
            return ptr
        clear_cuda_error(device if cuda else torch.device("cuda"))
    logger.warning(
        "rayckpt: %d bytes of host memory could not be page-locked for CUDA copies (cudaHostRegister: %s); "
        "copies from the device into it wait for the driver. Linux page-locks file mappings only on tmpfs: "
        "keep the staging directory (RAYCKPT_SHM_DIR) on /dev/shm.",
        nbytes, torch.cuda.cudart().cudaGetErrorString(rc),
    )  # fmt: skip
    return 0


def clear_cuda_error(device: torch.device) -> None:
    """Clear this thread's CUDA "last error" left by a failed runtime call that was handled.

    CUDA keeps a failed call's error until it is read, and PyTorch reads it after
    every kernel launch: the next launch on this thread would fail with it (seen
    on an H200: ``contiguous()`` raising ``invalid argument`` after a refused
    ``cudaHostRegister``). One throwaway launch reads it, and so clears it.
    """
    try:
        torch.zeros(1, device=device)
    except RuntimeError:  # torch.AcceleratorError: the error being cleared
        pass


def unpin_host_memory(ptr: int) -> None:
    """Undo ``pin_host_memory`` (``ptr`` as it returned; 0 does nothing)."""
    if ptr:
        torch.cuda.cudart().cudaHostUnregister(ptr)
