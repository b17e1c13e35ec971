"""The memory tier's side of a node's ShardWriter: the store it holds and the calls other processes make on it.

``ShardWriter`` inherits ``MemoryHost``: the ShardWriter's process is the one that
holds the node's memory checkpoints (``store.MemoryStore``) and receives its peers'
replicas (``link.ReplicaServer``). The ``mem_*`` methods are what
``filesystem.MemoryFileSystem`` and the ``Checkpointer`` call on every live writer.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray

from .. import metrics
from ..status import published
from .link import ReplicaServer
from .store import MemoryStore, hold_here

#: How often the node's memory gauges are set again (Ray's export drops a gauge not set for two report intervals).
GAUGE_EVERY_S = 1.0


class MemoryHost:
    """The node's share of the memory tier, held by the actor that inherits this (a threaded Ray actor)."""

    def __init__(self, node_id: str, directory: str) -> None:
        #: The node's share of the memory tier: freed with this process.
        self.memory = MemoryStore(node_id, directory)
        hold_here(self.memory)
        #: Where peers send this node its replicas.
        self.replicas = ReplicaServer(self.memory, ray.util.get_node_ip_address())
        #: Replicas peers sent through Ray's object store (their link to this node unreachable), and their bytes.
        self.replicas_through_ray = {"files": 0, "bytes": 0}
        self._counts_lock = threading.Lock()
        self._node = node_id[:12]
        threading.Thread(target=self._export_gauges, name="rayckpt-memory-gauges", daemon=True).start()

    def _export_gauges(self) -> None:
        """Every ``GAUGE_EVERY_S``: set this node's ``rayckpt_memory_held_bytes`` and ``rayckpt_memory_budget_bytes``,
        and publish ``mem_usage()`` for ``rayckpt status`` (``published``)."""
        while True:
            metrics.observe("rayckpt_memory_held_bytes", self.memory.held, node=self._node)
            metrics.observe("rayckpt_memory_budget_bytes", self.memory.budget, node=self._node)
            published.publish(published.node_key(self._node), {"time": time.time(), **self.mem_usage()})
            time.sleep(GAUGE_EVERY_S)

    def mem_usage(self) -> dict[str, Any]:
        """This node's memory tier (``rayckpt status``): ``node``, ``held`` and ``budget`` bytes, ``room`` and what
        bounds it (``MemoryStore.room``), ``replicas_received`` over the link and ``replicas_through_ray``."""
        room, bound = self.memory.room()
        with self._counts_lock:
            through_ray = dict(self.replicas_through_ray)
        return {
            "node": self._node,
            "held": self.memory.held,
            "budget": self.memory.budget,
            "room": room,
            "bound": bound,
            "replicas_received": dict(self.replicas.received),
            "replicas_through_ray": through_ray,
        }

    def mem_put(self, path: str, data: Any, replica: bool = False) -> int:
        """Hold ``data`` as ``path`` (not replicated); its size. ``replica``: a peer's replica, sent through
        Ray (``replication``), counted in ``replicas_through_ray``."""
        size = self.memory.put(path, data)
        if replica:
            with self._counts_lock:
                self.replicas_through_ray["files"] += 1
                self.replicas_through_ray["bytes"] += size
        return size

    def mem_endpoint(self) -> tuple[str, int, bytes]:
        """(host, port, token) of this node's replica listener."""
        return self.replicas.endpoint

    def mem_stat(self, paths: list[str]) -> dict[str, int]:
        return self.memory.stat(paths)

    def mem_listing(self, base: str, recursive: bool) -> dict[str, int]:
        return self.memory.listing(base, recursive)

    def mem_delete(self, path: str, tree: bool) -> int:
        return self.memory.delete(path, tree)

    def mem_where(self, path: str) -> tuple[int, int, int, int] | None:
        return self.memory.where(path)

    def mem_read(self, path: str, offset: int, length: int) -> bytes:
        return self.memory.read(path, offset, length)

    def mem_room(self, root: str | None = None, keep: int = 0) -> tuple[int, str]:
        """Bytes the node's memory tier may still take and what bounds them (``MemoryStore.room``: its budget
        less what it holds, or its filesystem's free space where less); with ``root``, after dropping the
        checkpoints under it older than its newest ``keep`` committed ones (``MemoryStore.drop_old``)."""
        return self.memory.room(root, keep)

    def mem_budget(self, nbytes: int | None = None) -> int:
        """The node's memory-tier budget in bytes; ``nbytes`` sets it (held files stay)."""
        if nbytes is not None:
            self.memory.budget = nbytes
        return self.memory.budget
