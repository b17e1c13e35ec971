"""Disk helpers shared by the benchmarks: the page cache and the raw-disk anchor."""

from __future__ import annotations

import os

#: Piece size of the raw-disk anchor's writes and reads (and of the page-cache warm-up).
RAW_BLOCK = 8 * 1024 * 1024


def files_under(path: str) -> list[str]:
    found = []
    for root, _dirs, names in os.walk(path):
        found.extend(os.path.join(root, n) for n in names)
    return sorted(found)


def dir_bytes(path: str) -> tuple[int, int]:
    files = files_under(path)
    return sum(os.path.getsize(f) for f in files), len(files)


def evict(paths: list[str]) -> bool:
    """fsync then drop each file's pages from the page cache; False if fadvise is unavailable."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def warm_up(paths: list[str]) -> None:
    """Read ``paths`` once so their pages are in the page cache (for the warm loads)."""
    buf = bytearray(RAW_BLOCK)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def write_raw(path: str, nbytes: int, blob: memoryview, fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            view = blob[: min(left, len(blob))]
            while len(view):
                n = os.write(fd, view)
                view = view[n:]
                left -= n
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_raw(path: str) -> int:
    buf = bytearray(RAW_BLOCK)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return total
            total += n
