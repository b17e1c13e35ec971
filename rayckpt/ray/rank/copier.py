"""The rank's copy of its share into the staging buffer: before the save call returns, or beside the next step.

``launch`` places the share in the staging buffer and copies what must be
copied now; with overlap, the tensors a guarded optimizer owns
(``engine.overlap``) are copied on a background thread (CUDA pieces: queued
now on a side stream, waited for there) while the next forward and backward
run. Once every piece is copied and its version counter checked, the thread
hands the share to the node's ShardWriter (``send``): the writer never reads a
piece before its copy is done. A tensor changed in place during the save fails
it (``fail``, then nothing is sent): no writer, no commit.

A ``CopyJob`` is the copy's state: ``SaveHandle`` waits on it, and the step
pre-hook of a guarded optimizer waits for every job in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...engine.device import DeviceToHost
from ...engine.overlap import Versions, guarded_storages, storage_of, track, untrack
from ...engine.save import SaveContext
from ...engine.writer import chunk_pieces, parts_here
from ..shm import StagedRegion
from .staging import StagingBuffer


@dataclass(frozen=True, slots=True, kw_only=True)
class Copying:
    """How a save's copy goes on: its ``overlap``, where the copied share goes and where a failure is told."""

    overlap: bool | str
    #: Hands the copied share (a ``StagedRegion`` or an object-store ref) to the ShardWriter; its ``write`` ref.
    send: Callable[[Any], Any]
    #: Tells the MetadataActor this rank's part failed (a copy that failed after the call returned).
    fail: Callable[[str], None]
    #: ``time.perf_counter()`` when the save call began.
    started: float
    #: What the save call does on its own thread while the copy runs (the registration, the writer's
    #: lookup): called once, before the share is sent.
    meanwhile: Callable[[], None] | None = None


class TornCopy(RuntimeError):
    """A tensor changed in place while the save copied it."""


class CopyJob:
    """A rank's copy of its share for one save: done at once, or running beside training."""

    def __init__(self, late_bytes: int = 0) -> None:
        #: Bytes copied after the save call returned (0: the whole share before it returned).
        self.late_bytes = late_bytes
        #: The ShardWriter's ``write`` of the share, once sent (``None``: not sent, or the copy failed).
        self.write_ref: Any = None
        #: Why the copy failed (the save then fails and nothing is written); ``None`` if it did not.
        self.error: str | None = None
        #: Seconds from the save call's start to the end of the copy (``None`` until done).
        self.seconds: float | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def finished(cls, write_ref: Any, seconds: float) -> CopyJob:
        """A copy done before the call returned, its share already sent to the writer."""
        job = cls()
        job.write_ref, job.seconds = write_ref, seconds
        job._done.set()
        return job

    def copied(self) -> bool:
        """Whether the copy is over (done and sent, or failed)."""
        return self._done.is_set()

    def wait_copied(self, timeout: float | None = None) -> bool:
        """Wait until the copy is over; False if ``timeout`` ran out first."""
        return self._done.wait(timeout)

    def join(self) -> None:
        """Wait for the copy's thread to end (before the buffer it writes into is closed)."""
        if self._thread is not None:
            self._thread.join()


def late_pieces(pieces: Sequence[torch.Tensor], overlap: bool | str) -> set[int]:
    """Which of ``pieces`` are copied after the save call returns (``engine.overlap.OVERLAP_MODES``)."""
    if overlap is False:
        return set()
    if overlap == "all":
        return {i for i, p in enumerate(pieces) if p.numel()}
    guarded = guarded_storages()
    return {i for i, p in enumerate(pieces) if p.numel() and storage_of(p) in guarded} if guarded else set()


def versions_of(ctx: SaveContext, pieces: Sequence[torch.Tensor]) -> Versions:
    """The version counters of ``pieces`` (in plan order) and of the tensors the state holds them in."""
    keys = [item.key for item in ctx.plan.items]
    sources = []
    for key, piece in zip(keys, pieces):
        source = ctx.flat.tensors[key].source
        sources.append((piece,) if source is None or source is piece else (source, piece))
    return Versions(keys, sources)


def launch(
    buffer: StagingBuffer,
    ctx: SaveContext,
    node_id: str,
    *,
    in_use: bool,
    copying: Copying,
) -> tuple[StagedRegion, CopyJob]:
    """Copy this rank's share into ``buffer``: now, or partly on a background thread (see the module).

    Raises (before returning) what the copy now raises: ``StagingUnavailable``, or
    ``TornCopy`` when a tensor copied now changed during it; the background copy
    reports its failure through ``copying.fail`` instead.
    """
    overlap, send, fail, started = copying.overlap, copying.send, copying.fail, copying.started
    pieces = chunk_pieces(ctx.plan, ctx.flat)
    versions = versions_of(ctx, pieces)
    late = late_pieces(pieces, overlap)
    region = buffer.place(pieces, node_id, in_use=in_use)
    now = DeviceToHost()
    threads = parts_here(ctx.spec.world_size, len(ctx.nodes))  # the cores this rank may use
    now_jobs = [(p, region.spans[i]) for i, p in enumerate(pieces) if i not in late]
    buffer.copy_now(now_jobs, now, threads, copying.meanwhile)
    now.wait()
    _check(versions, (i for i in range(len(pieces)) if i not in late))
    if not late:
        return region, CopyJob.finished(send(region), time.perf_counter() - started)
    job = CopyJob(sum(region.spans[i][1] for i in late))
    later = DeviceToHost()
    on_host = [i for i in sorted(late) if pieces[i].device.type == "cpu"]
    for i in sorted(late):  # device pieces: queued now on the side stream, waited for on the thread
        if pieces[i].device.type != "cpu":
            buffer.copy_piece(pieces[i], region.spans[i], later)

    def copy_rest() -> None:
        try:
            for i in on_host:
                buffer.copy_piece(pieces[i], region.spans[i], later)
            later.wait()
            _check(versions, sorted(late))
            job.write_ref = send(region)
        except BaseException as exc:  # noqa: BLE001 - the save fails; the training thread learns it from wait()
            job.error = str(exc) if isinstance(exc, TornCopy) else f"staging: {type(exc).__name__}: {exc}"
            fail(job.error)
        finally:
            job.seconds = time.perf_counter() - started
            job._done.set()
            untrack(job)

    track(job)
    job._thread = threading.Thread(target=copy_rest, name="rayckpt-save-copy", daemon=True)
    job._thread.start()
    return region, job


def _check(versions: Versions, indices: Any) -> None:
    for i in indices:
        why = versions.changed(i)
        if why is not None:
            raise TornCopy(why)
