"""What ``rayckpt status`` reads from a running cluster: the MetadataActor's view of every run, and each
node's memory tier from its ShardWriter, as they last published them (``published``: every second), and a
run's timeline, asked of the MetadataActor. An operator's process: it joins the cluster as a driver,
reads, and leaves.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from ..actors import METADATA_ACTOR_NAME, NAMESPACE
from ..joining import cluster_address
from . import published

#: The longest wait for the MetadataActor's answer (``timeline``).
ASK_TIMEOUT_S = 10.0


class NoRayckptError(LookupError):
    """The cluster runs no rayckpt (no MetadataActor in its namespace)."""


def join(address: str | None) -> str:
    """Join the cluster at ``address`` (``None``: ``RAY_ADDRESS``, else the one ``ray start`` left on this machine),
    quietly; the GCS address joined. Raises ``joining.ClusterUnreachableError`` when none answers."""
    target = cluster_address(address or "auto")
    if not ray.is_initialized():
        ray.init(address=target, namespace=NAMESPACE, logging_level=logging.ERROR, log_to_driver=False)
    return ray.get_runtime_context().gcs_address or target


def _metadata_actor() -> Any:
    try:
        return ray.get_actor(METADATA_ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        raise NoRayckptError(_NONE) from None


_NONE = (
    f"no rayckpt on this Ray cluster (no {METADATA_ACTOR_NAME!r} actor has published a status): nothing has "
    "saved or restored with rayckpt here yet"
)


def gather() -> dict[str, Any]:
    """The MetadataActor's last status snapshot (``MetadataActor.status``: every run) with ``nodes``: the
    memory tier of each live node (``MemoryHost.mem_usage``, as its ShardWriter last published it), and
    ``published_age_s``: how old the actor's snapshot is (it publishes every second).

    Raises:
        NoRayckptError: no MetadataActor ever published one on this cluster.
    """
    report = published.read(published.METADATA_KEY)
    if report is None:
        raise NoRayckptError(_NONE)
    now = time.time()
    alive = {n["NodeID"][:12] for n in ray.nodes() if n.get("Alive")}
    nodes = [n for node, n in sorted(published.read_nodes().items()) if node in alive]
    for n in nodes:
        n["published_age_s"] = max(0.0, now - n.pop("time", now))
    late = max(0.0, now - report["time"])
    for run in report["runs"]:  # ages as of now, not as of the snapshot
        for tier in run["tiers"].values():
            tier["age_s"] = max(0.0, now - tier["committed_at"])
        for save in run["in_flight"]:
            save["age_s"] += late
    return {**report, "now": now, "published_age_s": late, "nodes": nodes}


def timeline(run: str) -> dict[str, Any]:
    """``run``'s saves with their moments and its events (``MetadataActor.timeline``)."""
    return ray.get(_metadata_actor().timeline.remote(run), timeout=ASK_TIMEOUT_S)
