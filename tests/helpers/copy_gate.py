"""``CopyGate``: holds a process's save copies that run beside training until the next optimizer step begins."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from rayckpt.engine.device import DeviceToHost
from rayckpt.engine.overlap import is_guarded
from rayckpt.ray.rank.save_handle import SaveHandle
from rayckpt.ray.rank.staging import StagingBuffer


class CopyGate:
    """Holds the copies an overlapped save leaves to its background thread until ``optimizer``'s next step.

    A small model's copy is over long before the next step's forward begins, so its overlap would go
    untested. Held, the copy is still to come through the whole forward and backward (which must leave
    what it copies unchanged), and the optimizer step, which opens the gate, must wait for it: the gate's
    pre-hook is registered before ``AppState`` guards the optimizer, so it runs first. Held on the
    background thread: a CPU piece's copy, and the wait for the device pieces queued on the side stream
    (the version check comes after both).

    Args:
        optimizer: The optimizer whose steps open the gate, not yet guarded.
        patch: How the copy methods are replaced (``monkeypatch.setattr`` in a test's own process).

    Raises:
        ValueError: ``optimizer`` is guarded already (its steps would wait for a copy the gate holds).

    Attributes:
        open: Set while copies may go on; ``close`` clears it, the next optimizer step sets it.
        saves: Per save (``watch``): its step, ``late_bytes``, ``staging`` and, once the next
            optimizer step is over, ``copied_after_step`` (whether the step left its copy done).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, patch: Callable[[Any, str, Any], None] = setattr) -> None:
        if is_guarded(optimizer):  # the guard's pre-hook would run first and wait for a copy the gate holds
            raise ValueError("CopyGate: the optimizer is guarded already; make the gate before its AppState")
        self.open = threading.Event()
        self.open.set()
        self.training = threading.current_thread()
        self.saves: list[dict[str, Any]] = []
        self._watched: list[tuple[SaveHandle, dict[str, Any]]] = []
        for cls, name in ((StagingBuffer, "copy_piece"), (DeviceToHost, "wait")):
            patch(cls, name, self._held(getattr(cls, name)))
        optimizer.register_step_pre_hook(lambda *_: self.open.set())
        optimizer.register_step_post_hook(self._after_step)

    def _held(self, method: Callable[..., None]) -> Callable[..., None]:
        def held(*args: Any) -> None:
            if threading.current_thread() is not self.training:
                self.open.wait()
            method(*args)

        return held

    def close(self) -> None:
        """Hold the copies the next save leaves to its background thread."""
        self.open.clear()

    def watch(self, handle: SaveHandle) -> None:
        """Record ``handle``'s save; the next optimizer step records whether its copy was done."""
        record: dict[str, Any] = {"step": handle.step, "late_bytes": handle.late_bytes, "staging": handle.staging}
        self.saves.append(record)
        self._watched.append((handle, record))

    def _after_step(self, *_: Any) -> None:
        for handle, record in self._watched:
            record["copied_after_step"] = handle.copied()
        self._watched = []
