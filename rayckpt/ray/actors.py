"""The actors' names and how any process finds them: the one module every part of the Ray layer may import.

rayckpt runs two kinds of named, detached actors in the Ray namespace ``rayckpt``:
the MetadataActor (``rayckpt-metadata``, one per namespace, on the head node) and a
ShardWriter per node (``rayckpt-writer-<node id, 12 characters>``). This module knows
their names and looks them up; the modules that define the actors create them.

Handles are not kept here: ``ray.get_actor`` answers from the core worker's own
cache of named actors, which Ray drops when the actor dies, so a lookup after a
death finds the new actor (or none, and the caller creates it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

NAMESPACE = "rayckpt"
METADATA_ACTOR_NAME = "rayckpt-metadata"
WRITER_PREFIX = "rayckpt-writer-"
#: The resource only the head node has (Ray's ``HEAD_NODE_RESOURCE_NAME``).
HEAD_NODE_RESOURCE = "node:__internal_head__"
#: How long a process reuses its list of live ShardWriters (``writers``): a restore opens many files.
WRITERS_TTL_S = 2.0

_WRITERS: dict[str, Any] = {"at": -1e9, "found": {}}


def writer_name(node_id: str) -> str:
    """The ShardWriter's name on node ``node_id`` (its first 12 characters name it)."""
    return f"{WRITER_PREFIX}{node_id[:12]}"


def named(name: str, create: Callable[[], Any]) -> Any:
    """The live actor ``name`` of the rayckpt namespace; ``create()`` makes it when there is none.

    Args:
        name: the actor's name (``METADATA_ACTOR_NAME``, ``writer_name(node)``).
        create: starts the actor with ``get_if_exists=True``, so that two processes
            racing to create it get the same one.

    Returns:
        The actor's handle.
    """
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:  # none by that name (yet, or any more)
        return create()


def writers(fresh: bool = False) -> dict[str, Any]:
    """The ShardWriters of the live nodes: node id (its first 12 characters, as named) -> actor handle.

    Looked up at most every ``WRITERS_TTL_S`` seconds per process (``fresh``: now); a writer
    that died since is skipped where it is asked (``ask_writers``) and makes the next call look again.
    """
    now = time.monotonic()
    if fresh or now - _WRITERS["at"] > WRITERS_TTL_S:
        _WRITERS.update(found=_look_up_writers(), at=now)
    return dict(_WRITERS["found"])


def _look_up_writers() -> dict[str, Any]:
    alive = {n["NodeID"][:12] for n in ray.nodes() if n.get("Alive")}
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else entry
        if isinstance(entry, dict) and entry.get("namespace") != NAMESPACE:
            continue
        node = name[len(WRITER_PREFIX) :] if name.startswith(WRITER_PREFIX) else None
        if node in alive:
            try:
                found[node] = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:  # gone since it was listed
                pass
    return dict(sorted(found.items()))


def ask_writers(method: str, *args: Any) -> dict[str, Any]:
    """``method(*args)`` of every live ShardWriter: node -> answer (a writer that died meanwhile is left out)."""
    handles = writers()
    refs = {node: getattr(h, method).remote(*args) for node, h in handles.items()}
    out = {}
    for node, ref in refs.items():
        try:
            out[node] = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            _WRITERS["at"] = -1e9  # one is gone: look again next time
    return out
