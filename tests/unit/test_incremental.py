"""Incremental saves (``rayckpt.save(..., incremental=True)``): what they write, share, keep and collect.

Single process, small tensors. The shared store is ``<parent>/.rayckpt-shared``; a store file's name
starts with the id of the save that wrote it.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import rayckpt
import rayckpt.tools
from rayckpt.errors import CorruptCheckpointError, FormatVersionError
from rayckpt.format.manifest import MANIFEST_NAME
from rayckpt.storage import lease as lease_mod
from rayckpt.storage import shared
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.names import shard_file_save_id

#: The shared store's directory beside the checkpoints (docs/FORMAT.md), spelled out: it is the format.
SHARED_DIR = ".rayckpt-shared"
PREFIX = f"../{SHARED_DIR}/"


# -- helpers ---------------------------------------------------------------------------------------


def store(parent) -> str:
    return os.path.join(str(parent), SHARED_DIR)


def store_files(parent) -> dict[str, int]:
    """The shard files in the store beside ``parent``'s checkpoints: name -> bytes."""
    d = store(parent)
    if not os.path.isdir(d):
        return {}
    return {
        n: os.path.getsize(os.path.join(d, n))
        for n in os.listdir(d)
        if n.endswith(".arrow") and shard_file_save_id(n) is not None
    }


def manifest(path) -> dict:
    with open(os.path.join(str(path), MANIFEST_NAME)) as f:
        return json.load(f)


def named(path) -> set[str]:
    """The store files the manifest at ``path`` names."""
    return {f["path"][len(PREFIX) :] for f in manifest(path)["files"] if f["path"].startswith(PREFIX)}


def own_bytes(parent, save_id: str) -> int:
    return sum(size for n, size in store_files(parent).items() if n.startswith(save_id + "-"))


def state(frozen: torch.Tensor, trained: torch.Tensor, step: int) -> dict:
    return {"frozen": frozen, "trained": trained, "step": step}


def load_exact(path, expected: dict) -> None:
    """Load ``path`` into zeroed tensors and check every tensor bit-exact and the values equal."""
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in expected.items()}
    rayckpt.load(target, str(path))
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(target[k], v), f"{path}: {k} differs"
        else:
            assert target[k] == v, f"{path}: {k}: {target[k]!r} != {v!r}"


def snapshot(st: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}


def chain(parent, n: int, *, frozen_n: int = 700, trained_n: int = 300, seed: int = 0, **kw):
    """``n`` incremental saves ``parent/c{i}`` of a frozen tensor and a trained one changed each step:
    [(path, save id, the state saved)]."""
    g = torch.Generator().manual_seed(seed)
    frozen = torch.randn(frozen_n, generator=g)
    trained = torch.randn(trained_n, generator=g)
    out = []
    for i in range(n):
        trained.add_(1.0)
        path = os.path.join(str(parent), f"c{i}")
        info = rayckpt.save(state(frozen, trained, i), path, incremental=True, **kw)
        out.append((path, info.save_id, snapshot(state(frozen, trained, i))))
    return out


def dir_(path) -> CheckpointDir:
    return CheckpointDir.resolve(str(path))


# -- what a save writes ----------------------------------------------------------------------------


def test_frozen_state_is_written_once_and_every_step_loads_bit_exact(tmp_path):
    parent = tmp_path / "run"
    frozen = torch.randn(70_000)
    trained = torch.randn(30_000)
    trained_bytes, frozen_bytes = trained.numel() * 4, frozen.numel() * 4
    saved = []
    for step in range(5):
        trained.add_(0.5)
        path = parent / f"step{step}"
        info = rayckpt.save(state(frozen, trained, step), str(path), incremental=True)
        saved.append((path, info.save_id, snapshot(state(frozen, trained, step))))
        assert manifest(path)["version"] == 5
        written = own_bytes(parent, info.save_id)
        ci = rayckpt.inspect(str(path))
        if step == 0:
            assert written >= frozen_bytes + trained_bytes
            assert ci.bytes_shared == 0 and ci.bytes_written == frozen_bytes + trained_bytes
            assert named(path) == {n for n in store_files(parent) if n.startswith(info.save_id)}
        else:
            # only the trained tensor's bytes (plus the Arrow file's framing), none of the frozen one's
            assert trained_bytes <= written < trained_bytes + frozen_bytes // 10, (step, written)
            assert ci.bytes_written == trained_bytes and ci.bytes_shared == frozen_bytes
            first_files = {n for n in store_files(parent) if n.startswith(saved[0][1])}
            assert first_files <= named(path)  # the frozen tensor is the first save's bytes
        for p, _, expected in saved:
            load_exact(p, expected)
            assert rayckpt.verify(str(p)).ok
    assert set(store_files(parent)) == set().union(*(named(p) for p, _, _ in saved))


def test_a_non_incremental_save_is_version_4_and_makes_no_store(tmp_path):
    parent = tmp_path / "run"
    st = state(torch.randn(1000), torch.randn(100), 1)
    for i in range(2):
        rayckpt.save(st, str(parent / f"c{i}"))
        m = manifest(parent / f"c{i}")
        assert m["version"] == 4
        assert not any(f["path"].startswith("../") for f in m["files"])
        load_exact(parent / f"c{i}", st)
    assert not os.path.exists(store(parent))


@pytest.mark.parametrize("how", ["data_add", "no_grad_copy", "late_byte"])
def test_a_change_without_a_version_bump_is_written(tmp_path, how):
    parent = tmp_path / "run"
    a = torch.randn(100_000, requires_grad=True)  # 400 KB: several 64 KiB blocks
    other = torch.randn(200_000)  # unchanged, and most of the file: shared (a file is shared from only when
    # its unchanged chunks are at least half of it, on main since 7dbefdf)
    first = rayckpt.save({"a": a, "other": other}, str(parent / "c0"), incremental=True)
    version = a._version
    if how == "data_add":
        a.data.add_(1)
    elif how == "no_grad_copy":
        with torch.no_grad():
            a.copy_(torch.arange(a.numel(), dtype=a.dtype))
    else:  # the first 64 KiB block unchanged, one float far past it changed
        assert manifest(parent / "c0")["block_size"] <= 64 * 1024
        a.data[80_000] += 1.0
    if how == "data_add":
        assert a._version == version  # the point of the test: no version bump
    second = rayckpt.save({"a": a, "other": other}, str(parent / "c1"), incremental=True)
    # the changed tensor was written by the second save, the unchanged one was shared
    assert own_bytes(parent, second.save_id) >= a.numel() * 4
    assert own_bytes(parent, second.save_id) < a.numel() * 4 + other.numel() * 4
    out = {"a": torch.zeros(a.shape), "other": torch.zeros(other.shape)}
    rayckpt.load(out, str(parent / "c1"))
    assert torch.equal(out["a"], a.detach()) and torch.equal(out["other"], other)
    old = {"a": torch.zeros(a.shape), "other": torch.zeros(other.shape)}
    rayckpt.load(old, str(parent / "c0"))
    assert not torch.equal(old["a"], a.detach())
    assert first.save_id != second.save_id


# -- deleting checkpoints never breaks the ones left -----------------------------------------------


@pytest.mark.parametrize("how", ["remove", "rmtree_gc"])
def test_deleting_a_chain_in_every_order_keeps_the_rest_loadable(tmp_path, how):
    for n, order in enumerate(itertools.permutations(range(4))):
        parent = tmp_path / f"order{n}"
        saves = chain(parent, 4, frozen_n=300, trained_n=100, seed=n)
        left = set(range(4))
        for i in order:
            path = saves[i][0]
            if how == "remove":
                rayckpt.tools.remove(path)
            else:
                shutil.rmtree(path)
                rayckpt.tools.gc(str(parent))
            left.discard(i)
            assert not os.path.exists(path)
            for j in sorted(left):
                p, _, expected = saves[j]
                load_exact(p, expected)
                report = rayckpt.verify(p)
                assert report.ok, (order, i, j, report.problems)
            kept = set().union(set(), *(named(saves[j][0]) for j in left))
            assert set(store_files(parent)) == kept, (order, i)
        rayckpt.tools.gc(str(parent))
        assert store_files(parent) == {}, order


def test_keep_last_two_retention_over_eight_saves(tmp_path):
    parent = tmp_path / "run"
    frozen, trained = torch.randn(2000), torch.randn(500)
    kept: list[tuple[str, dict]] = []
    for step in range(8):
        if len(kept) == 2:  # Ray Train's num_to_keep=2: the oldest directory goes
            shutil.rmtree(kept.pop(0)[0])
        trained.add_(1)
        path = str(parent / f"checkpoint_{step:06d}")
        rayckpt.save(state(frozen, trained, step), path, incremental=True)
        kept.append((path, snapshot(state(frozen, trained, step))))
        # the commit's collection left exactly the files the kept manifests name
        assert set(store_files(parent)) == set().union(*(named(p) for p, _ in kept)), step
        for p, expected in kept:
            load_exact(p, expected)
            assert rayckpt.verify(p).ok


def test_full_every_three_starts_a_new_chain_every_third_save(tmp_path):
    parent = tmp_path / "run"
    saves = chain(parent, 7, full_every=3)
    for i, (path, save_id, expected) in enumerate(saves):
        owners = {shard_file_save_id(n) for n in named(path)}
        if i % 3 == 0:
            assert owners == {save_id}, (i, owners)
        else:
            assert owners - {save_id}, (i, owners)  # it shares with an earlier save of its chain
        load_exact(path, expected)


def test_full_every_count_refuses_what_is_not_a_whole_number():
    from rayckpt.engine.save import full_every_count

    assert full_every_count(3) == 3 and full_every_count(0) == 0
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="full_every"):
            full_every_count(bad)


def test_full_every_is_checked():
    st = {"a": torch.zeros(3)}
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="full_every"):
            rayckpt.save(st, "/nonexistent-rayckpt-never-written/c", incremental=True, full_every=bad)


# -- two runs in one directory ---------------------------------------------------------------------

RUN = textwrap.dedent(
    """
    import sys, torch, rayckpt
    parent, run = sys.argv[1], sys.argv[2]
    frozen = torch.randn(5000, generator=torch.Generator().manual_seed(7))  # the same bytes in both runs
    trained = torch.randn(1000, generator=torch.Generator().manual_seed(ord(run)))
    for line in sys.stdin:
        step = int(line)
        trained.add_(1)
        info = rayckpt.save({"frozen": frozen, "trained": trained, "step": step},
                            f"{parent}/{run}-{step}", incremental=True)
        print(info.save_id, flush=True)
    """
)


def test_two_runs_in_one_parent_never_share_with_each_other(tmp_path):
    parent = str(tmp_path / "run")
    procs = {
        r: subprocess.Popen(
            [sys.executable, "-c", RUN, parent, r], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for r in "AB"
    }
    ids: dict[str, set[str]] = {"A": set(), "B": set()}
    try:
        for step in range(3):
            for r in "AB":
                procs[r].stdin.write(f"{step}\n")
                procs[r].stdin.flush()
                line = procs[r].stdout.readline().strip()
                assert line, f"run {r} died"
                ids[r].add(line)
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait(timeout=120)
    assert all(p.returncode == 0 for p in procs.values())
    frozen = torch.randn(5000, generator=torch.Generator().manual_seed(7))
    for r, other in ("AB", "BA"):
        trained = torch.randn(1000, generator=torch.Generator().manual_seed(ord(r)))
        for step in range(3):
            path = os.path.join(parent, f"{r}-{step}")
            owners = {shard_file_save_id(n) for n in named(path)}
            assert owners <= ids[r] and not owners & ids[other], (r, step, owners)
            if step:
                assert len(owners) > 1  # it did share, within its own run
            trained = trained + 1
            load_exact(path, {"frozen": frozen, "trained": trained, "step": step})
            assert rayckpt.verify(path).ok


# -- the base: deleted, or a sweep running ---------------------------------------------------------


def test_a_base_deleted_between_saves_is_not_referenced(tmp_path):
    parent = tmp_path / "run"
    saves = chain(parent, 2)
    shutil.rmtree(saves[1][0])
    rayckpt.tools.gc(str(parent))
    frozen, trained = saves[1][2]["frozen"], saves[1][2]["trained"] + 1
    path = str(parent / "c2")
    info = rayckpt.save(state(frozen, trained, 2), path, incremental=True)
    assert all(os.path.exists(os.path.join(store(parent), n)) for n in named(path))
    load_exact(path, state(frozen, trained, 2))
    assert rayckpt.verify(path).ok
    load_exact(saves[0][0], saves[0][2])
    # the base is gone: nothing of c1 is named, but c0 (still committed) may be shared from, or nothing
    assert saves[1][1] not in {shard_file_save_id(n) for n in named(path)}
    assert info.save_id in {shard_file_save_id(n) for n in named(path)}


def test_a_save_while_a_sweep_is_running_shares_nothing(tmp_path):
    parent = tmp_path / "run"
    saves = chain(parent, 1)
    frozen, trained = saves[0][2]["frozen"], saves[0][2]["trained"] + 1
    sweep = shared.SWEEP_MARK + "x"
    lease_mod.write_lease(dir_(store(parent)), sweep)
    try:
        info = rayckpt.save(state(frozen, trained, 1), str(parent / "c1"), incremental=True)
    finally:
        lease_mod.release_lease(dir_(store(parent)), sweep)
    assert {shard_file_save_id(n) for n in named(parent / "c1")} == {info.save_id}
    load_exact(parent / "c1", state(frozen, trained, 1))
    # with no sweep running the next one shares again
    info2 = rayckpt.save(state(frozen, trained + 1, 2), str(parent / "c2"), incremental=True)
    assert {shard_file_save_id(n) for n in named(parent / "c2")} - {info2.save_id}


def test_a_live_saves_keeps_file_protects_store_files(tmp_path):
    parent = tmp_path / "run"
    saves = chain(parent, 1)
    real = next(iter(named(saves[0][0])))
    orphan = real.replace(saves[0][1], "20261128T000000-0badf00d")
    shutil.copyfile(os.path.join(store(parent), real), os.path.join(store(parent), orphan))
    inflight = dir_(parent / "inflight")
    live_id = "20261128T000001-1ee7c0de"
    lease_mod.write_lease(inflight, live_id)
    shared.write_keeps(inflight, live_id, frozenset({orphan}))
    report = shared.sweep_store(dir_(parent))
    assert orphan in store_files(parent) and not report.removed
    lease_mod.release_lease(inflight, live_id)
    report = shared.sweep_store(dir_(parent))
    assert orphan not in store_files(parent)
    assert [n for n, _ in report.removed] == [orphan]
    assert real in store_files(parent)
    load_exact(saves[0][0], saves[0][2])


# -- verify and hostile manifests ------------------------------------------------------------------


def test_verify_names_the_save_that_wrote_a_damaged_shared_file(tmp_path):
    parent = tmp_path / "run"
    saves = chain(parent, 3, frozen_n=20_000, trained_n=100)
    base_id = saves[0][1]
    (damaged,) = [n for n in named(saves[0][0]) if n.startswith(base_id)]
    p = os.path.join(store(parent), damaged)
    with open(p, "r+b") as f:
        f.seek(os.path.getsize(p) // 2)  # inside the frozen tensor's bytes
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    for path, _, _ in saves:
        assert damaged in named(path)  # every save of the chain shares the frozen tensor
        report = rayckpt.verify(path)
        assert not report.ok
        checksum = [x for x in report.problems if x.kind == "checksum"]
        assert checksum, report.problems
        assert all(base_id in x.message for x in checksum), checksum
    shutil.rmtree(saves[0][0])  # the writer's checkpoint gone: the damage is still its save's
    for path, _, _ in saves[1:]:
        checksum = [x for x in rayckpt.verify(path).problems if x.kind == "checksum"]
        assert checksum and all(base_id in x.message and "gone" in x.message for x in checksum), checksum


def test_the_cli_rm_and_gc_collect_the_store(tmp_path):
    parent = tmp_path / "run"
    saves = chain(parent, 3)

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "rayckpt", *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr

    cli("rm", saves[1][0], "--yes")  # c1's own file is named by nobody now
    assert set(store_files(parent)) == named(saves[0][0]) | named(saves[2][0])
    shutil.rmtree(saves[0][0])
    cli("gc", str(parent))
    assert set(store_files(parent)) == named(saves[2][0])
    load_exact(saves[2][0], saves[2][2])
    assert rayckpt.verify(saves[2][0]).ok


def _edit_manifest(path, edit) -> None:
    p = os.path.join(str(path), MANIFEST_NAME)
    with open(p) as f:
        doc = json.load(f)
    edit(doc)
    with open(p, "w") as f:
        json.dump(doc, f)


def test_a_version_4_manifest_may_not_name_the_store(tmp_path):
    (path, _, expected), *_ = chain(tmp_path / "run", 1)
    _edit_manifest(path, lambda d: d.update(version=4))
    with pytest.raises(CorruptCheckpointError):
        rayckpt.read_manifest(path)
    with pytest.raises(CorruptCheckpointError):
        load_exact(path, expected)


@pytest.mark.parametrize("bad", ["../other/x.arrow", f"../{SHARED_DIR}/a/b.arrow", "../x.arrow"])
def test_a_version_5_manifest_may_name_only_store_files(tmp_path, bad):
    (path, _, expected), *_ = chain(tmp_path / "run", 1)

    def edit(doc):
        doc["files"][0]["path"] = bad

    _edit_manifest(path, edit)
    with pytest.raises(CorruptCheckpointError):
        rayckpt.read_manifest(path)
    with pytest.raises(CorruptCheckpointError):
        load_exact(path, expected)


def test_an_unknown_format_version_is_refused(tmp_path):
    (path, _, expected), *_ = chain(tmp_path / "run", 1)
    _edit_manifest(path, lambda d: d.update(version=6))
    with pytest.raises(FormatVersionError, match="6"):
        rayckpt.read_manifest(path)
    with pytest.raises(FormatVersionError, match="6"):
        load_exact(path, expected)


def test_a_dtype_change_with_the_same_bytes_is_written_again(tmp_path):
    parent = tmp_path / "run"
    rayckpt.save({"buf": torch.zeros(1000), "w": torch.randn(10)}, str(parent / "c0"), incremental=True)
    info = rayckpt.save(
        {"buf": torch.zeros(1000, dtype=torch.int32), "w": torch.randn(10)}, str(parent / "c1"), incremental=True
    )
    out = {"buf": torch.ones(1000, dtype=torch.int32), "w": torch.zeros(10)}
    rayckpt.load(out, str(parent / "c1"))
    assert torch.equal(out["buf"], torch.zeros(1000, dtype=torch.int32))
    assert rayckpt.verify(str(parent / "c0")).ok
    report = rayckpt.verify(str(parent / "c1"))
    assert report.ok, report.problems
    assert own_bytes(parent, info.save_id) >= 4000


def test_a_failed_incremental_save_leaves_nothing_in_the_store(tmp_path, monkeypatch):
    from rayckpt.engine import save as save_mod
    from rayckpt.errors import SaveFailedError

    parent = tmp_path / "run"
    saves = chain(parent, 2)
    before = set(store_files(parent))

    def refuse(*a, **kw):
        raise SaveFailedError("refused by the test")

    monkeypatch.setattr(save_mod, "commit_save", refuse)
    frozen, trained = saves[1][2]["frozen"], saves[1][2]["trained"] + 1
    with pytest.raises(SaveFailedError, match="refused by the test"):
        rayckpt.save(state(frozen, trained, 2), str(parent / "c2"), incremental=True)
    monkeypatch.undo()
    assert set(store_files(parent)) == before  # its own store files went, the ones it shared stayed
    assert not os.path.exists(parent / "c2")
    for path, _, expected in saves:
        load_exact(path, expected)
        assert rayckpt.verify(path).ok
    # the next save shares with the last committed one, never with the failed one
    info = rayckpt.save(state(frozen, trained, 2), str(parent / "c2"), incremental=True)
    owners = {shard_file_save_id(n) for n in named(parent / "c2")}
    assert owners <= {saves[0][1], saves[1][1], info.save_id} and len(owners) > 1
    load_exact(parent / "c2", state(frozen, trained, 2))


def test_overwriting_an_incremental_checkpoint_in_place(tmp_path):
    parent = tmp_path / "run"
    path = str(parent / "latest")
    frozen, trained = torch.randn(5000), torch.randn(100)
    for step in range(4):
        trained.add_(1)
        info = rayckpt.save(state(frozen, trained, step), path, incremental=True, overwrite=True)
        load_exact(path, state(frozen, trained, step))
        assert rayckpt.verify(path).ok
        assert set(store_files(parent)) == named(path)  # the replaced save's own files were collected
        if step:
            assert {shard_file_save_id(n) for n in named(path)} - {info.save_id}


def test_many_small_unchanged_tensors_are_shared(tmp_path):
    """A state of many small tensors (biases, norms) that did not change is not written again: the
    Arrow framing of each chunk (a few hundred bytes) must not count as changed bytes."""
    parent = tmp_path / "run"
    st = {f"t{i}": torch.randn(10) for i in range(200)}
    rayckpt.save(st, str(parent / "c0"), incremental=True)
    info = rayckpt.save(st, str(parent / "c1"), incremental=True)
    assert own_bytes(parent, info.save_id) == 0
    ci = rayckpt.inspect(str(parent / "c1"))
    assert ci.bytes_shared == 200 * 40 and ci.bytes_written == 0
    load_exact(parent / "c1", st)
