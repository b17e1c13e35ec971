"""``plan``: the reshard report for M FSDP2 ranks, computed with nothing running.

The same load plans ``load`` makes (dim-0 shards as ``torch.chunk`` cuts them),
summed per rank: bytes needed and read, reads, files, read amplification and
balance. ``rayckpt plan`` prints it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..format.manifest import TensorEntry
from ..planning.load_plan import TensorRequest, create_load_plans, dim0_boxes
from ..storage.checkpoint_dir import CheckpointDir
from .opening import open_checkpoint


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlan:
    rank: int
    bytes_needed: int
    #: Bytes read including the partial checksum blocks at range ends.
    bytes_read: int
    #: Ranged reads after coalescing.
    reads: int
    files: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReshardPlan:
    """What loading a checkpoint into ``world_size`` FSDP ranks reads, per rank."""

    path: str
    saved_world_size: int
    world_size: int
    bytes_needed: int
    bytes_read: int
    #: bytes_read / bytes_needed over all ranks (1.0 = nothing extra).
    read_amplification: float
    #: Mean over max of bytes read per rank (1.0 = perfectly balanced).
    balance: float
    ranks: tuple[RankPlan, ...]


def plan(ckpt: str | os.PathLike[str] | CheckpointDir, world_size: int) -> ReshardPlan:
    """The reshard plan for ``world_size`` ranks, computed with no worker running.

    Assumes every tensor is sharded on dim 0 as FSDP2 does (``torch.chunk``), and
    0-dim tensors are replicated on every rank: the same plans ``load`` makes.
    Reads the manifest alone.

    Args:
        ckpt: A checkpoint directory: a local path, a ``pyarrow.fs`` URI, the
            ``manifest.json`` inside one, or a ``CheckpointDir``.
        world_size: The number of ranks that would load it.

    Returns:
        A ``ReshardPlan``: per rank, the bytes needed and read, the reads and
            the files; over all ranks, the read amplification and the balance.

    Raises:
        ValueError: ``world_size`` is less than 1.
        CheckpointNotFoundError: ``ckpt`` does not exist, or holds no committed
            checkpoint (no ``manifest.json``); the message says what is there.
        CorruptCheckpointError: The manifest does not parse or is inconsistent
            (``FormatVersionError``: written by an unknown format version).
    """
    if world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {world_size}")
    ckdir, m = open_checkpoint(ckpt)
    tensors = [(k, e) for k, e in m.entries.items() if isinstance(e, TensorEntry)]
    boxes = {k: dim0_boxes(e.shape, world_size) for k, e in tensors}
    requests = [[TensorRequest(k, e.dtype, e.shape, boxes[k][r]) for k, e in tensors] for r in range(world_size)]
    ranks = tuple(
        RankPlan(rank=r, bytes_needed=p.needed_bytes, bytes_read=p.read_bytes, reads=len(p.reads), files=p.files)
        for r, p in enumerate(create_load_plans(m, requests))
    )
    needed = sum(r.bytes_needed for r in ranks)
    read = sum(r.bytes_read for r in ranks)
    busiest = max(r.bytes_read for r in ranks)
    return ReshardPlan(
        path=ckdir.location,
        saved_world_size=m.world_size,
        world_size=world_size,
        bytes_needed=needed,
        bytes_read=read,
        read_amplification=read / needed if needed else 1.0,
        balance=read / world_size / busiest if busiest else 1.0,
        ranks=ranks,
    )
