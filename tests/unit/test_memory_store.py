"""The memory tier's per-node store (``ray.memory.store.MemoryStore``) and the tier policy, without Ray."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from rayckpt.format.manifest import MANIFEST_NAME
from rayckpt.ray.memory import replication
from rayckpt.ray.memory.link import ReplicaServer
from rayckpt.ray.memory.store import BUDGET_ENV, MemoryBudgetExceeded, MemoryStore, default_budget
from rayckpt.train.tiers import MEMORY, STORAGE, TierPolicy


def held_descriptors() -> int:
    """This process's descriptors of memory-tier files (unlinked: ``... (deleted)``)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "-mem-" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


@pytest.fixture
def store(tmp_path):
    s = MemoryStore("node-aaaaaaaaaaaa", str(tmp_path), budget=1 << 20)
    yield s
    s.close()


def test_held_files_have_no_name_and_are_read_back_by_range_and_through_proc(store, tmp_path):
    assert store.put("run/step-1/a.arrow", b"0123456789") == 10
    store.put("run/step-1/manifest.json", np.frombuffer(b"{}", dtype=np.uint8))
    assert os.listdir(tmp_path) == []  # unlinked once written: freed with the process that holds them
    assert store.read("run/step-1/a.arrow", 3, 4) == b"3456" and store.read("run/step-1/a.arrow", 8, 100) == b"89"
    pid, fd, size, _inode = store.where("run/step-1/a.arrow")
    with open(f"/proc/{pid}/fd/{fd}", "rb") as f:
        assert f.read() == b"0123456789" and size == 10
    assert store.where("run/step-1/nothing") is None
    with pytest.raises(FileNotFoundError, match=r"memory tier of node node-aaaaaaa: run/x is not held here"):
        store.read("run/x", 0, 1)


def test_stat_and_listing_show_files_and_the_directories_above_them(store):
    for path in ("run/s1/a", "run/s1/b", "run/s2/a", "other/c"):
        store.put(path, b"xy")
    assert store.stat(["run/s1/a", "run/s1", "run", "run/s3", ""]) == {"run/s1/a": 2, "run/s1": -1, "run": -1, "": -1}
    assert store.listing("run", recursive=False) == {"run/s1": -1, "run/s2": -1}
    assert store.listing("run/s1", recursive=False) == {"run/s1/a": 2, "run/s1/b": 2}
    assert store.listing("", recursive=True) == {
        "run": -1,
        "run/s1": -1,
        "run/s2": -1,
        "other": -1,
        "run/s1/a": 2,
        "run/s1/b": 2,
        "run/s2/a": 2,
        "other/c": 2,
    }


def test_delete_drops_a_file_or_a_tree_and_frees_its_descriptors(store):
    for path in ("run/s1/a", "run/s1/b", "run/s2/a"):
        store.put(path, b"xyz")
    assert held_descriptors() == 3
    assert store.delete("run/s1/a", tree=False) == 1 and store.delete("run/s1", tree=False) == 0
    assert store.delete("run/s1", tree=True) == 1 and store.held == 3 and held_descriptors() == 1
    assert store.delete("", tree=True) == 1 and store.files == {} and held_descriptors() == 0


def test_a_file_over_the_budget_is_refused_and_a_rewrite_replaces_the_old_one(store):
    store.put("a", b"x" * (600 << 10))
    with pytest.raises(MemoryBudgetExceeded, match=r"b \(614400 bytes\) does not fit: 614400 of its 1048576 bytes"):
        store.put("b", b"x" * (600 << 10))
    assert store.stat(["b"]) == {} and store.room() == ((1 << 20) - (600 << 10), "of its memory budget left")
    store.put("a", b"y" * (900 << 10))  # replaces a: the old bytes do not count against the new ones
    assert store.held == 900 << 10 and store.read("a", 0, 1) == b"y"


def _hold_step(store, step: int, committed: bool, root: str = "mem/run") -> None:
    base = f"{root}/rayckpt-step-{step:08d}"
    store.put(f"{base}/shard-0.arrow", b"x" * 100)
    store.put(f"{base}/.rayckpt-lease-s{step}", b"{}")
    if committed:
        store.put(f"{base}/{MANIFEST_NAME}", b"m")


def _steps(store) -> list[int]:
    return sorted({int(p.split("rayckpt-step-")[1][:8]) for p in store.files if "rayckpt-step-" in p})


def test_room_under_a_run_drops_what_is_older_than_its_newest_committed_checkpoints_and_keeps_a_save_in_flight(store):
    for step, committed in ((1, True), (2, False), (3, True), (4, True), (5, False)):  # 2: a failed save's leftover
        _hold_step(store, step, committed)
    _hold_step(store, 1, True, root="mem/other-run")
    before = store.held
    # keep 1 committed (memory_keep=2): 4 stays, and 5 (newer: in flight); 1, 2 and 3 go; another run is untouched.
    assert store.room("mem/run", keep=1) == (store.budget - store.held, "of its memory budget left")
    assert store.held < before
    assert _steps(store) == [1, 4, 5] and sum(p.startswith("mem/other-run/") for p in store.files) == 3
    assert store.drop_old("mem/run", keep=1) == 0  # the same rule again: nothing more
    assert store.drop_old("mem/run", keep=0) == 3  # keep none (memory_keep=1): every committed one; 5 stays
    assert _steps(store) == [1, 5]
    assert store.drop_old("mem/run", keep=0) == 0  # no committed checkpoint: nothing to drop
    assert store.room() == (store.budget - store.held, "of its memory budget left")  # no root: only measures
    # What was dropped is no longer counted at once; its descriptors are closed in the background.
    deadline = time.monotonic() + 30
    while held_descriptors() > len(store.files) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held_descriptors() == len(store.files) == 5


def test_fewer_committed_checkpoints_than_kept_drops_nothing(store):
    _hold_step(store, 1, False)
    _hold_step(store, 2, True)
    assert store.drop_old("mem/run", keep=2) == 0 and _steps(store) == [1, 2]


def test_a_file_whose_replica_cannot_be_made_is_not_held(store, tmp_path, monkeypatch):
    peer_dir = tmp_path / "peer"
    peer_dir.mkdir()
    peer = MemoryStore("node-bbbbbbbbbbbb", str(peer_dir), budget=3)  # holds less than the file
    server = ReplicaServer(peer, "127.0.0.1")
    monkeypatch.setattr(replication, "ring_peer", lambda node: ("node-bbbbbbbbbbbb", "its writer"))
    monkeypatch.setattr(replication, "_endpoint", lambda node, handle: server.endpoint)
    try:
        out = store.create("run/s1/shard.arrow", replicate=True)
        out.write(b"payload")
        with pytest.raises(
            OSError,
            match=r"cannot copy run/s1/shard.arrow to node node-bbbbbbbbbbbb \(its replica\): "
            r"MemoryBudgetExceeded: .* does not fit",
        ):
            out.close()
        assert store.files == {} and peer.files == {}
    finally:
        server.close()
        peer.close()


def test_a_received_file_shorter_than_announced_is_not_held(store, tmp_path):
    before = held_descriptors()
    with pytest.raises(OSError, match=r"node-aaaaaaa: run/step-1/a.arrow: 10 bytes expected, 4 written"):
        store.hold_from("run/step-1/a.arrow", 10, lambda fd: os.write(fd, b"half"))
    assert store.files == {} and os.listdir(tmp_path) == [] and held_descriptors() == before
    store.hold_from("run/step-1/a.arrow", 10, lambda fd: os.pwrite(fd, b"0123456789", 0))
    assert store.read("run/step-1/a.arrow", 0, 10) == b"0123456789"


def test_the_default_budget_is_half_the_filesystem_or_the_environment(tmp_path, monkeypatch):
    st = os.statvfs(tmp_path)
    assert default_budget(str(tmp_path)) == int(st.f_blocks * st.f_frsize * 0.5)
    monkeypatch.setenv(BUDGET_ENV, "12345")
    assert default_budget(str(tmp_path)) == 12345
    monkeypatch.setenv(BUDGET_ENV, "lots")
    with pytest.raises(ValueError, match=r"RAYCKPT_MEMORY_BUDGET='lots': expected a number of bytes"):
        default_budget(str(tmp_path))


def test_room_is_bounded_by_what_the_filesystem_has_left_where_that_is_less_than_the_budget(tmp_path):
    st = os.statvfs(tmp_path)
    size = st.f_blocks * st.f_frsize
    store = MemoryStore("node-aaaaaaaaaaaa", str(tmp_path), budget=2 * size)  # more than the filesystem holds
    try:
        room, bound = store.room()
        # Another process may write to the filesystem meanwhile: what it has left is below its size, not exact.
        assert 0 <= room <= size and bound == f"free in {tmp_path} (its free space less Ray's object store)"
        store.budget = 1 << 20
        assert store.room() == (1 << 20, "of its memory budget left")
    finally:
        store.close()


def test_the_policy_sends_each_step_to_storage_memory_both_or_nowhere():
    policy = TierPolicy(memory_every=2, persist_every=6)
    assert [policy.tiers(s) for s in range(1, 7)] == [(), (MEMORY,), (), (MEMORY,), (), (MEMORY, STORAGE)]
    assert policy.tiers(3, persist=True) == (STORAGE,) and policy.tiers(4, persist=True) == (MEMORY, STORAGE)
    assert policy.tiers(3, persist=False) == (MEMORY,) and policy.tiers(6, persist=False) == (MEMORY,)
    assert TierPolicy(memory_every=4, persist_every=6).tiers(6) == (STORAGE,)  # not a memory step
    assert TierPolicy().tiers(5) == (STORAGE,) and TierPolicy().tiers(5, persist=False) == ()  # no memory tier
    for bad, name in (({"memory_every": -1}, "memory_every"), ({"persist_every": 0}, "persist_every")):
        with pytest.raises(ValueError, match=rf"Checkpointer\({name}=.*\): expected a whole number"):
            TierPolicy(**bad)
    with pytest.raises(ValueError, match=r"memory_keep=True"):
        TierPolicy(memory_keep=True)
