"""Every metric rayckpt exports: its name, kind, tags and what it measures. The one list they come from.

``rayckpt.ray.metrics`` records them through ``ray.util.metrics``; the Grafana
dashboard (``observe.dashboard``) queries them; the docs' metric table
(docs/observability.md) is checked against them. Ray's Prometheus export names
each ``ray_<name>``, counters with a ``_total`` suffix and histograms as
``_bucket`` / ``_sum`` / ``_count`` series (``exported``).

Tags: ``run`` (the run's name), ``tier`` (``memory`` or ``storage``; for restored
bytes where they came from: ``memory_local``, ``memory_peer`` or ``storage``),
``rank``, ``node`` (a node id's first 12 hex digits) and ``reason``.
"""

from __future__ import annotations

from dataclasses import dataclass

HISTOGRAM = "histogram"
COUNTER = "counter"
GAUGE = "gauge"

#: Bucket bounds of every seconds histogram.
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass(frozen=True, kw_only=True)
class MetricDef:
    """One metric: ``name`` (without Ray's ``ray_`` prefix), ``kind``, ``description``, ``tags``, ``unit``
    (Grafana's unit id for its panels: ``s``, ``bytes``, ``Bps``, ``dateTimeAsUnix``..., ``short``: a count)."""

    name: str
    kind: str
    description: str
    tags: tuple[str, ...]
    unit: str = "short"

    def exported(self, series: str = "") -> str:
        """The name Ray's Prometheus export gives it: ``series`` is ``bucket``, ``sum`` or ``count`` of a histogram."""
        name = f"ray_{self.name}"
        if self.kind == COUNTER:
            return f"{name}_total"
        if self.kind == HISTOGRAM:
            if series not in ("bucket", "sum", "count"):
                raise ValueError(f"metric {self.name}: a histogram's series is bucket, sum or count, not {series!r}")
            return f"{name}_{series}"
        return name


def _d(name: str, kind: str, description: str, tags: tuple[str, ...], unit: str = "short") -> MetricDef:
    return MetricDef(name=name, kind=kind, description=description, tags=tags, unit=unit)


METRICS: tuple[MetricDef, ...] = (
    # saves
    _d(
        "rayckpt_save_stall_seconds",
        HISTOGRAM,
        "Time a training worker is blocked by a save (plan and copy into shared memory)",
        ("run", "tier", "rank"),
        "s",
    ),
    _d(
        "rayckpt_persist_seconds",
        HISTOGRAM,
        "Time a ShardWriter takes to write and fsync a rank's shard",
        ("run", "tier"),
        "s",
    ),
    _d("rayckpt_commit_seconds", HISTOGRAM, "From save start to committed manifest", ("run", "tier"), "s"),
    _d("rayckpt_bytes_written", COUNTER, "Shard bytes written", ("run", "tier"), "bytes"),
    _d(
        "rayckpt_write_throughput_bytes_per_second",
        GAUGE,
        "Last shard write throughput (bytes / seconds of one rank's share)",
        ("run", "tier"),
        "Bps",
    ),
    _d("rayckpt_checkpoints_committed", COUNTER, "Checkpoints committed", ("run", "tier")),
    _d("rayckpt_checkpoints_failed", COUNTER, "Saves that failed and were rolled back", ("run", "tier")),
    _d("rayckpt_saves_in_flight", GAUGE, "Saves begun and not yet committed or rolled back", ("run", "tier")),
    _d(
        "rayckpt_last_commit_timestamp_seconds",
        GAUGE,
        "When the newest committed checkpoint committed (Unix seconds): its age is time() minus this",
        ("run", "tier"),
        "dateTimeAsUnix",
    ),
    _d(
        "rayckpt_checkpoint_age_seconds",
        GAUGE,
        "Seconds since the newest committed checkpoint committed: the work a failure now would lose",
        ("run", "tier"),
        "s",
    ),
    _d(
        "rayckpt_memory_saves_skipped",
        COUNTER,
        "Memory saves not made: busy (the one before was unwritten) or no_room (sent to storage instead)",
        ("run", "reason"),
    ),
    _d(
        "rayckpt_run_active",
        GAUGE,
        "1 while the run's rank 0 is alive (set again every second; gone within Ray's export interval "
        "after it ends): a finished run's checkpoint age alerts nobody",
        ("run",),
    ),
    # the memory tier, per node
    _d(
        "rayckpt_memory_held_bytes",
        GAUGE,
        "Bytes the node's memory tier holds (shards and replicas)",
        ("node",),
        "bytes",
    ),
    _d("rayckpt_memory_budget_bytes", GAUGE, "The node's memory tier budget", ("node",), "bytes"),
    # restores and loads
    _d(
        "rayckpt_restore_seconds",
        HISTOGRAM,
        "Time Checkpointer.restore took on a worker, by the tier it restored from",
        ("run", "tier"),
        "s",
    ),
    _d(
        "rayckpt_restored_bytes",
        COUNTER,
        "Bytes Checkpointer.restore read, by where from: memory_local, memory_peer, storage",
        ("run", "tier"),
        "bytes",
    ),
    _d(
        "rayckpt_restore_fallbacks",
        COUNTER,
        "Restores that passed over a damaged checkpoint for the one before it",
        ("run",),
    ),
    _d("rayckpt_load_seconds", HISTOGRAM, "Time a worker spends loading", ("run", "rank"), "s"),
    _d("rayckpt_bytes_read", COUNTER, "Shard bytes read by loads", ("run", "rank"), "bytes"),
    _d("rayckpt_bytes_needed", COUNTER, "Payload bytes the loads' targets needed", ("run", "rank"), "bytes"),
    _d(
        "rayckpt_bytes_fetched",
        COUNTER,
        "Bytes loads transferred from storage, gap bytes included",
        ("run", "rank"),
        "bytes",
    ),
    _d("rayckpt_read_requests", COUNTER, "Read requests loads made to storage (GETs)", ("run", "rank")),
    _d("rayckpt_plan_seconds", HISTOGRAM, "Time the MetadataActor spends computing a load plan", ("run",), "s"),
)

#: Name -> definition.
BY_NAME: dict[str, MetricDef] = {m.name: m for m in METRICS}


def metric(name: str) -> MetricDef:
    """The definition of ``name``; a ``KeyError`` naming the known ones when there is none."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"no rayckpt metric {name!r}; known: {', '.join(sorted(BY_NAME))}") from None
