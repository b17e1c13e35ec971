"""Look into checkpoints without a cluster: inspect, read, verify, plan reports, list, convert, gc.

One process, no process group, never Ray. Owns what the ``rayckpt`` command
shows and the conversions to and from other formats. May import ``engine`` and
everything below it (``storage``, ``planning``, ``format``), and torch; never
``rayckpt.ray`` or ``rayckpt.train``.
"""

from .gc import GcReport, gc
from .inspection import CheckpointInfo, TensorSummary, inspect, tensor_summary
from .listing import ls
from .plan_report import ReshardPlan, plan
from .reader import CheckpointReader, consolidate, read_tensor
from .verification import VerifyReport, verify

__all__ = [
    "CheckpointInfo",
    "CheckpointReader",
    "GcReport",
    "ReshardPlan",
    "TensorSummary",
    "VerifyReport",
    "consolidate",
    "gc",
    "inspect",
    "ls",
    "plan",
    "read_tensor",
    "tensor_summary",
    "verify",
]
