"""``Stager``: ``dcp.async_save``'s staging into rayckpt's reusable buffer in the node's shared memory.

DCP's async save first makes a "training-safe" copy of the state (``AsyncStager.stage``),
then saves that copy while training goes on. This stager copies every tensor once into
one ``StagingBuffer``: a file in ``/dev/shm`` (``RAYCKPT_SHM_DIR``) reserved once and reused
from save to save, so a later save's copy lands in memory already mapped (page-locked
for CUDA states), cut into slices over the rank's cores. The staged state holds views
of the buffer: DTensors stay DTensors (same mesh, placements, shape), plain values are
deep-copied.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from ..engine.device import DeviceToHost
from ..engine.writer import parts_here
from ..ray.rank.staging import StagingBuffer

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


class Stager(AsyncStager):
    """An ``async_stager`` for ``dcp.async_save``: the state's tensors copied into one reusable shared-memory buffer.

    ``stage`` returns when every tensor is copied; the previous ``async_save`` must have
    finished (its future waited for) before the next ``stage``, since the buffer is reused,
    as with DCP's caching stager. ``close`` frees the buffer. docs/from_dcp.md.

    Args:
        directory: Where the buffer's file is made; None: ``RAYCKPT_SHM_DIR``, else ``/dev/shm``.
    """

    # The copy is done when ``stage`` returns: nothing for DCP to synchronize afterwards.
    _synchronize_after_execute = False

    def __init__(self, directory: str | None = None) -> None:
        self._buffer = StagingBuffer(directory)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` whose tensors live in the buffer (one copy each, spread over the cores)."""
        pieces: list[torch.Tensor] = []
        _collect(state_dict, pieces)
        region = self._buffer.place(pieces, "")
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        to_host = DeviceToHost()
        self._buffer.copy_now(list(zip(pieces, region.spans)), to_host, threads=parts_here(world, 1))
        to_host.wait()
        views = iter([self._buffer.view(span, p) for p, span in zip(pieces, region.spans)])
        return _rebuild(state_dict, views)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once every copy is done."""

    def close(self) -> None:
        self._buffer.close()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def _collect(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(_local(obj).detach())
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, out)


def _rebuild(obj: Any, views: Any) -> Any:
    """``obj`` with each tensor (in ``_collect``'s order) replaced by its staged view."""
    if isinstance(obj, torch.Tensor):
        view = next(views)
        if DTensor is not None and isinstance(obj, DTensor):
            return DTensor.from_local(
                view, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape, stride=obj.stride()
            )
        return view
    if isinstance(obj, dict):
        return {k: _rebuild(v, views) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, views) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(v, views) for v in obj)
    return copy.deepcopy(obj)
