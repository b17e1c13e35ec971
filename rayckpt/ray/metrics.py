"""Checkpoint metrics through ``ray.util.metrics``, as ``observe.metric_defs`` defines them.

Names start with ``rayckpt_``; Ray's Prometheus export shows them as
``ray_rayckpt_*``. Every call passes each of the metric's tags (a missing one is
exported empty). Outside a Ray worker or driver the calls do nothing.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..observe.metric_defs import COUNTER, GAUGE, HISTOGRAM, SECONDS_BUCKETS, metric

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_METRICS: dict[str, Any] = {}


def _get(name: str) -> Any:
    import ray

    if not ray.is_initialized():
        return None
    with _LOCK:
        made = _METRICS.get(name)
        if made is None:
            from ray.util import metrics

            d = metric(name)
            if d.kind == HISTOGRAM:
                made = metrics.Histogram(
                    name, description=d.description, boundaries=list(SECONDS_BUCKETS), tag_keys=d.tags
                )
            elif d.kind == COUNTER:
                made = metrics.Counter(name, description=d.description, tag_keys=d.tags)
            else:
                made = metrics.Gauge(name, description=d.description, tag_keys=d.tags)
            _METRICS[name] = made
        return made


def _tags(name: str, tags: dict[str, Any]) -> dict[str, str]:
    return {k: str(tags.get(k, "")) for k in metric(name).tags}


def observe(name: str, value: float, **tags: Any) -> None:
    """Record ``value`` on histogram or gauge ``name``."""
    made = _get(name)
    if made is None:
        return
    if metric(name).kind == GAUGE:
        made.set(value, tags=_tags(name, tags))
    else:
        made.observe(value, tags=_tags(name, tags))


def inc(name: str, value: float = 1.0, **tags: Any) -> None:
    """Add ``value`` to counter ``name`` (Ray counters refuse 0: a rank with nothing to write is normal)."""
    if value <= 0:
        return
    made = _get(name)
    if made is not None:
        made.inc(value, tags=_tags(name, tags))


def start_at_zero(name: str, **tags: Any) -> None:
    """Export counter ``name`` with ``tags`` at 0 before its first event (a run's failed saves, say), so that a
    dashboard shows 0, not "no data". Ray's ``Counter.inc`` refuses 0; its recording method takes it. Where
    that method is gone, the series appears at its first event instead."""
    made = _get(name)
    if made is None:
        return
    try:
        made._record(0.0, tags=_tags(name, tags))
    except Exception as exc:  # noqa: BLE001 - a metric never fails a save
        logger.debug("rayckpt: cannot export %s at 0: %s", name, exc)
