"""The ShardWriter's side of staging: opening a rank's staged region, and sweeping what dead processes left.

A rank's staging file has no name (``staging``): the writer opens it through
``/proc/<rank pid>/fd/<fd>`` and checks its inode, so a descriptor number the rank
reused is refused. Named ``rayckpt-stage-<pid>-*`` files of processes that are gone
(an older rayckpt's, or a process killed between creating and unlinking one) are
removed by the node's ShardWriter when it starts and every ``SWEEP_INTERVAL_S``.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..shm import POPULATED, PREFIX, StagedRegion, staging_dir

#: How often a ShardWriter removes named staging files of processes that are gone.
SWEEP_INTERVAL_S = 60.0


@contextmanager
def open_region(region: StagedRegion) -> Iterator[list[memoryview]]:
    """Read-only views of a staged region's chunks (for the ShardWriter)."""
    gone = f"staging file {region.path} is gone: the rank that staged it released it or exited"
    try:
        fd = os.open(region.path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(gone) from None
    except PermissionError as exc:  # /proc/<pid>/fd of another process needs the same user and a dumpable process
        raise PermissionError(
            f"cannot open staging file {region.path} of the rank's process: {exc}; "
            "stage through Ray's object store instead (staging='object_store' or RAYCKPT_STAGING=object_store)"
        ) from None
    try:
        stat = os.fstat(fd)
        if region.inode and stat.st_ino != region.inode:  # the rank closed it and reused the descriptor
            raise FileNotFoundError(f"{gone} (the descriptor now names another file)")
        size = stat.st_size
        end = max((o + n for o, n in region.spans), default=0)
        if end > size:
            raise ValueError(f"staging file {region.path} has {size} bytes, the region needs {end}")
        mapped = mmap.mmap(fd, size, flags=POPULATED, prot=mmap.PROT_READ) if size else None
    finally:
        os.close(fd)
    if mapped is None:
        yield [memoryview(b"") for _ in region.spans]
        return
    whole = memoryview(mapped)
    views = [whole[o : o + n] for o, n in region.spans]
    try:
        yield views
    finally:
        for v in views:
            v.release()
        whole.release()
        try:
            mapped.close()
        except BufferError:  # a caller kept a view: the mapping goes when it does
            pass


def sweep_stale(directory: str | None = None) -> list[str]:
    """Remove staging files whose process is gone from ``directory`` (default ``staging_dir()``); return their names."""
    directory = directory or staging_dir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid_text = name[len(PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


class StaleSweeper:
    """``sweep_stale`` of ``directory`` now and then every ``interval_s`` seconds, on a daemon thread.

    The node's ShardWriter holds one, so named staging files of processes that are
    gone do not wait for the next save on the node to be removed.
    """

    def __init__(self, directory: str | None = None, interval_s: float = SWEEP_INTERVAL_S) -> None:
        self.directory = directory or staging_dir()
        self.interval_s = interval_s
        #: Names removed so far, oldest first.
        self.removed: list[str] = []
        self._stop = threading.Event()
        self.removed += sweep_stale(self.directory)
        self._thread = threading.Thread(target=self._run, name="rayckpt-stale-sweeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.removed += sweep_stale(self.directory)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
