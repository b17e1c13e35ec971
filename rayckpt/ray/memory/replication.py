"""Replication of the memory tier: each held file copied to the next node of the ring before its write returns.

The ring is the live nodes that run a ShardWriter, sorted by node id; a file of
node ``n`` goes to the node after ``n`` (``ring_peer``). The copy runs in the
ShardWriter of the node that holds the file, over the peer's replica link
(``link``), or through Ray's object store where the link cannot be reached.
"""

from __future__ import annotations

import logging
import mmap
from typing import Any

import numpy as np
import ray

from ..actors import writers
from . import link

logger = logging.getLogger(__name__)


def replicate(node_id: str, path: str, fd: int, size: int) -> str | None:
    """Copy the held file ``path`` (open as ``fd``, ``size`` bytes) of node ``node_id`` to the ring's peer of
    that node; the peer's node id (``None``: no peer).

    Over the peers' replica link (``link``: the kernel sends the held file, the peer
    reads it into its own store); where the link cannot be reached, through Ray's
    object store, with one WARNING per peer.

    Raises:
        OSError: the copy failed (the caller drops its own copy: never held without its replica).
    """
    peer = ring_peer(node_id)
    if peer is None:
        return None
    node, handle = peer
    try:
        try:
            link.send(_endpoint(node, handle), path, fd, size)
        except link.LinkUnreachable:
            _ENDPOINTS.pop(node, None)  # a writer restarted since: ask again, once
            try:
                link.send(_endpoint(node, handle), path, fd, size)
            except link.LinkUnreachable as exc:
                if node not in _UNREACHABLE:
                    _UNREACHABLE.add(node)
                    logger.warning("rayckpt: memory tier: %s; replicas to node %s go through Ray instead", exc, node)
                _replicate_through_ray(handle, path, fd, size)
    except Exception as exc:
        raise OSError(f"memory tier: cannot copy {path} to node {node} (its replica): {exc}") from exc
    return node


#: Replica listeners (``link``) by node: asked of each peer's writer once.
_ENDPOINTS: dict[str, tuple[str, int, bytes]] = {}
#: Peers whose listener could not be reached (warned once).
_UNREACHABLE: set[str] = set()


def _endpoint(node: str, handle: Any) -> tuple[str, int, bytes]:
    if node not in _ENDPOINTS:
        _ENDPOINTS[node] = ray.get(handle.mem_endpoint.remote())
    return _ENDPOINTS[node]


def _replicate_through_ray(handle: Any, path: str, fd: int, size: int) -> None:
    """The copy through Ray's object store: mapped, not read, so Ray's copy into its store is the one out of here."""
    mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else b""
    try:
        ray.get(handle.mem_put.remote(path, np.frombuffer(mapped, dtype=np.uint8), True))
    finally:
        if isinstance(mapped, mmap.mmap):
            try:
                mapped.close()
            except BufferError:  # a view is still referenced somewhere: the mapping goes with it
                pass


def ring_peer(node_id: str) -> tuple[str, Any] | None:
    """The node after ``node_id`` in the ring of live nodes with a ShardWriter, and its writer; ``None``: alone."""
    ring = writers(fresh=True)  # the ring as it is now: a node may have left since the last look
    nodes = sorted(n for n in ring if n != node_id[:12])
    if not nodes:
        return None
    after = [n for n in nodes if n > node_id[:12]]
    node = (after or nodes)[0]
    return node, ring[node]
