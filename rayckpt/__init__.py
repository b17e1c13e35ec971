"""rayckpt: sharded PyTorch checkpoints for training on Ray, in an open Arrow format.

The public API is importable from here; each name is imported on first use, so
``import rayckpt`` (and ``import rayckpt.format``, ``rayckpt.cli``, ...) stays
cheap and pulls in no layer it does not use. A process that has imported torch
before rayckpt (one that trains or loads) imports the engine with ``import
rayckpt``, as ``import torch.distributed.checkpoint`` does DCP's, so its first
save or load does not pay for the imports inside the call. The layers, bottom up (each imports
only those below it): ``format``, ``planning``, ``storage``, ``engine``, ``ray``,
``train``; ``tools`` and ``cli`` sit on ``engine`` and never import Ray.
"""

from __future__ import annotations

import importlib
import sys

from .lazy import exports

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS = {
    "save": "rayckpt.engine.save",
    "SaveInfo": "rayckpt.engine.save",
    "load": "rayckpt.engine.load",
    "LoadInfo": "rayckpt.engine.load",
    "read_manifest": "rayckpt.storage.commit",
    "convert": "rayckpt.tools.convert",
    "consolidate": "rayckpt.tools.reader",
    "inspect": "rayckpt.tools.inspection",
    "plan": "rayckpt.tools.plan_report",
    "verify": "rayckpt.tools.verification",
    "CheckpointExistsError": "rayckpt.errors",
    "CheckpointNotFoundError": "rayckpt.errors",
    "CorruptCheckpointError": "rayckpt.errors",
    "DataPositionError": "rayckpt.errors",
    "FormatVersionError": "rayckpt.errors",
    "IncompatibleStateError": "rayckpt.errors",
    "InvalidStateError": "rayckpt.errors",
    "PeerLostError": "rayckpt.errors",
    "RayckptError": "rayckpt.errors",
    "RestoreFailedError": "rayckpt.errors",
    "SaveFailedError": "rayckpt.errors",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = exports(__name__, _EXPORTS)


#: What a process that has imported torch imports with rayckpt: the engine's save and load and what they use
#: (pyarrow, numpy, xxhash), so that import time is paid at ``import rayckpt``, not inside the first save or load.
ENGINE = ("rayckpt.engine.save", "rayckpt.engine.load")

if "torch" in sys.modules:
    for _module in ENGINE:
        importlib.import_module(_module)
