"""The lines rank 0 of a TorchTrainer run prints when a save settles: ``rayckpt: <run> committed step N (...)``.

Ray forwards a worker's output to the driver (prefixed ``(RayTrainWorker pid=...)``),
so these lines are in the job's logs next to the training loop's own. Rank 0
prints them: every rank learns the same outcome. Written to stderr directly:
Ray Train's patched ``print`` would log a line twice.
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

from ..bounded import BoundedMap
from ..storage.catalog import CatalogEntry

#: Save ids remembered as announced: enough for the few saves a rank can have in sight at once.
_REMEMBERED = 16


def commit_line(run: str, step: int | None, nbytes: int, seconds: float | None) -> str:
    """``rayckpt: <run> committed step N (<bytes>, <seconds>)``: ``seconds`` from the save's first report
    to its commit, as the MetadataActor measured them (left out when not known)."""
    took = f", {seconds:.2f} s" if seconds is not None else ""
    return f"rayckpt: {run} committed step {step} ({nbytes / 2**20:.1f} MiB{took})"


def failure_line(run: str, step: int | None, error: str) -> str:
    """``rayckpt: <run> failed to save step N, nothing committed: <error>``."""
    return f"rayckpt: {run} failed to save step {step}, nothing committed: {error}"


class SaveAnnouncer:
    """Prints each save's outcome once, on rank 0 (any thread may learn it first)."""

    def __init__(self, run: str, rank: int, stream: TextIO | None = None) -> None:
        self.run = run
        self.rank = rank
        self._stream = stream
        self._lock = threading.Lock()
        self._announced: BoundedMap[str, None] = BoundedMap(_REMEMBERED)

    def announce(
        self,
        save_id: str,
        step: int | None,
        entry: CatalogEntry | None = None,
        error: str | None = None,
        seconds: float | None = None,
    ) -> None:
        """The outcome of save ``save_id`` of ``step``: its catalog ``entry`` (committed or failed) and
        ``seconds`` it took to commit by the MetadataActor's clock, or the ``error`` it failed with."""
        if self.rank != 0:
            return
        with self._lock:
            if save_id in self._announced:
                return
            self._announced.put(save_id, None)
        if entry is not None and entry.status == "committed":
            line = commit_line(self.run, step, entry.bytes, seconds)
        else:
            line = failure_line(self.run, step, error or (entry.error if entry is not None else None) or "unknown")
        stream = self._stream or sys.stderr
        stream.write(line + "\n")
        stream.flush()
