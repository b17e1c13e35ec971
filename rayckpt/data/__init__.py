"""The job's place in its data, saved with each checkpoint and resumed under any worker count.

``ResumableSampler`` replaces ``DistributedSampler``; pass it (or the loader around it)
as ``data=`` to ``rayckpt.save`` / ``rayckpt.load`` or the ``Checkpointer``. What is
saved and how it reshards: docs/data.md.
"""

from __future__ import annotations

from .loaders import resume, sampler_of, share_of
from .position import DataPosition, RankShare, combine
from .sampler import ResumableSampler, permutation, share_indices

__all__ = [
    "DataPosition",
    "RankShare",
    "ResumableSampler",
    "combine",
    "permutation",
    "resume",
    "sampler_of",
    "share_indices",
    "share_of",
]
