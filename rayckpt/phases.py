"""Where one save's or load's time went on this rank: ``SaveInfo.phases`` and ``LoadInfo.phases``.

A ``PhaseClock`` is made per operation (``timed``) and held in a context
variable, so the parts of the engine it calls mark their phases without being
handed it (``with phase("fsync"): ...``); outside a timed operation a mark costs
one lookup. Phases nest and are exclusive: time in an inner phase is not also
counted in the outer one, and what no phase claims is ``other``, so the phases
add up to ``total``. Work done on other threads (the load's read pool) is added
with ``add`` as thread-seconds (``*_threads`` names): it overlaps the calling
thread's phases and is not part of ``total``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("rayckpt.phases")

_CLOCK: contextvars.ContextVar[PhaseClock | None] = contextvars.ContextVar("rayckpt_phase_clock", default=None)


class PhaseClock:
    """Exclusive seconds per phase of one operation on this rank."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._stack: list[list] = []  # [name, started] of each open phase, innermost last
        self._began = time.perf_counter()
        self._lock = threading.Lock()

    def phase(self, name: str) -> _Phase:
        """A context manager timing ``name`` (exclusive of the phases opened inside it)."""
        return _Phase(self, name)

    def _enter(self, name: str) -> None:
        now = time.perf_counter()
        if self._stack:  # the outer phase pauses
            outer = self._stack[-1]
            self._charge(outer[0], now - outer[1])
        self._stack.append([name, now])

    def _exit(self) -> None:
        now = time.perf_counter()
        name, started = self._stack.pop()
        self._charge(name, now - started)
        if self._stack:
            self._stack[-1][1] = now  # the outer phase resumes

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to ``name`` from any thread (work outside the calling thread's timeline)."""
        self._charge(name, seconds)

    def _charge(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def result(self) -> dict[str, float]:
        """The phases in seconds, with ``other`` (unclaimed) and ``total`` (the operation's wall time)."""
        total = time.perf_counter() - self._began
        out = dict(self.seconds)
        claimed = sum(v for k, v in out.items() if not k.endswith("_threads"))
        out["other"] = max(0.0, total - claimed)
        out["total"] = total
        return {k: round(v, 6) for k, v in out.items()}


@contextmanager
def timed() -> Iterator[PhaseClock]:
    """Time one operation's phases (this thread and what it calls); nested ``timed`` calls keep the outer clock."""
    outer = _CLOCK.get()
    if outer is not None:
        yield outer
        return
    clock = PhaseClock()
    token = _CLOCK.set(clock)
    try:
        yield clock
    finally:
        _CLOCK.reset(token)


class _Phase:
    """One phase of a ``PhaseClock`` (a plain context manager: marks sit on per-read paths of a load)."""

    __slots__ = ("clock", "name")

    def __init__(self, clock: PhaseClock, name: str) -> None:
        self.clock, self.name = clock, name

    def __enter__(self) -> None:
        self.clock._enter(self.name)

    def __exit__(self, *exc: object) -> None:
        self.clock._exit()


_NOTHING = contextlib.nullcontext()


def phase(name: str) -> _Phase | contextlib.nullcontext:
    """Mark a phase of the operation being timed (nothing when none is)."""
    clock = _CLOCK.get()
    return _NOTHING if clock is None else _Phase(clock, name)


def current() -> PhaseClock | None:
    """The clock of the operation being timed on this thread, to hand to worker threads (``add``)."""
    return _CLOCK.get()


def log_phases(what: str, where: str, rank: int, phases: dict[str, float]) -> None:
    """One DEBUG line per operation: ``rayckpt: save to <where> on rank R: <phase> <seconds> s, ...``, longest first."""
    if logger.isEnabledFor(logging.DEBUG):
        parts = ", ".join(f"{k} {v:.4f} s" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]))
        logger.debug("rayckpt: %s %s on rank %d: %s", what, where, rank, parts)
