"""How ranks agree: a tiny collective interface with an in-process implementation.

The engine only needs ``all_gather`` of small picklable objects. With no process
group there is one rank and every call is local; with ``torch.distributed``
initialized, calls go over the group (gloo or nccl). On Ray too the ranks agree
through their process group (Ray Train sets one up); the MetadataActor only
commits and plans, it is not a collective.

``gather_or_raise`` is how a failure on one rank reaches every rank: each phase
of a save or load ends in one all-gather of (ok, result-or-error), so no rank is
left waiting in a collective while another has given up.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from .. import errors
from ..errors import RayckptError

T = TypeVar("T")


class Coordinator(Protocol):
    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order. Called by every rank."""
        ...


class LocalCoordinator:
    """A world of one: no process group."""

    rank = 0
    world_size = 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]


class ProcessGroupCoordinator:
    """Collectives over an initialized ``torch.distributed`` process group."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self._group)
        return out


def default_coordinator(process_group: Any = None) -> Coordinator:
    """The process group's coordinator when one is initialized, else a local one."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return ProcessGroupCoordinator(process_group)
    except ImportError:  # pragma: no cover
        pass
    return LocalCoordinator()


def gather_or_raise(coord: Coordinator, phase: str, fn: Callable[[], T], error_type: type[RayckptError]) -> list[T]:
    """Run ``fn`` on this rank, share the outcome, and raise on every rank if any failed.

    The raised error names each failed rank and its message. A ``RayckptError``
    raised on this rank is re-raised as itself when it is the only failure.
    """
    try:
        outcome: tuple[bool, Any] = (True, fn())
        local_exc: BaseException | None = None
    except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
        local_exc = exc
        detail = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, RayckptError):
            detail += "\n" + "".join(traceback.format_exception(exc)[-3:]).rstrip()
        outcome = (False, (type(exc).__name__, detail))
    results = coord.all_gather(outcome)
    failed = [(r, info) for r, (ok, info) in enumerate(results) if not ok]
    if not failed:
        return [value for _, value in results]
    if coord.world_size == 1 and isinstance(local_exc, RayckptError):
        raise local_exc
    # When every failed rank raised the same rayckpt error, keep its type so callers
    # can catch e.g. IncompatibleStateError on every rank.
    names = {name for _, (name, _) in failed}
    cls = error_type
    if len(names) == 1:
        found = getattr(errors, names.pop(), None)
        if isinstance(found, type) and issubclass(found, RayckptError):
            cls = found
    lines = "\n".join(f"  rank {r}: {detail}" for r, (_, detail) in failed)
    raise cls(f"{phase} failed on {len(failed)} of {coord.world_size} rank(s):\n{lines}") from local_exc
