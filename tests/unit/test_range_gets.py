"""Range GETs on remote filesystems: the pure coalescing policy, and loads through a counting filesystem."""

from __future__ import annotations

import threading

import pytest
import torch

import rayckpt
from rayckpt.engine import load as engine_load
from rayckpt.engine import reader as reader_module
from rayckpt.engine.device import HostToDevice
from rayckpt.engine.state import flatten
from rayckpt.format.shard_file import ShardReader
from rayckpt.planning import load_plan, range_gets
from rayckpt.planning.load_plan import FileRead
from rayckpt.planning.range_gets import RangeGet, create_range_gets, get_parts
from rayckpt.storage.checkpoint_dir import CheckpointDir
from tests.helpers.checkpoints import flip_byte, manifest_of
from tests.helpers.counting_fs import counting_filesystem


def fr(offset: int, length: int, file: str = "a") -> FileRead:
    return FileRead(file, offset, length, ())


def spans(gets) -> list[tuple[str, int, int, int, int]]:
    return [(g.file, g.offset, g.length, len(g.reads), g.gap_bytes) for g in gets]


def test_one_range_is_one_get():
    assert spans(create_range_gets([fr(100, 50)])) == [("a", 100, 50, 1, 0)]
    assert create_range_gets([]) == ()


def test_gap_exactly_at_the_threshold_merges_and_one_more_byte_does_not():
    at = create_range_gets([fr(0, 100), fr(110, 100)], max_gap=10, max_gap_fraction=1.0)
    assert spans(at) == [("a", 0, 210, 2, 10)]
    past = create_range_gets([fr(0, 100), fr(111, 100)], max_gap=10, max_gap_fraction=1.0)
    assert spans(past) == [("a", 0, 100, 1, 0), ("a", 111, 100, 1, 0)]


def test_size_cap_starts_a_new_get_and_never_splits_a_range():
    gets = create_range_gets([fr(0, 40), fr(40, 40), fr(80, 40), fr(120, 500)], max_bytes=100)
    assert spans(gets) == [("a", 0, 80, 2, 0), ("a", 80, 40, 1, 0), ("a", 120, 500, 1, 0)]


def test_gap_fraction_bounds_the_discarded_bytes():
    # 10 gap bytes in a 210-byte GET are 4.8%: merged; 12 in 212 are 5.7%: not.
    assert len(create_range_gets([fr(0, 100), fr(110, 100)], max_gap=64)) == 1
    assert len(create_range_gets([fr(0, 100), fr(112, 100)], max_gap=64)) == 2


def test_unsorted_input_overlaps_and_files_are_kept_apart():
    gets = create_range_gets([fr(50, 10, "b"), fr(30, 20), fr(0, 30), fr(10, 5), fr(0, 10, "b")], max_gap=0)
    assert spans(gets) == [("a", 0, 50, 3, 0), ("b", 0, 10, 1, 0), ("b", 50, 10, 1, 0)]


def test_every_read_lies_in_exactly_one_get():
    reads = [fr(o, 7, f) for f in "xy" for o in range(0, 5000, 37)]
    gets = create_range_gets(reads, max_gap=40, max_bytes=300, max_gap_fraction=0.5)
    assert sorted((r.file, r.offset) for g in gets for r in g.reads) == sorted((r.file, r.offset) for r in reads)
    for g in gets:
        assert g.length <= 300
        assert all(g.offset <= r.offset and r.offset + r.length <= g.offset + g.length for r in g.reads)
        assert g.gap_bytes == g.length - 7 * len(g.reads)


def test_a_get_is_fetched_in_parts_of_at_most_the_part_size_in_order():
    get = RangeGet(file="a", offset=100, length=25, reads=(), gap_bytes=0)
    assert get_parts(get, part_bytes=10) == ((100, 10), (110, 10), (120, 5))
    assert get_parts(get, part_bytes=25) == ((100, 25),)
    assert get_parts(get, part_bytes=1000) == ((100, 25),)
    assert get_parts(RangeGet(file="a", offset=7, length=0, reads=(), gap_bytes=0), part_bytes=10) == ((7, 0),)


def small_tensors() -> dict:
    gen = torch.Generator().manual_seed(3)
    return {f"t{i}": torch.randn(40, 50, generator=gen) for i in range(5)}


def expected_gets(path: str, fs, target: dict) -> tuple:
    flat = flatten(target)
    m = rayckpt.read_manifest(CheckpointDir.resolve(path, fs))
    plan = load_plan.create_load_plan(m, engine_load.tensor_requests(flat), tuple(flat.values))
    return plan, create_range_gets(plan.reads)


def test_neighbouring_ranges_of_a_file_are_one_get_bit_exact(tmp_path):
    """Five tensors in one file, apart only by Arrow message headers: one GET, counted in LoadInfo."""
    path = str(tmp_path / "c")
    state = small_tensors()
    rayckpt.save(state, path)
    fs, stats = counting_filesystem()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    info = rayckpt.load(target, path, filesystem=fs)
    assert all(torch.equal(target[k], v) for k, v in state.items())
    plan, gets = expected_gets(path, fs, target)
    assert len(plan.reads) == 5 and len(gets) == 1
    assert info.requests == stats.requests == 1 and info.num_reads == 5
    assert info.bytes_fetched == stats.bytes == gets[0].length == info.bytes_read + gets[0].gap_bytes
    assert info.bytes_read == info.bytes_needed == 5 * 40 * 50 * 4
    assert 1.0 < info.read_amplification <= 1.05


def test_flipped_byte_in_a_coalesced_gets_middle_range_names_file_key_and_range(tmp_path):
    path = str(tmp_path / "c")
    state = small_tensors()
    rayckpt.save(state, path)
    chunk = manifest_of(path)["entries"]["t2"]["chunks"][0]
    flip_byte(path, chunk["file"], chunk["byte_offset"] + 5000)
    fs, stats = counting_filesystem()
    with pytest.raises(rayckpt.CorruptCheckpointError) as err:
        rayckpt.load({k: torch.zeros_like(v) for k, v in state.items()}, path, filesystem=fs)
    start = chunk["byte_offset"]  # 8000-byte chunk, one block
    assert stats.requests == 1
    msg = str(err.value)
    assert chunk["file"] in msg and "'t2'" in msg and f"[{start}, {start + 8000})" in msg


def four_files() -> dict:
    """One file per storage type: a load reads four files."""
    return {
        "f": torch.arange(3000, dtype=torch.float32),
        "d": torch.arange(3000, dtype=torch.float64),
        "i": torch.arange(3000, dtype=torch.int32),
        "l": torch.arange(3000, dtype=torch.int64),
    }


def test_gets_of_different_files_run_concurrently(tmp_path):
    path = str(tmp_path / "c")
    state = four_files()
    rayckpt.save(state, path)
    fs, stats = counting_filesystem(rendezvous=4)  # each of the 4 GETs waits for all 4 to start
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    info = rayckpt.load(target, path, filesystem=fs)
    assert all(torch.equal(target[k], v) for k, v in state.items())
    assert info.requests == stats.requests == 4 and stats.max_in_flight == 4


def test_gets_in_flight_are_bounded_by_the_pool(tmp_path, monkeypatch):
    monkeypatch.setattr(range_gets, "GET_CONCURRENCY", 2)
    path = str(tmp_path / "c")
    state = four_files()
    rayckpt.save(state, path)
    fs, stats = counting_filesystem()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    rayckpt.load(target, path, filesystem=fs)
    assert all(torch.equal(target[k], v) for k, v in state.items())
    assert stats.requests == 4 and 1 <= stats.max_in_flight <= 2


def test_local_files_keep_direct_reads(tmp_path):
    """No coalescing on local disk: one preadv per range, nothing fetched beyond the plan."""
    path = str(tmp_path / "c")
    state = small_tensors()
    rayckpt.save(state, path)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    info = rayckpt.load(target, path)
    assert info.requests == info.num_reads == 5 and info.bytes_fetched == info.bytes_read


def one_big_tensor() -> dict:
    return {"w": torch.arange(60_000, dtype=torch.float32)}  # 240,000 bytes: one range, one GET


def test_one_large_range_is_fetched_as_parallel_parts_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(range_gets, "GET_PART_BYTES", 50_000)
    path = str(tmp_path / "c")
    state = one_big_tensor()
    rayckpt.save(state, path, block_size=16_384)
    fs, stats = counting_filesystem()
    target = {"w": torch.zeros(60_000)}
    info = rayckpt.load(target, path, filesystem=fs)
    assert torch.equal(target["w"], state["w"])
    _, gets = expected_gets(path, fs, target)
    assert len(gets) == 1 and gets[0].length == info.bytes_read >= 240_000
    parts = get_parts(gets[0], 50_000)
    assert info.requests == stats.requests == len(parts) == 5
    assert sorted(stats.sizes) == sorted(n for _, n in parts)
    assert info.bytes_fetched == stats.bytes == gets[0].length


class RendezvousReader(ShardReader):
    """A shard reader whose first ``n`` fetches each wait until ``n`` have started (a unit fake:
    the counting filesystem's ``PythonFile`` serializes reads of one file, pyarrow's S3 file does not)."""

    def __init__(self, *args, n: int) -> None:
        super().__init__(*args)
        self.barrier = threading.Barrier(n, timeout=30)

    def fetch(self, rel: str, offset: int, length: int) -> bytes:
        self.barrier.wait()  # BrokenBarrierError if the parts ran one at a time
        return super().fetch(rel, offset, length)


def test_the_parts_of_one_get_are_in_flight_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(range_gets, "GET_PART_BYTES", 60_000)  # 4 parts of a 240,000-byte range
    path = str(tmp_path / "c")
    state = one_big_tensor()
    rayckpt.save(state, path, block_size=16_384)
    target = {"w": torch.zeros(60_000)}
    _, gets = expected_gets(path, None, target)
    m = rayckpt.read_manifest(CheckpointDir.resolve(path))
    ckdir = CheckpointDir.resolve(path)
    reader = RendezvousReader(ckdir, m.blocks, {f.path: f.size for f in m.files}, n=4)
    reader_module._read_gets(reader, gets, flatten(target), HostToDevice())
    assert torch.equal(target["w"], state["w"]) and reader.requests == 4


def test_flipped_byte_in_a_later_part_names_the_block(tmp_path, monkeypatch):
    monkeypatch.setattr(range_gets, "GET_PART_BYTES", 50_000)
    path = str(tmp_path / "c")
    rayckpt.save(one_big_tensor(), path, block_size=16_384)
    chunk = manifest_of(path)["entries"]["w"]["chunks"][0]
    flip_byte(path, chunk["file"], chunk["byte_offset"] + 200_000)  # block 12: bytes [196608, 212992)
    fs, _ = counting_filesystem()
    with pytest.raises(rayckpt.CorruptCheckpointError) as err:
        rayckpt.load({"w": torch.zeros(60_000)}, path, filesystem=fs)
    start = chunk["byte_offset"] + 12 * 16_384
    assert f"[{start}, {start + 16_384}) (block 12 of" in str(err.value) and "'w'" in str(err.value)
