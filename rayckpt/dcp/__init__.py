"""rayckpt inside ``torch.distributed.checkpoint``: a ``StorageWriter``, a ``StorageReader`` and a ``Stager``.

``dcp.save(state, storage_writer=rayckpt.dcp.StorageWriter(path))`` writes a rayckpt
checkpoint; ``dcp.load(state, storage_reader=rayckpt.dcp.StorageReader(path))`` reads any
rayckpt checkpoint into any world size; ``dcp.async_save(..., async_stager=rayckpt.dcp.Stager())``
stages into rayckpt's reusable shared-memory buffer. docs/from_dcp.md. Each name is imported on
first use (the stager's buffer is the Ray layer's, the writer and reader never import Ray).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import exports

if TYPE_CHECKING:
    from .reader import StorageReader
    from .stager import Stager
    from .writer import StorageWriter

_EXPORTS = {
    "StorageWriter": "rayckpt.dcp.writer",
    "StorageReader": "rayckpt.dcp.reader",
    "Stager": "rayckpt.dcp.stager",
}

__all__ = ["Stager", "StorageReader", "StorageWriter"]

__getattr__, __dir__ = exports(__name__, _EXPORTS)
