"""Copies that run beside training: which tensors wait, the optimizer steps that wait for them, torn copies.

An async save copies a rank's share into host memory. With overlap, part of
that copy runs on a background thread (and, for CUDA tensors, a side stream)
while the next step's forward and backward run, and the save call returns
first. Two rules make that safe without the caller's help:

- Only tensors that an optimizer step changes are copied late, and every
  optimizer step that could change them waits for the copy first:
  ``guard_optimizer`` installs a step pre-hook (``AppState`` does it for its
  optimizer), and ``guarded_storages`` names the storages of the guarded
  optimizers' parameters and state. Forward and backward only read them.
  Everything else (buffers, a user's own tensors, extras) is copied before the
  save call returns, unless the caller opts it in.
- Every tensor's version counter is recorded when the save begins and checked
  once its copy is done (``Versions``). An in-place change made in between (a
  user's update between steps, an EMA written into the model) fails the save,
  naming the key: nothing is committed. A DTensor's in-place ops count on the
  DTensor itself, not on its local shard, so both are checked.

This module holds no Ray: the copy itself is the Ray layer's (``rayckpt.ray.rank.copier``).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch

#: ``overlap`` values: False (every tensor copied before the call returns), True (an optimizer's
#: tensors copied beside the next step, the rest before returning), "all" (every tensor beside it).
OVERLAP_MODES = (False, True, "all")


def overlap_mode(overlap: bool | str) -> bool | str:
    """``overlap`` checked: one of ``OVERLAP_MODES``."""
    if overlap is True or overlap is False or overlap == "all":
        return overlap
    raise ValueError(f"overlap={overlap!r}: expected True, False or 'all'")


class PendingCopy(Protocol):
    """A copy in flight that guarded optimizer steps wait for (``rayckpt.ray.rank.copier.CopyJob``)."""

    def wait_copied(self, timeout: float | None = None) -> bool: ...


_lock = threading.Lock()
#: Copies of this process still running that an optimizer step must not overtake.
_inflight: set[PendingCopy] = set()
#: The optimizers whose steps wait for the copies in flight, with their hooks' handles.
_guarded: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
#: Seconds optimizer steps of this process waited for copies (all of them, since start).
waited = [0.0]


def guard_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer``'s steps wait for this process's unfinished save copies (once per optimizer).

    Its parameters and their optimizer state then count as guarded: an overlapped
    save copies them beside the next forward and backward. ``AppState`` calls it
    for its optimizer.

    Args:
        optimizer: A ``torch.optim.Optimizer``.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"guard_optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    with _lock:
        if optimizer not in _guarded:
            _guarded[optimizer] = optimizer.register_step_pre_hook(_before_step)


def is_guarded(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s steps wait for unfinished copies."""
    with _lock:
        return optimizer in _guarded


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    wait_for_copies()


def wait_for_copies() -> float:
    """Wait for every copy in flight in this process; the seconds waited."""
    with _lock:
        pending = list(_inflight)
    if not pending:
        return 0.0
    start = time.perf_counter()
    for job in pending:
        job.wait_copied()
    seconds = time.perf_counter() - start
    waited[0] += seconds
    return seconds


def track(job: PendingCopy) -> None:
    """``job`` is in flight: guarded optimizer steps wait for it until ``untrack``."""
    with _lock:
        _inflight.add(job)


def untrack(job: PendingCopy) -> None:
    with _lock:
        _inflight.discard(job)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s local data (a DTensor's local shard; ``t`` itself otherwise)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield p
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    yield value


def guarded_storages() -> set[int]:
    """The storages (data pointers) of every guarded optimizer's parameters and state tensors."""
    with _lock:
        optimizers = list(_guarded.keys())
    return {storage_of(local_of(t)) for opt in optimizers for t in _optimizer_tensors(opt)}


def storage_of(t: torch.Tensor) -> int:
    """The address of ``t``'s storage: views of one tensor share it."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor with no storage of its own (a subclass)
        return -1


class Versions:
    """The version counters of a save's tensors when it began, to check after each one's copy.

    ``sources``: per item, the tensors whose counters move when its bytes change
    in place: the tensor as the state holds it (a DTensor counts its own in-place
    ops) and the local piece being copied.
    """

    def __init__(self, keys: Iterable[str], sources: Iterable[tuple[torch.Tensor, ...]]) -> None:
        self.keys = list(keys)
        self.sources = [tuple(s) for s in sources]
        self.begun = [_read(s) for s in self.sources]

    def changed(self, index: int) -> str | None:
        """Why item ``index`` cannot be saved (its tensor changed since the save began), or ``None``."""
        now = _read(self.sources[index])
        if now == self.begun[index]:
            return None
        return (
            f"key {self.keys[index]!r} was changed in place while the save copied it (its version counter went "
            f"from {self.begun[index][0]} to {now[0]}); the copy may be torn, so this save is not committed. "
            "Change the state only after the save's copy is done (SaveHandle.wait_copied()), or save with overlap=False"
        )


def _read(sources: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    return tuple(t._version for t in sources)
