"""Writing one shard file (``format.shard_file.write_shard_file``): the checksums computed beside the write,
and a local file's written part sent on to the disk while the rest is written (``CheckpointDir.start_sync``)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from rayckpt.format.boxes import Box
from rayckpt.format.shard_file import SYNC_AHEAD_BYTES, ChunkSpec, block_checksums, write_shard_file
from rayckpt.storage import checkpoint_dir
from rayckpt.storage.checkpoint_dir import SYNC_FILE_RANGE_WRITE, CheckpointDir

BLOCK = 1 << 16


def chunks(sizes: list[int]) -> list:
    rng = np.random.default_rng(0)
    return [
        ChunkSpec(f"k{i}", "float32", Box((0,), (n // 4,))).with_data(rng.integers(0, 255, n, dtype=np.uint8))
        for i, n in enumerate(sizes)
    ]


class Recording(CheckpointDir):
    """A local ``CheckpointDir`` that records the ranges it was asked to send on to the disk."""

    def __init__(self, path: str) -> None:
        base = CheckpointDir.resolve(path)
        super().__init__(base.fs, base.fs_path, base.uri)
        self.started: list[tuple[str, int, int]] = []

    def start_sync(self, rel: str, offset: int, length: int) -> None:
        self.started.append((rel, offset, length))
        super().start_sync(rel, offset, length)


def test_every_chunk_s_checksums_are_its_blocks_and_the_written_part_goes_to_disk_in_order(tmp_path):
    ckdir = Recording(str(tmp_path))
    data = chunks([SYNC_AHEAD_BYTES // 2, SYNC_AHEAD_BYTES // 2 + 4096, 3 * SYNC_AHEAD_BYTES, 1000])
    written, size = write_shard_file(ckdir, "a.arrow", data, BLOCK, "save-1")
    assert [w.checksums for w in written] == [block_checksums(memoryview(c.data).cast("B"), BLOCK) for c in data]
    with pa.memory_map(str(tmp_path / "a.arrow")) as f:
        body = f.read_buffer()
    for w, c in zip(written, data):
        assert body[w.byte_offset : w.byte_offset + w.byte_length] == memoryview(c.data).cast("B")
    # Consecutive ranges from the start, each at least SYNC_AHEAD_BYTES, once the written part reaches it.
    assert [r[0] for r in ckdir.started] == ["a.arrow", "a.arrow"]
    assert ckdir.started[0][1] == 0 and ckdir.started[1][1] == sum(ckdir.started[0][1:])
    assert all(length >= SYNC_AHEAD_BYTES for _, _, length in ckdir.started)
    assert sum(ckdir.started[-1][1:]) <= size


def test_start_sync_asks_the_kernel_for_the_range_of_a_local_file_only(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(checkpoint_dir, "_SYNC_FILE_RANGE", lambda fd, off, n, flags: calls.append((off, n, flags)))
    (tmp_path / "f").write_bytes(b"x" * 100)
    CheckpointDir.resolve(str(tmp_path)).start_sync("f", 10, 50)
    CheckpointDir.resolve(str(tmp_path)).start_sync("missing", 0, 50)  # no file: nothing asked, nothing raised
    elsewhere = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())  # not a LocalFileSystem: not local
    CheckpointDir(elsewhere, "", "subtree").start_sync("f", 0, 1)
    assert calls == [(10, 50, SYNC_FILE_RANGE_WRITE)]


def test_the_c_library_s_sync_file_range_is_found_and_accepts_a_written_file(tmp_path):
    assert checkpoint_dir._SYNC_FILE_RANGE is not None  # Linux with glibc, as CI runs
    (tmp_path / "f").write_bytes(os.urandom(1 << 20))
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert checkpoint_dir._SYNC_FILE_RANGE(fd, 0, 1 << 20, SYNC_FILE_RANGE_WRITE) == 0
    finally:
        os.close(fd)


class _Failing:
    """A sink that breaks once ``limit`` bytes are written: a full disk in the middle of a shard file."""

    def __init__(self, limit: int) -> None:
        self.limit, self.size, self.closed = limit, 0, False

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if self.size + n > self.limit:
            raise OSError(28, os.strerror(28))
        self.size += n
        return n

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_a_write_failing_midway_raises_its_error_and_leaves_no_checksum_running(tmp_path, monkeypatch):
    ckdir = CheckpointDir.resolve(str(tmp_path))
    sink = _Failing(limit=SYNC_AHEAD_BYTES)
    monkeypatch.setattr(ckdir, "open_output", lambda rel: pa.PythonFile(sink, mode="w"))
    with pytest.raises(OSError, match="No space left on device"):
        write_shard_file(ckdir, "a.arrow", chunks([SYNC_AHEAD_BYTES // 2] * 8), BLOCK, "save-1")
    assert not [t for t in threading.enumerate() if t.name.startswith("rayckpt-sum")]
