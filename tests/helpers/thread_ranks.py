"""Ranks as threads of one process: a coordinator over shared memory that counts the bytes each
rank sends and receives (pickled, as torch.distributed's object collectives send them)."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class ThreadGroup:
    """A process group of ``world_size`` threads."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.slots: list[Any] = [None] * world_size
        #: Per rank: bytes sent and received in collectives.
        self.sent = [0] * world_size
        self.received = [0] * world_size

    def run(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(coordinator)`` on every rank; results (or raised exceptions) by rank."""

        def one(rank: int) -> Any:
            try:
                return fn(ThreadCoordinator(self, rank))
            except Exception as exc:  # noqa: BLE001 - returned for the test to check
                return exc

        with ThreadPoolExecutor(self.world_size) as pool:
            return list(pool.map(one, range(self.world_size)))


class ThreadCoordinator:
    """One rank of a ``ThreadGroup``: ``all_gather``, ``gather`` and ``scatter`` of copies."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        #: The process group (what the save's plan cache is kept by).
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    def _exchange(self, obj: Any, collect: Callable[[list[Any]], Any]) -> Any:
        g = self.group
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        g.slots[self.rank] = data
        g.barrier.wait()
        out = collect(g.slots)
        g.barrier.wait()
        return out

    def _receive(self, blobs: list[bytes]) -> list[Any]:
        self.group.received[self.rank] += sum(len(b) for b in blobs)
        return [pickle.loads(b) for b in blobs]

    def all_gather(self, obj: Any) -> list[Any]:
        self.group.sent[self.rank] += len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        return self._exchange(obj, lambda slots: self._receive(list(slots)))

    def gather(self, obj: Any) -> list[Any] | None:
        self.group.sent[self.rank] += len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        return self._exchange(obj, lambda slots: self._receive(list(slots)) if self.rank == 0 else None)

    def scatter(self, objs: list[Any] | None) -> Any:
        parts = [pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) for o in objs] if self.rank == 0 else []
        self.group.sent[self.rank] += sum(len(p) for p in parts)

        def take(slots: list[Any]) -> Any:
            mine = pickle.loads(slots[0])[self.rank]
            self.group.received[self.rank] += len(pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL))
            return mine

        return self._exchange(objs if self.rank == 0 else None, take)
