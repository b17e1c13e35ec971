"""A rank's share of one storage type split over several shard files, written at once
(``engine.writer.split_parts`` / ``write_chunks(..., max_parts)``): the grouping, the file
names, the threads, a failing part, and saves that read back the same."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

import rayckpt
from rayckpt.engine import writer
from rayckpt.engine.writer import MAX_PARTS, ShareSpec, parts_here, split_parts, write_chunks
from rayckpt.errors import SaveFailedError
from rayckpt.format.boxes import Box
from rayckpt.format.shard_file import ChunkSpec
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import WrittenFiles, shard_file_name, shard_file_save_id

KIB = 1 << 10


def chunk(key: str, nbytes: int, dtype: str = "float32") -> object:
    width = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    data = np.random.default_rng(len(key)).integers(0, 255, nbytes, dtype=np.uint8)
    return ChunkSpec(key, dtype, Box((0,), (nbytes // width,))).with_data(data)


@pytest.fixture
def small_parts(monkeypatch):
    """Parts of 64 KiB, so that a few hundred KiB split."""
    monkeypatch.setattr(writer, "PART_BYTES", 64 * KIB)


@pytest.fixture
def sixteen_cores(monkeypatch):
    """A process that may run on 16 cores, whatever this machine has."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def test_a_rank_writes_as_many_files_at_once_as_its_share_of_the_node_s_cores(sixteen_cores, monkeypatch):
    assert parts_here(1, 1) == MAX_PARTS == 8  # one rank alone: capped
    assert parts_here(8, 2) == 4  # 4 ranks per node, without LOCAL_WORLD_SIZE
    assert parts_here(3, 1) == 5
    assert parts_here(64, 2) == 1  # the ranks already fill the cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's and Ray Train's count wins
    assert parts_here(64, 2) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert parts_here(1, 1) == 1


def test_a_share_under_twice_the_part_size_stays_one_file(small_parts):
    chunks = [chunk(f"k{i}", 32 * KIB) for i in range(3)]  # 96 KiB
    assert split_parts(chunks, MAX_PARTS) == [chunks]


def test_a_share_splits_in_order_into_one_file_per_part_size(small_parts):
    chunks = [chunk(f"k{i}", 32 * KIB) for i in range(8)]  # 256 KiB: 4 parts of 64 KiB
    groups = split_parts(chunks, MAX_PARTS)
    assert [[c.key for c in g] for g in groups] == [["k0", "k1"], ["k2", "k3"], ["k4", "k5"], ["k6", "k7"]]


def test_the_parts_are_capped_and_a_chunk_is_never_cut(small_parts):
    chunks = [chunk(f"k{i}", 32 * KIB) for i in range(8)]
    assert [len(g) for g in split_parts(chunks, 2)] == [4, 4]
    one = [chunk("big", 512 * KIB)]
    assert split_parts(one, MAX_PARTS) == [one]
    uneven = [chunk("a", 300 * KIB), chunk("b", 8 * KIB), chunk("c", 8 * KIB)]
    groups = split_parts(uneven, MAX_PARTS)
    assert [c.key for g in groups for c in g] == ["a", "b", "c"]
    assert all(groups) and len(groups) <= 3


def test_parts_are_named_after_the_type_and_found_as_the_save_s_files():
    assert shard_file_name("s1", 3, "float") == "s1-r00003-float.arrow"
    assert shard_file_name("s1", 3, "float", 2) == "s1-r00003-float.2.arrow"
    assert shard_file_save_id(shard_file_name("20260101T000000-0123abcd", 3, "float", 2)) == "20260101T000000-0123abcd"


def test_the_parts_are_written_at_once_each_on_its_own_thread(small_parts, tmp_path, monkeypatch):
    seen: dict[str, str] = {}
    real = writer.write_shard_file
    all_started = threading.Barrier(3, timeout=30)

    def recording(ckdir, rel, data, block_size, save_id, fingerprints=False):
        seen[rel] = threading.current_thread().name
        all_started.wait()  # fails (BrokenBarrierError) if the three files were written one after another
        return real(ckdir, rel, data, block_size, save_id)

    monkeypatch.setattr(writer, "write_shard_file", recording)
    chunks = [chunk(f"k{i}", 64 * KIB) for i in range(2)] + [chunk("n", 8 * KIB, "int64")]
    files = WrittenFiles(CheckpointDir.resolve(str(tmp_path)), "s1")
    shard = write_chunks(files, chunks, ShareSpec(rank=0, block_size=16 * KIB, max_parts=2))
    written = list(files.paths)
    assert written == ["s1-r00000-float.arrow", "s1-r00000-float.1.arrow", "s1-r00000-int64.arrow"]
    assert [f.path for f in shard.files] == written
    assert [(w.key, w.file) for w in shard.chunks] == [
        ("k0", "s1-r00000-float.arrow"),
        ("k1", "s1-r00000-float.1.arrow"),
        ("n", "s1-r00000-int64.arrow"),
    ]
    assert all(name.startswith("rayckpt-part") for name in seen.values()) and len(set(seen.values())) == 3


def test_the_default_writes_one_file_per_type_in_type_order_on_the_caller_s_thread(small_parts, tmp_path, monkeypatch):
    order: list[tuple[str, str]] = []
    real = writer.write_shard_file

    def recording(ckdir, rel, data, block_size, save_id, fingerprints=False):
        order.append((rel, threading.current_thread().name))
        return real(ckdir, rel, data, block_size, save_id)

    monkeypatch.setattr(writer, "write_shard_file", recording)
    chunks = [chunk("n", 8 * KIB, "int64")] + [chunk(f"k{i}", 64 * KIB) for i in range(4)]
    write_chunks(
        WrittenFiles(CheckpointDir.resolve(str(tmp_path)), "s1"), chunks, ShareSpec(rank=0, block_size=16 * KIB)
    )
    here = threading.current_thread().name
    assert order == [("s1-r00000-float.arrow", here), ("s1-r00000-int64.arrow", here)]


def test_a_part_that_fails_names_its_file_after_the_others_ended(small_parts, tmp_path, monkeypatch):
    real = writer.write_shard_file
    ended: list[str] = []

    def failing(ckdir, rel, data, block_size, save_id, fingerprints=False):
        if rel.endswith("float.1.arrow"):
            raise OSError(28, "No space left on device")
        out = real(ckdir, rel, data, block_size, save_id)
        ended.append(rel)
        return out

    monkeypatch.setattr(writer, "write_shard_file", failing)
    chunks = [chunk(f"k{i}", 32 * KIB) for i in range(8)]
    files = WrittenFiles(CheckpointDir.resolve(str(tmp_path)), "s1")
    message = r"rank 5: writing shard file .*s1-r00005-float\.1\.arrow failed: No space"
    with pytest.raises(SaveFailedError, match=message):
        write_chunks(files, chunks, ShareSpec(rank=5, block_size=16 * KIB, max_parts=MAX_PARTS))
    written = list(files.paths)
    # Every part is listed for the cleanup, and the ones that did not fail had ended when it raised.
    assert written == ["s1-r00005-float.arrow"] + [f"s1-r00005-float.{p}.arrow" for p in (1, 2, 3)]
    assert sorted(ended) == sorted(set(written) - {"s1-r00005-float.1.arrow"})


def test_a_one_process_save_splits_its_share_and_loads_back_the_same(small_parts, sixteen_cores, tmp_path):
    gen = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(64, 128, generator=gen) for i in range(8)}  # 8 x 32 KiB
    state["step"] = torch.arange(5)
    rayckpt.save({"model": state}, str(tmp_path / "ck"))
    files = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.endswith(".arrow") and "-r00000-" in p.name)
    assert [f.split("-r00000-")[1] for f in files] == [
        "float.1.arrow",
        "float.2.arrow",
        "float.3.arrow",
        "float.arrow",
        "int64.arrow",
    ]
    target = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
    rayckpt.load(target, str(tmp_path / "ck"))
    for k, v in state.items():
        assert torch.equal(target["model"][k], v), k
    report = rayckpt.verify(str(tmp_path / "ck"))
    assert report.ok and report.files_checked == 5, report


def test_the_node_s_shard_writer_writes_a_share_in_as_many_files_as_its_request_allows(tmp_path, monkeypatch):
    """``ShardWriter.write`` (called unbound, on a stand-in for the actor's own state: no Ray) passes the
    rank's ``ShardWrite.max_parts`` to the write step; the rank sets it from ``parts_here``."""
    import collections
    from contextlib import contextmanager
    from types import SimpleNamespace

    from rayckpt.ray.records import SaveTarget
    from rayckpt.ray.writer import actor as shard_writer

    seen: list[int] = []
    real = shard_writer.write_rank_share

    def recording(files, chunks, share):
        seen.append(share.max_parts)
        return real(files, chunks, share)

    monkeypatch.setattr(shard_writer, "write_rank_share", recording)
    data = [chunk("k0", 8 * KIB)]

    @contextmanager
    def views(staged, record):
        yield [c.data for c in data]

    actor = SimpleNamespace(
        node_id="n" * 12,
        records=collections.deque(),
        node=lambda: "n" * 12,
        _views=views,
        _report_written=lambda *args: None,
    )
    specs = tuple(ChunkSpec(c.key, c.dtype, c.box) for c in data)
    for parts in (1, 3):
        target = SaveTarget(save_id=f"s{parts}", location=str(tmp_path), rank=0)
        request = shard_writer.ShardWrite(target=target, block_size=4 * KIB, chunks=specs, max_parts=parts)
        out = shard_writer.ShardWriter.write(actor, request, [])
        assert out["files"] == [f"s{parts}-r00000-float.arrow"]
    assert seen == [1, 3]
    assert (
        shard_writer.ShardWrite(target=SaveTarget(save_id="s"), block_size=1, chunks=()).max_parts == 1
    )  # a request that does not say
