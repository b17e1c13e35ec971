"""Look into checkpoints without a cluster: inspect, read, verify, plan reports, list, convert, gc, rm.

One process, no process group, never Ray. Owns what the ``rayckpt`` command
shows and the conversions to and from other formats. May import ``engine`` and
everything below it (``storage``, ``planning``, ``format``), and torch; never
``rayckpt.ray`` or ``rayckpt.train``.

Only reading tensors needs torch: the reader's names (``CheckpointReader``,
``consolidate``, ``read_tensor``) are imported on first use, so ``ls``,
``inspect``, ``plan``, ``verify``, ``gc`` and ``remove`` (and the ``rayckpt`` command for
them) start without importing torch.
"""

from __future__ import annotations

from ..lazy import exports
from .gc import GcReport, gc
from .inspection import CheckpointInfo, TensorSummary, inspect, tensor_summary
from .listing import ls
from .plan_report import ReshardPlan, plan
from .removal import RemoveReport, SaveInFlightError, remove
from .verification import VerifyReport, verify

#: Names that need torch -> the module that defines them (imported on first use).
_LAZY = {"CheckpointReader": "reader", "consolidate": "reader", "read_tensor": "reader"}

__all__ = [
    "CheckpointInfo",
    "CheckpointReader",
    "GcReport",
    "RemoveReport",
    "ReshardPlan",
    "SaveInFlightError",
    "TensorSummary",
    "VerifyReport",
    "consolidate",
    "gc",
    "inspect",
    "ls",
    "plan",
    "read_tensor",
    "remove",
    "tensor_summary",
    "verify",
]


__getattr__, __dir__ = exports(__name__, {name: f"rayckpt.tools.{module}" for name, module in _LAZY.items()})
