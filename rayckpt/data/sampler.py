"""``ResumableSampler``: ``DistributedSampler``'s order, with a position that resumes under any worker count."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import Sampler

from ..errors import DataPositionError
from .position import DataPosition, RankShare, share_count, split_count

logger = logging.getLogger("rayckpt.data")

#: The key of a share in a sampler iterator's ``state_dict`` (what ``StatefulDataLoader`` snapshots).
SHARE_KEY = "rayckpt_data_share"


def permutation(position: DataPosition) -> torch.Tensor:
    """The epoch's order of the dataset's indices: ``randperm`` seeded by ``seed + epoch`` when shuffled."""
    if not position.shuffle:
        return torch.arange(position.length)
    g = torch.Generator()
    g.manual_seed(position.seed + position.epoch)
    return torch.randperm(position.length, generator=g)


def share_indices(position: DataPosition, rank: int, world_size: int) -> list[int]:
    """The dataset indices rank ``rank`` of ``world_size`` gets of what is left of the epoch, in order."""
    if not position.extras:
        start = position.consumed
        offsets = torch.arange(start + rank, start + split_count(position, world_size), world_size)
    else:
        left = torch.ones(position.length, dtype=torch.bool)
        left[: position.consumed] = False
        left[list(position.extras)] = False
        offsets = left.nonzero().flatten()[: split_count(position, world_size)][rank::world_size]
    return permutation(position)[offsets].tolist()


class ResumableSampler(Sampler[int]):
    """Each rank's indices of a map-style dataset, like ``DistributedSampler``, and the job's place in them.

    Rank ``r`` of ``num_replicas`` gets every ``num_replicas``-th index of the epoch's
    permutation from the ``r``-th (the order ``DistributedSampler`` gives). No index is
    repeated to even the ranks out: without ``drop_last`` the ranks' shares differ by at
    most one sample; with it the tail that does not split evenly is left out of the epoch.

    Saved with a checkpoint (``rayckpt.save(..., data=...)``, ``Checkpointer(data=...)``),
    the samples every rank consumed become one global position; loaded under any worker
    count, each rank gets the rest of the epoch striped across the new ranks, from exactly
    where the job stopped (docs/data.md).

    Args:
        dataset: The dataset (anything with ``len``), or its length.
        num_replicas: The number of ranks; None: the default process group's world size (else 1).
        rank: This rank; None: the default process group's rank (else 0).
        shuffle: Shuffle each epoch (seeded by ``seed + epoch``); False: in index order.
        seed: The shuffle's seed, the same on every rank.
        drop_last: Leave out the tail of each epoch that does not split evenly among the ranks.
        identity: What the dataset is, kept with the position (with its length, its fingerprint):
            a position is resumed only into a sampler of the same identity. None: the dataset's
            class name.
        restart_on_length_change: Resuming a position saved with another dataset length starts the
            saved epoch over (one WARNING); False: refused with both lengths named.

    Raises:
        ValueError: ``rank`` is not in ``[0, num_replicas)``, or ``seed`` is negative.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        identity: str | None = None,
        restart_on_length_change: bool = False,
    ) -> None:
        import torch.distributed as dist

        grouped = dist.is_available() and dist.is_initialized()
        self.num_replicas = num_replicas if num_replicas is not None else (dist.get_world_size() if grouped else 1)
        self.rank = rank if rank is not None else (dist.get_rank() if grouped else 0)
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is not in a world of {self.num_replicas}")
        if type(seed) is not int or seed < 0:
            raise ValueError(f"seed must be a whole number >= 0, got {seed!r}")
        length = dataset if isinstance(dataset, int) else len(dataset)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), seed, bool(drop_last)
        self.restart_on_length_change = restart_on_length_change
        self._fresh = DataPosition(
            dataset=identity or type(dataset).__qualname__,
            length=length,
            seed=seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
        )
        #: The position this rank's share of the current epoch is split from.
        self.position = self._fresh
        self._iterator: ShareIterator | None = None

    @property
    def epoch(self) -> int:
        """The epoch being sampled (after a resume, the saved one, or the next when it was through)."""
        return self.position.epoch

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning, unless it is the epoch a resume is in the middle of."""
        if epoch != self.position.epoch:
            self.position = replace(self._fresh, epoch=epoch)
            self._iterator = None

    def __iter__(self) -> Iterator[int]:
        self._iterator = ShareIterator(self.position, self.rank, self.num_replicas)
        return self._iterator

    def __len__(self) -> int:
        return share_count(self.position, self.rank, self.num_replicas)

    def share(self) -> RankShare:
        """This rank's part of the position: how many samples of the current epoch's share were handed out."""
        if self._iterator is not None and self._iterator.base is self.position:
            return self._iterator.share()
        return RankShare(base=self.position, rank=self.rank, world_size=self.num_replicas, taken=0)

    def resume(self, saved: DataPosition | None, where: str) -> None:
        """Continue from ``saved``, the job's position in the checkpoint at ``where``.

        A position whose epoch was through resumes at the next epoch's start. None (a
        checkpoint saved without a position): the current epoch starts over, with one WARNING.

        Raises:
            DataPositionError: ``saved`` is of another dataset (both fingerprints named), or of
                the same dataset with another length unless ``restart_on_length_change``.
        """
        self._iterator = None
        fresh = self._fresh
        if saved is None:
            logger.warning(
                "%s holds no data position (saved without one, or before rayckpt stored them): the data "
                "restarts from the start of epoch %d",
                where,
                self.epoch,
            )
            self.position = replace(fresh, epoch=self.epoch)
            return
        if saved.dataset != fresh.dataset:
            raise DataPositionError(
                f"the data position in {where} is of dataset {saved.fingerprint}, this sampler's dataset is "
                f"{fresh.fingerprint}: refusing to resume another dataset's position"
            )
        if saved.length != fresh.length:
            if not self.restart_on_length_change:
                raise DataPositionError(
                    f"the dataset {saved.dataset!r} had {saved.length} samples when {where} was saved and has "
                    f"{fresh.length} now: its position cannot continue; pass restart_on_length_change=True to "
                    f"the ResumableSampler to start epoch {saved.epoch} over"
                )
            logger.warning(
                "the dataset %r had %d samples when %s was saved and has %d now: epoch %d starts over",
                saved.dataset,
                saved.length,
                where,
                fresh.length,
                saved.epoch,
            )
            saved = replace(fresh, epoch=saved.epoch)
        if (saved.seed, saved.shuffle, saved.drop_last) != (fresh.seed, fresh.shuffle, fresh.drop_last):
            logger.warning(
                "%s was saved with seed %d, shuffle %s, drop_last %s; this sampler has seed %d, shuffle %s, "
                "drop_last %s: the saved epoch %d finishes in its saved order, the later ones follow this sampler",
                where,
                saved.seed,
                saved.shuffle,
                saved.drop_last,
                fresh.seed,
                fresh.shuffle,
                fresh.drop_last,
                saved.epoch,
            )
        if saved.complete:
            saved = replace(fresh, epoch=saved.epoch + 1)
        self.position = saved


class ShareIterator(Iterator[int]):
    """One pass over a rank's share of an epoch, counting what it handed out.

    Its ``state_dict`` is what torchdata's ``StatefulDataLoader`` snapshots with each
    batch it yields: the count as of that batch, not of the batches its workers prefetched.
    """

    def __init__(self, base: DataPosition, rank: int, world_size: int) -> None:
        self.base, self.rank, self.world_size = base, rank, world_size
        self._indices = share_indices(base, rank, world_size)
        self.taken = 0

    def __next__(self) -> int:
        if self.taken >= len(self._indices):
            raise StopIteration
        self.taken += 1
        return self._indices[self.taken - 1]

    def share(self) -> RankShare:
        return RankShare(base=self.base, rank=self.rank, world_size=self.world_size, taken=self.taken)

    def state_dict(self) -> dict[str, Any]:
        return {SHARE_KEY: self.share().to_json()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Fast-forward to a snapshot of this same share (``StatefulDataLoader.load_state_dict``)."""
        share = RankShare.from_json(state[SHARE_KEY], "the loader's state")
        if (share.base, share.rank, share.world_size) != (self.base, self.rank, self.world_size):
            raise DataPositionError(
                f"the loader's state is rank {share.rank} of {share.world_size} in epoch {share.base.epoch}; this "
                f"iterator is rank {self.rank} of {self.world_size} in epoch {self.base.epoch}: resume a job's "
                "position with rayckpt (rayckpt.load(..., data=...), Checkpointer.restore), which reshards it"
            )
        self.taken = share.taken


__all__ = ["ResumableSampler", "ShareIterator", "permutation", "share_indices"]
