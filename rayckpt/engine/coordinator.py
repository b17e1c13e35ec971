"""How ranks agree: a tiny collective interface with an in-process implementation.

The engine needs ``all_gather`` of small picklable objects, and ``gather`` to rank 0
plus ``scatter`` from it (``plan_at_root``: one rank plans, each gets its part). With no process
group there is one rank and every call is local; with ``torch.distributed``
initialized, calls go over the group (gloo or nccl; on a host group ``gather`` and
``scatter`` take one collective each, ``slots``). On Ray too the ranks agree
through their process group (Ray Train sets one up); the MetadataActor only
commits and plans, it is not a collective.

``gather_or_raise`` is how a failure on one rank reaches every rank: each phase
of a save or load ends in one all-gather of (ok, result-or-error), so no rank is
left waiting in a collective while another has given up. When the all-gather
itself fails (a peer rank died or stopped answering: gloo and nccl raise a
``RuntimeError`` or time out), it raises the caller's rayckpt error naming the
phase, the collective and this rank, never the transport's error alone.

``claim`` settles what ranks can no longer agree on through a collective: the
first value set for a key in the process group's store wins (a save's commit
against a rank that gave up on it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn, Protocol, TypeVar

from .. import errors
from ..errors import RayckptError, describe_error
from . import slots

logger = logging.getLogger(__name__)

T = TypeVar("T")
L = TypeVar("L")


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

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def scatter(self, objs: list[Any] | None) -> Any:
        assert objs is not None and len(objs) == 1
        return objs[0]

    def claim(self, key: str, value: str) -> str | None:
        return value


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

    def _root(self) -> int:
        """The global rank of the group's rank 0 (what ``gather_object`` / ``scatter_object_list`` take)."""
        return 0 if self._group is None else self._dist.get_global_rank(self._group, 0)

    def _on_host(self) -> bool:
        """Whether the group's object collectives run on host tensors (gloo), where ``slots`` applies."""
        return self._dist.distributed_c10d._get_object_coll_device(self._group) == "cpu"

    def gather(self, obj: Any) -> list[Any] | None:
        if self._on_host():
            return slots.gather(self._dist, self._group, self.rank, self.world_size, obj)
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._dist.gather_object(obj, out, dst=self._root(), group=self._group)
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        if self._on_host():
            return slots.scatter(self._dist, self._group, self.rank, self.world_size, objs)
        out: list[Any] = [None]
        self._dist.scatter_object_list(out, objs if self.rank == 0 else None, src=self._root(), group=self._group)
        return out[0]

    def claim(self, key: str, value: str) -> str | None:
        """First writer wins, through the group's store (which outlives a broken collective)."""
        try:
            c10d = self._dist.distributed_c10d
            group = self._group if self._group is not None else c10d._get_default_group()
            store = c10d._world.pg_map[group][1]
            held = store.compare_set(f"rayckpt/{key}", "", value)
        except Exception:  # noqa: BLE001 - no store (the rank hosting it died): unknown
            return None
        return held.decode() if isinstance(held, bytes) else str(held)


def default_coordinator(process_group: Any = None) -> Coordinator:
    """The process group's coordinator when one is initialized, else a local one."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return ProcessGroupCoordinator(process_group)
    except ImportError:  # pragma: no cover
        pass
    return LocalCoordinator()


def claim(coord: Coordinator, key: str, value: str) -> str | None:
    """Set ``key`` to ``value`` unless another rank set it first; return the value that holds.

    Any rank, not collective. ``None``: unknown (no store reached, or a coordinator
    without ``claim`` in a world of several ranks).
    """
    own = getattr(coord, "claim", None)
    if own is not None:
        return own(key, value)
    return value if coord.world_size == 1 else None


def gather(coord: Coordinator, obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on rank 0, ``None`` elsewhere. Called by every rank.

    A coordinator without ``gather`` falls back to ``all_gather`` (every rank gets all).
    """
    own = getattr(coord, "gather", None)
    if own is not None:
        return own(obj)
    out = coord.all_gather(obj)
    return out if coord.rank == 0 else None


def scatter(coord: Coordinator, objs: list[Any] | None) -> Any:
    """Rank r's item of rank 0's ``objs`` (one per rank; ignored elsewhere). Called by every rank.

    A coordinator without ``scatter`` falls back to ``all_gather`` of rank 0's list.
    """
    own = getattr(coord, "scatter", None)
    if own is not None:
        return own(objs)
    return coord.all_gather(objs if coord.rank == 0 else None)[0][coord.rank]


def plan_at_root(
    coord: Coordinator,
    phase: str,
    local: Callable[[], L],
    plan: Callable[[list[L]], list[T]],
    error_type: type[RayckptError],
    lost_type: type[RayckptError] | None = None,
) -> T:
    """Each rank sends ``local()`` to rank 0 (a gather), rank 0 runs ``plan`` on all of
    them (one result per rank), and each rank receives only its own result (a scatter).

    So what a rank sends grows with its own share and what it receives is its own
    part, not everyone's. A failure anywhere (any rank's ``local``, rank 0's
    ``plan``) is raised on every rank as ``gather_or_raise`` raises it; a broken
    collective (a peer died) raises ``lost_type`` (default ``error_type``).
    """
    outcome, local_exc = _run(local)
    try:
        gathered = gather(coord, outcome)
        results: list[tuple[bool, Any]] | None = None
        if coord.rank == 0:
            assert gathered is not None
            failed = [(r, info) for r, (ok, info) in enumerate(gathered) if not ok]
            if failed:
                results = [(False, failed)] * coord.world_size
            else:
                (ok, planned), plan_exc = _run(lambda: plan([value for _, value in gathered]))
                if ok and len(planned) != coord.world_size:  # pragma: no cover - a planner bug
                    ok, planned = False, ("RuntimeError", f"{len(planned)} plans for {coord.world_size} ranks")
                results = [(True, p) for p in planned] if ok else [(False, [(0, planned)])] * coord.world_size
                local_exc = local_exc or plan_exc
        ok, mine = scatter(coord, results)
    except Exception as exc:  # noqa: BLE001 - gloo / nccl: RuntimeError, DistBackendError, timeouts
        raise (lost_type or error_type)(_collective_failed(coord, phase, exc, local_exc, "gather/scatter")) from exc
    if ok:
        return mine
    _raise_failures(coord, phase, mine, local_exc, error_type)


def _run(fn: Callable[[], T]) -> tuple[tuple[bool, Any], BaseException | None]:
    """``fn()`` as a shareable outcome: ``(True, result)`` or ``(False, (error type name, detail))``."""
    try:
        return (True, fn()), None
    except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
        # The cause in words goes to every rank; the frames stay here (the raised error chains
        # this exception) and in the debug log.
        if not isinstance(exc, RayckptError):
            logger.debug("rayckpt: a save or load step failed on this rank", exc_info=exc)
        return (False, (type(exc).__name__, describe_error(exc))), exc


def gather_or_raise(
    coord: Coordinator,
    phase: str,
    fn: Callable[[], T],
    error_type: type[RayckptError],
    lost_type: type[RayckptError] | None = None,
) -> list[T]:
    """Run ``fn`` on this rank, share the outcome, and raise on every rank if any failed.

    The raised error names each failed rank and its message. A ``RayckptError``
    raised on this rank is re-raised as itself when it is the only failure. When
    the all-gather itself fails (a peer died), ``lost_type`` (default
    ``error_type``) is raised, naming the phase, the collective and this rank.
    """
    outcome, local_exc = _run(fn)
    try:
        results = coord.all_gather(outcome)
    except Exception as exc:  # noqa: BLE001 - gloo / nccl: RuntimeError, DistBackendError, timeouts
        raise (lost_type or error_type)(_collective_failed(coord, phase, exc, local_exc)) from exc
    failed = [(r, info) for r, (ok, info) in enumerate(results) if not ok]
    if not failed:
        return [value for _, value in results]
    _raise_failures(coord, phase, failed, local_exc, error_type)


def _raise_failures(
    coord: Coordinator,
    phase: str,
    failed: list[tuple[int, tuple[str, str]]],
    local_exc: BaseException | None,
    error_type: type[RayckptError],
) -> NoReturn:
    """Raise the error naming each failed rank (``(rank, (type name, detail))``) and its message."""
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


def _collective_failed(
    coord: Coordinator, phase: str, exc: Exception, local_exc: BaseException | None, collective: str = "all_gather"
) -> str:
    error = " ".join(str(exc).split())[:400]
    text = (
        f"{phase} failed: the {collective} collective failed on rank {coord.rank} of {coord.world_size}: "
        f"{type(exc).__name__}: {error}. A peer rank that died or stopped answering makes it fail (which one "
        "is not known here); this process group cannot run collectives any more: destroy it and start a new one"
    )
    if local_exc is not None:
        text += f". Rank {coord.rank} had failed too: {type(local_exc).__name__}: {local_exc}"
    return text
