"""What a save takes a rank's data share from, and what a load resumes: a sampler or the loader around it.

``data`` (``rayckpt.save``, ``rayckpt.load``, the ``Checkpointer``) is a
``ResumableSampler``, a ``torch.utils.data.DataLoader`` over one that loads in the
training process (``num_workers=0``: what the sampler handed out is what the loop
got), or a torchdata ``StatefulDataLoader`` over one with any ``num_workers``: its
snapshot of the sampler's iterator as of the last batch it yielded counts, not the
batches its workers prefetched.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..errors import DataPositionError
from .position import DataPosition, RankShare
from .sampler import SHARE_KEY, ResumableSampler


def sampler_of(data: Any) -> ResumableSampler:
    """The ``ResumableSampler`` of ``data`` (itself, or its loader's sampler or batch sampler's)."""
    if isinstance(data, ResumableSampler):
        return data
    for owner in (data, getattr(data, "batch_sampler", None)):
        sampler = getattr(owner, "sampler", None)
        if isinstance(sampler, ResumableSampler):
            return sampler
    raise DataPositionError(
        f"data must be a rayckpt.data.ResumableSampler or a DataLoader over one, got {type(data).__name__}"
        + (f" with sampler {type(data.sampler).__name__}" if hasattr(data, "sampler") else "")
    )


def share_of(data: Any) -> RankShare:
    """This rank's share of the job's data position, from ``data`` (see the module docstring).

    Raises:
        DataPositionError: ``data`` holds no ``ResumableSampler``; a ``DataLoader`` prefetches in
            worker processes (``num_workers > 0``) and cannot say what was consumed; a
            ``StatefulDataLoader`` snapshots less often than every batch.
    """
    sampler = sampler_of(data)
    if data is sampler:
        return sampler.share()
    if not callable(getattr(data, "state_dict", None)):
        if getattr(data, "num_workers", 0):
            raise DataPositionError(
                f"a {type(data).__name__} with num_workers={data.num_workers} prefetches batches the loop has not "
                "consumed, so its sampler cannot tell what was consumed: use torchdata's StatefulDataLoader, "
                "or num_workers=0"
            )
        return sampler.share()
    every = getattr(data, "snapshot_every_n_steps", 1)
    if every != 1:
        raise DataPositionError(
            f"a StatefulDataLoader with snapshot_every_n_steps={every} knows what was consumed only every "
            f"{every} batches: make it with snapshot_every_n_steps=1"
        )
    found = list(_shares(data.state_dict()))
    if not found:  # no iterator yet: nothing of the current epoch was handed out
        return sampler.share()
    share = RankShare.from_json(found[-1], f"{type(data).__name__}.state_dict()")
    if share.base != sampler.position:  # a snapshot of an earlier epoch's pass: the new one has not begun
        return sampler.share()
    return share


def _shares(state: Any) -> Iterator[dict[str, Any]]:
    """Every share in a loader's (nested) state dict."""
    if isinstance(state, dict):
        if SHARE_KEY in state:
            yield state[SHARE_KEY]
        for value in state.values():
            if value is not state.get(SHARE_KEY):
                yield from _shares(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _shares(value)


def resume(data: Any, saved: dict[str, Any] | None, where: str) -> None:
    """Continue ``data`` from the position ``saved`` (a manifest's ``data_position``; None: none was saved).

    Before the loader's next ``iter()``: the pass that begins then is this rank's share of the
    rest of the epoch. Raises ``DataPositionError`` as ``ResumableSampler.resume`` does.
    """
    position = None if saved is None else DataPosition.from_json(saved, f"the data position in {where}")
    sampler_of(data).resume(position, where)
