"""What rayckpt's actors publish for ``rayckpt status``: a JSON snapshot each, in Ray's GCS key-value store.

The MetadataActor publishes its ``status()`` (``METADATA_KEY``) and each ShardWriter its node's memory
tier (``node_key``), every second. A reader then needs neither the actors' classes nor a call to
them: it joins the cluster and reads the keys (the actor classes' modules alone take longer to import
than the whole read). Every snapshot carries the ``time`` it was taken, so a reader sees how old it is.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..actors import NAMESPACE

logger = logging.getLogger(__name__)

#: The MetadataActor's snapshot.
METADATA_KEY = "status:metadata"
#: Prefix of the ShardWriters' snapshots, one per node.
NODE_PREFIX = "status:node:"


def node_key(node: str) -> str:
    """The key of ``node``'s ShardWriter snapshot."""
    return NODE_PREFIX + node


def publish(key: str, snapshot: dict[str, Any]) -> None:
    """Store ``snapshot`` as ``key`` (replacing the last one); a failure is logged at DEBUG, never raised."""
    from ray.experimental import internal_kv

    try:
        internal_kv._internal_kv_put(key, json.dumps(snapshot, default=str), overwrite=True, namespace=NAMESPACE)
    except Exception as exc:  # noqa: BLE001 - a status snapshot never fails its actor
        logger.debug("rayckpt: cannot publish %s: %s", key, exc)


def read(key: str) -> dict[str, Any] | None:
    """The snapshot stored as ``key`` (``None``: none)."""
    from ray.experimental import internal_kv

    data = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
    return None if data is None else json.loads(data)


def read_nodes() -> dict[str, dict[str, Any]]:
    """Every node's ShardWriter snapshot: node -> snapshot."""
    from ray.experimental import internal_kv

    keys = internal_kv._internal_kv_list(NODE_PREFIX, namespace=NAMESPACE)
    found = {}
    for key in keys:
        name = key.decode() if isinstance(key, bytes) else key
        snapshot = read(name)
        if snapshot is not None:
            found[name[len(NODE_PREFIX) :]] = snapshot
    return found
