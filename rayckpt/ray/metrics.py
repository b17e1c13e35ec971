"""Checkpoint metrics through ``ray.util.metrics``.

Names start with ``rayckpt_``; Ray's Prometheus export shows them as
``ray_rayckpt_*``. Every metric is tagged with ``run``; per-rank ones with
``rank`` too. Outside a Ray worker or driver the calls do nothing.
"""

from __future__ import annotations

import threading
from typing import Any

_LOCK = threading.Lock()
_METRICS: dict[str, Any] = {}

_SECONDS_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]

_DEFS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # name: (kind, description, tag keys)
    "rayckpt_save_stall_seconds": ("histogram", "Time a training worker is blocked by a save", ("run", "rank")),
    "rayckpt_persist_seconds": ("histogram", "Time a ShardWriter takes to write and fsync a rank's shard", ("run",)),
    "rayckpt_commit_seconds": ("histogram", "From save start to committed manifest", ("run",)),
    "rayckpt_bytes_written": ("counter", "Shard bytes written", ("run",)),
    "rayckpt_write_throughput_bytes_per_second": ("gauge", "Last shard write throughput", ("run",)),
    "rayckpt_load_seconds": ("histogram", "Time a worker spends loading", ("run", "rank")),
    "rayckpt_bytes_read": ("counter", "Shard bytes read by loads", ("run", "rank")),
    "rayckpt_bytes_needed": ("counter", "Payload bytes the loads' targets needed", ("run", "rank")),
    "rayckpt_bytes_fetched": ("counter", "Bytes loads transferred from storage, gap bytes included", ("run", "rank")),
    "rayckpt_read_requests": ("counter", "Read requests loads made to storage (GETs)", ("run", "rank")),
    "rayckpt_plan_seconds": ("histogram", "Time the MetadataActor spends computing a load plan", ("run",)),
    "rayckpt_checkpoints_committed": ("counter", "Checkpoints committed", ("run",)),
    "rayckpt_checkpoints_failed": ("counter", "Saves that failed and were rolled back", ("run",)),
    "rayckpt_restore_fallbacks": (
        "counter",
        "Restores that passed over a damaged checkpoint for the one before it",
        ("run",),
    ),
    "rayckpt_restored_bytes": (
        "counter",
        "Bytes Checkpointer.restore read, by tier: memory_local, memory_peer, storage",
        ("run", "tier"),
    ),
}


def _get(name: str) -> Any:
    import ray

    if not ray.is_initialized():
        return None
    with _LOCK:
        metric = _METRICS.get(name)
        if metric is None:
            from ray.util import metrics

            kind, desc, tags = _DEFS[name]
            if kind == "histogram":
                metric = metrics.Histogram(name, description=desc, boundaries=_SECONDS_BUCKETS, tag_keys=tags)
            elif kind == "counter":
                metric = metrics.Counter(name, description=desc, tag_keys=tags)
            else:
                metric = metrics.Gauge(name, description=desc, tag_keys=tags)
            _METRICS[name] = metric
        return metric


def _tags(name: str, tags: dict[str, Any]) -> dict[str, str]:
    return {k: str(tags.get(k, "")) for k in _DEFS[name][2]}


def observe(name: str, value: float, **tags: Any) -> None:
    """Record ``value`` on histogram or gauge ``name``."""
    metric = _get(name)
    if metric is None:
        return
    if _DEFS[name][0] == "gauge":
        metric.set(value, tags=_tags(name, tags))
    else:
        metric.observe(value, tags=_tags(name, tags))


def inc(name: str, value: float = 1.0, **tags: Any) -> None:
    """Add ``value`` to counter ``name`` (Ray counters refuse 0: a rank with nothing to write is normal)."""
    if value <= 0:
        return
    metric = _get(name)
    if metric is not None:
        metric.inc(value, tags=_tags(name, tags))
