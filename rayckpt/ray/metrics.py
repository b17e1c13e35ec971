"""Checkpoint metrics through ``ray.util.metrics``, as ``observe.metric_defs`` defines them.

Names start with ``rayckpt_``; Ray's Prometheus export shows them as
``ray_rayckpt_*``. Every call passes each of the metric's tags (a missing one is
exported empty). Outside a Ray worker or driver the calls do nothing.

Where an event is recorded decides whether a dashboard sees it. Ray sends a
process's metrics to its node's export port every report interval (10 s by
default), so a training worker killed, or ended by Ray Train, loses what it
recorded since its last report. Events of a training worker (a save's stall, a
restore, a load) therefore go to the MetadataActor, which lives on the head node
for the cluster's life and records them (``send``, from a thread of the worker: the
caller only queues them). A gauge that says a process
lives is set again every second from that process (``keep_set``): Ray's export
drops a gauge that is not set for two report intervals.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

from ..observe.metric_defs import COUNTER, GAUGE, HISTOGRAM, SECONDS_BUCKETS, metric
from .actors import METADATA_ACTOR_NAME, NAMESPACE

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


def record(name: str, value: float, **tags: Any) -> None:
    """``inc`` a counter, ``observe`` a histogram or gauge: what ``name``'s kind takes."""
    if metric(name).kind == COUNTER:
        inc(name, value, **tags)
    else:
        observe(name, value, **tags)


def send(name: str, value: float, **tags: Any) -> None:
    """Record an event of a training worker on the MetadataActor (``MetadataActor.record_metrics``); here
    when there is no MetadataActor (nothing of rayckpt's runs on this cluster yet).

    The caller only queues the sample: a thread of this process sends what is queued, so a save's
    caller never waits for an actor call. ``flush`` waits until what was queued has been sent.
    """
    import ray

    if not ray.is_initialized() or (metric(name).kind == COUNTER and value <= 0):
        return
    with _LOCK:
        _OUTBOX.append((name, float(value), _tags(name, tags)))
        _QUEUED.set()
        if not _SENDER or not _SENDER[0].is_alive():
            _SENDER[:] = [threading.Thread(target=_sending, name="rayckpt-metrics", daemon=True)]
            _SENDER[0].start()


def flush(timeout: float = 10.0) -> bool:
    """Wait until every sample ``send`` queued has been sent (or recorded here); whether it was in ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        with _LOCK:
            if not _OUTBOX and _IN_HAND[0] == 0:
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


#: Samples ``send`` queued, oldest first, and how many the sending thread holds now.
_OUTBOX: list[tuple[str, float, dict[str, str]]] = []
_IN_HAND = [0]
_QUEUED = threading.Event()
_SENDER: list[threading.Thread] = []


def _sending() -> None:
    while True:
        _QUEUED.wait()
        with _LOCK:
            batch = list(_OUTBOX)
            _OUTBOX.clear()
            _QUEUED.clear()
            _IN_HAND[0] = len(batch)
        try:
            deliver(batch)
        finally:
            with _LOCK:
                _IN_HAND[0] = 0


def deliver(batch: list[tuple[str, float, dict[str, str]]]) -> None:
    """Send ``batch`` to the MetadataActor in one call (not waited for); record it here when there is none."""
    import ray

    if not batch:
        return
    try:
        actor = ray.get_actor(METADATA_ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:  # none by that name
        for name, value, tags in batch:
            record(name, value, **tags)
        return
    except Exception as exc:  # noqa: BLE001 - a metric never fails what it measures
        logger.debug("rayckpt: %d metric sample(s) not sent to the MetadataActor: %s", len(batch), exc)
        return
    try:
        actor.record_metrics.remote(batch)
    except Exception as exc:  # noqa: BLE001 - a metric never fails what it measures
        logger.debug("rayckpt: %d metric sample(s) not sent to the MetadataActor: %s", len(batch), exc)


#: Every second, ``_keep_setting`` sets these gauges again while their owner lives: (name, tags) -> (value, owner).
_KEPT: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[float, weakref.ref]] = {}
_KEEPER: list[threading.Thread] = []
KEEP_SET_EVERY_S = 1.0


def keep_set(name: str, value: float, owner: object, **tags: Any) -> None:
    """Set gauge ``name`` now and again every ``KEEP_SET_EVERY_S`` while ``owner`` lives in this process.

    Ray's export drops a gauge not set for two report intervals, so the gauge is exported while both
    the owner and its process live, and is gone from the export port that long after either ends.
    """
    if _get(name) is None:
        return
    key = (name, tuple(sorted(_tags(name, tags).items())))
    with _LOCK:
        _KEPT[key] = (value, weakref.ref(owner))
        if not _KEEPER or not _KEEPER[0].is_alive():
            _KEEPER[:] = [threading.Thread(target=_keep_setting, name="rayckpt-gauges", daemon=True)]
            _KEEPER[0].start()
    observe(name, value, **tags)


def _keep_setting() -> None:
    while True:
        time.sleep(KEEP_SET_EVERY_S)
        with _LOCK:
            live = {k: v for k, v in _KEPT.items() if v[1]() is not None}
            _KEPT.clear()
            _KEPT.update(live)
            if not live:
                _KEEPER.clear()
                return
        for (name, tags), (value, _) in live.items():
            observe(name, value, **dict(tags))
