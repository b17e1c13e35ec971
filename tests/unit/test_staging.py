"""The reusable shared-memory staging buffer, without Ray."""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal

import pytest
import torch

from rayckpt.ray.rank.staging import StagingBuffer, StagingUnavailable, layout, staged_size
from rayckpt.ray.shm import PREFIX, SHM_DIR, SHM_DIR_ENV, StagedRegion, created_in, staging_dir
from rayckpt.ray.writer.regions import StaleSweeper, open_region, sweep_stale


@pytest.fixture
def buffer(tmp_path):
    b = StagingBuffer(str(tmp_path))
    yield b
    b.close()


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def staged_files(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(PREFIX))


def held_by(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_layout_aligns_every_chunk_to_64_bytes():
    spans, total = layout([10, 64, 0, 65])
    assert spans == ((0, 10), (64, 64), (128, 0), (128, 65))
    assert total == 256


def test_copy_now_spreads_large_pieces_over_threads_byte_for_byte(buffer, monkeypatch):
    from rayckpt.engine.device import DeviceToHost
    from rayckpt.ray.rank import staging

    monkeypatch.setattr(staging, "SLICE_BYTES", 64)
    g = torch.Generator().manual_seed(0)
    pieces = [torch.randn(1000, generator=g), torch.randn(7, generator=g), torch.randn(6, 9, generator=g)[:, 1:4]]
    region = buffer.place(pieces, "node-a")
    to_host = DeviceToHost()
    buffer.copy_now(list(zip(pieces, region.spans)), to_host, threads=3)  # the first in slices, on threads
    to_host.wait()
    with open_region(region) as views:
        assert [bytes(v) for v in views] == [as_bytes(p) for p in pieces]


def _copying_threads(monkeypatch) -> set[str]:
    """The names of the threads ``np.copyto`` runs on from now on (staging's copies)."""
    import threading

    import numpy as np

    from rayckpt.ray.rank import staging

    seen: set[str] = set()
    copyto = np.copyto

    def recorded(dst, src):
        seen.add(threading.current_thread().name)
        copyto(dst, src)

    monkeypatch.setattr(staging.np, "copyto", recorded)
    return seen


def test_copy_now_spreads_a_share_of_many_small_pieces_over_threads(buffer, monkeypatch):
    from rayckpt.engine.device import DeviceToHost
    from rayckpt.ray.rank import staging

    monkeypatch.setattr(staging, "SLICE_BYTES", 64)
    seen = _copying_threads(monkeypatch)
    g = torch.Generator().manual_seed(1)
    pieces = [torch.randn(5, generator=g) for _ in range(40)]  # 20 bytes each, none a slice's size
    region = buffer.place(pieces, "node-a")
    buffer.copy_now(list(zip(pieces, region.spans)), DeviceToHost(), threads=2)
    assert seen and all(name.startswith("rayckpt-stage") for name in seen)
    with open_region(region) as views:
        assert [bytes(v) for v in views] == [as_bytes(p) for p in pieces]


def test_copy_now_copies_a_small_share_on_the_callers_thread(buffer, monkeypatch):
    import threading

    from rayckpt.engine.device import DeviceToHost
    from rayckpt.ray.rank import staging

    monkeypatch.setattr(staging, "SLICE_BYTES", 64)
    seen = _copying_threads(monkeypatch)
    pieces = [torch.arange(6, dtype=torch.float32), torch.arange(4, dtype=torch.int64)]  # 56 bytes: under two slices
    region = buffer.place(pieces, "node-a")
    buffer.copy_now(list(zip(pieces, region.spans)), DeviceToHost(), threads=2)
    assert seen == {threading.current_thread().name}
    with open_region(region) as views:
        assert [bytes(v) for v in views] == [as_bytes(p) for p in pieces]


def test_pieces_of_any_dtype_and_strides_are_staged_byte_for_byte(buffer, tmp_path):
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 10, generator=g)
    pieces = [
        wide[:, 2:5],  # not contiguous
        torch.randn(33, generator=g).to(torch.bfloat16),
        torch.arange(5, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.tensor(3.5),  # a scalar
        torch.zeros(0),
    ]
    region = buffer.stage(pieces, "node-a")
    assert region.node_id == "node-a" and region.nbytes == sum(len(as_bytes(p)) for p in pieces)
    with open_region(region) as views:
        assert [bytes(v) for v in views] == [as_bytes(p) for p in pieces]
    assert staged_files(tmp_path) == []  # nameless: nothing in the directory to leak
    assert region.path == f"/proc/{os.getpid()}/fd/{buffer.fd}" and region.inode == os.fstat(buffer.fd).st_ino
    assert os.readlink(region.path) == f"{buffer.name} (deleted)"


def test_the_file_is_reused_until_a_share_outgrows_it(buffer, tmp_path):
    first = buffer.stage([torch.ones(1000)], "n")
    again = buffer.stage([torch.full((10,), 2.0)], "n")
    assert again.path == first.path
    with open_region(again) as views:
        assert bytes(views[0]) == as_bytes(torch.full((10,), 2.0))
    bigger = buffer.stage([torch.ones(1 << 19)], "n")  # 2 MiB > the 1 MiB granule
    assert bigger.path != first.path and bigger.inode != first.inode
    assert staged_files(tmp_path) == []


def test_a_buffer_still_read_is_never_overwritten(buffer, tmp_path):
    old = buffer.stage([torch.full((100,), 1.0)], "n")
    with open_region(old) as views:  # a writer still reading
        buffer.busy = "the old file's write"
        new = buffer.stage([torch.full((100,), 9.0)], "n", in_use=True)
        assert new.path != old.path and buffer.busy is None  # a new file: nothing reads it yet
        assert bytes(views[0]) == as_bytes(torch.full((100,), 1.0))
    assert staged_files(tmp_path) == []


def test_close_releases_the_file(tmp_path):
    b = StagingBuffer(str(tmp_path))
    b.stage([torch.ones(4)], "n")
    name = b.name
    b.close()
    assert staged_files(tmp_path) == [] and b.path is None and b.fd is None
    assert not [fd for fd in os.listdir("/proc/self/fd") if held_by(fd) == f"{name} (deleted)"]
    b.close()  # twice is fine


def test_a_missing_directory_is_reported(tmp_path):
    b = StagingBuffer(str(tmp_path / "nope"))
    with pytest.raises(StagingUnavailable, match=r"staging file in .*nope \(the staging directory: RAYCKPT_SHM_DIR"):
        b.stage([torch.ones(4)], "n")


def test_the_staging_directory_is_RAYCKPT_SHM_DIR(tmp_path, monkeypatch):
    monkeypatch.delenv(SHM_DIR_ENV, raising=False)
    assert staging_dir() == SHM_DIR == "/dev/shm" and StagingBuffer().directory == SHM_DIR
    node = tmp_path / "node-a"
    node.mkdir()
    monkeypatch.setenv(SHM_DIR_ENV, str(node))
    b = StagingBuffer()
    region = b.stage([torch.ones(4)], "n")
    assert b.directory == str(node) and created_in(region.path) == str(node)  # created there, nameless since
    b.close()
    dead = multiprocessing.get_context("spawn").Process(target=int)
    dead.start()
    dead.join()
    (node / f"{PREFIX}{dead.pid}-abc").write_bytes(b"x")
    sweeper = StaleSweeper(interval_s=3600)  # the writer's sweeper reads the variable too
    sweeper.stop()
    assert sweeper.directory == str(node) and sweeper.removed == [f"{PREFIX}{dead.pid}-abc"]
    (node / f"{PREFIX}{dead.pid}-def").write_bytes(b"x")
    assert sweep_stale() == [f"{PREFIX}{dead.pid}-def"]


def test_a_staging_directory_that_is_not_one_is_reported_with_the_variable(tmp_path, monkeypatch):
    (tmp_path / "file").write_bytes(b"")
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path / "file"))
    with pytest.raises(StagingUnavailable) as err:
        StagingBuffer().stage([torch.ones(4)], "n")
    where = f"cannot create a staging file in {tmp_path / 'file'} (the staging directory: RAYCKPT_SHM_DIR"
    assert where in str(err.value)
    assert "Not a directory" in str(err.value)


def test_no_room_is_an_error_at_staging_time_and_leaves_no_file(buffer, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # files over 1 MiB: EFBIG
    try:
        with pytest.raises(StagingUnavailable, match=r"cannot reserve 4194304 bytes of shared memory in"):
            buffer.stage([torch.ones(1 << 20)], "n")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert staged_files(tmp_path) == []


def test_a_region_whose_file_is_gone_or_short_is_refused(buffer, tmp_path):
    region = buffer.stage([torch.ones(4)], "n")
    with pytest.raises(ValueError, match=r"has 1048576 bytes, the region needs 2097152"):
        with open_region(StagedRegion(region.path, "n", ((0, 2 << 20),))):
            pass
    with pytest.raises(FileNotFoundError, match=r"staging file .* is gone: .* \(the descriptor now names another"):
        with open_region(StagedRegion(region.path, "n", region.spans, region.inode + 1)):
            pass
    buffer.close()
    with pytest.raises(FileNotFoundError, match=r"staging file .* is gone"):
        with open_region(region):
            pass


def test_sweep_removes_only_files_of_processes_that_are_gone(tmp_path):
    p = multiprocessing.get_context("spawn").Process(target=int)
    p.start()
    p.join()
    dead = tmp_path / f"{PREFIX}{p.pid}-abc"
    mine = tmp_path / f"{PREFIX}{os.getpid()}-def"
    other = tmp_path / "something-else-1"
    for f in (dead, mine, other):
        f.write_bytes(b"x")
    assert sweep_stale(str(tmp_path)) == [dead.name]
    assert sorted(os.listdir(tmp_path)) == sorted([mine.name, other.name])
    assert sweep_stale(str(tmp_path / "missing")) == []


def test_a_reserved_buffer_is_the_one_the_next_share_lands_in(buffer, tmp_path):
    pieces = [torch.ones(300_000), torch.arange(10)]
    assert staged_size(pieces) == layout([1_200_000, 80])[1] == 1_200_128
    buffer.reserve(3 << 20)
    reserved = buffer.path
    assert buffer.capacity == 3 << 20
    assert buffer.stage(pieces, "n").path == reserved
    buffer.reserve(1 << 20)  # smaller: kept as it is
    assert buffer.path == reserved and buffer.capacity == 3 << 20


def test_a_staging_file_the_writer_may_not_open_says_what_to_do(buffer, monkeypatch):
    region = buffer.stage([torch.ones(4)], "n")

    def denied(path, flags):  # as /proc/<pid>/fd is for a process that is not dumpable or another user's
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr("rayckpt.ray.rank.staging.os.open", denied)
    with pytest.raises(PermissionError, match=r"cannot open staging file /proc/\d+/fd/\d+ .*staging='object_store'"):
        with open_region(region):
            pass


def test_copy_now_runs_meanwhile_on_the_callers_thread_while_the_slices_copy(buffer, monkeypatch):
    import threading

    import numpy as np

    from rayckpt.engine.device import DeviceToHost
    from rayckpt.ray.rank import staging

    monkeypatch.setattr(staging, "SLICE_BYTES", 64)
    called = threading.Event()
    copyto = np.copyto

    def held(dst, src):  # a slice's copy cannot finish before ``meanwhile`` has been called
        assert called.wait(30), "meanwhile was not called while the slices copied"
        copyto(dst, src)

    monkeypatch.setattr(staging.np, "copyto", held)
    pieces = [torch.arange(256, dtype=torch.float32)]  # 1 KiB: 16 slices
    region = buffer.place(pieces, "node-a")
    caller = []
    buffer.copy_now(
        list(zip(pieces, region.spans)),
        DeviceToHost(),
        2,
        lambda: (caller.append(threading.current_thread()), called.set()),
    )
    assert caller == [threading.current_thread()]
    with open_region(region) as views:
        assert [bytes(v) for v in views] == [as_bytes(p) for p in pieces]


def test_copy_now_finishes_every_slice_before_it_raises_what_meanwhile_raised(buffer, monkeypatch):
    import threading
    import time

    import numpy as np

    from rayckpt.engine.device import DeviceToHost
    from rayckpt.ray.rank import staging

    monkeypatch.setattr(staging, "SLICE_BYTES", 64)
    copied = []
    copyto = np.copyto

    def slow(dst, src):
        time.sleep(0.01)
        copyto(dst, src)
        copied.append(threading.current_thread().name)

    def refused():
        raise RuntimeError("registration refused")

    monkeypatch.setattr(staging.np, "copyto", slow)
    pieces = [torch.arange(256, dtype=torch.float32)]
    region = buffer.place(pieces, "node-a")
    with pytest.raises(RuntimeError, match="registration refused"):
        buffer.copy_now(list(zip(pieces, region.spans)), DeviceToHost(), 2, refused)
    assert len(copied) == 16  # the buffer is never left with a copy still writing into it
    with open_region(region) as views:
        assert [bytes(v) for v in views] == [as_bytes(p) for p in pieces]
