"""A remote-looking filesystem over the local disk that counts ranged reads: object storage without S3.

``counting_filesystem()`` is a ``pyarrow.fs.PyFileSystem`` (so rayckpt treats it
as remote: no memory map, no ``preadv``) whose input files count every read
of shard-file bytes (``ReadStats``: requests, bytes, the most in flight at
once). A positional read of a ``PythonFile`` is one ``read`` call here: one GET.
``rendezvous=n`` makes each of the first ``n`` reads wait (up to ``MAX_WAIT_S``)
until ``n`` reads have started, which proves ``n`` run at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs

from tests.helpers.gated_fs import GatedHandler

MAX_WAIT_S = 30.0


@dataclass
class ReadStats:
    requests: int = 0
    bytes: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    started: int = 0
    sizes: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class CountingFile:
    """A file-like object for ``pa.PythonFile`` whose reads are counted in ``stats``."""

    def __init__(self, inner: pa.NativeFile, stats: ReadStats, rendezvous: int) -> None:
        self.inner = inner
        self.stats = stats
        self.rendezvous = rendezvous
        self.closed = False

    def read(self, nbytes: int = -1) -> bytes:
        s = self.stats
        with s.lock:
            s.in_flight += 1
            s.started += 1
            s.max_in_flight = max(s.max_in_flight, s.in_flight)
            wait = s.started <= self.rendezvous
        deadline = time.monotonic() + MAX_WAIT_S
        while wait and s.started < self.rendezvous and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            data = self.inner.read(nbytes)
        finally:
            with s.lock:
                s.in_flight -= 1
                s.requests += 1
                s.bytes += len(data)
                s.sizes.append(len(data))
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.inner.seek(pos, whence)

    def tell(self) -> int:
        return self.inner.tell()

    def size(self) -> int:
        return self.inner.size()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True
        self.inner.close()


class CountingHandler(GatedHandler):
    """The local disk; ``.arrow`` input files count their reads (other files are not shard bytes)."""

    def __init__(self, stats: ReadStats, rendezvous: int = 0) -> None:
        super().__init__(gate="")
        self.stats = stats
        self.rendezvous = rendezvous

    def __eq__(self, other: object) -> bool:
        return other is self

    def __hash__(self) -> int:
        return id(self)

    def get_type_name(self) -> str:
        return "counting"

    def open_input_file(self, path: str):
        inner = self.local.open_input_file(path)
        if not path.endswith(".arrow"):
            return inner
        return pa.PythonFile(CountingFile(inner, self.stats, self.rendezvous), mode="r")

    def open_output_stream(self, path: str, metadata):
        return self.local.open_output_stream(path, metadata=metadata)


def counting_filesystem(rendezvous: int = 0) -> tuple[pafs.PyFileSystem, ReadStats]:
    stats = ReadStats()
    return pafs.PyFileSystem(CountingHandler(stats, rendezvous)), stats
