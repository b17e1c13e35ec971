"""Two saves to one checkpoint location at once, in real processes: never a mix, never a silent loss.

Each save runs in its own process (``workers``) and pauses where a test asks, so
the interleavings that used to lose both saves (each commit deleting the other's
files) are forced, not hoped for. Whatever the interleaving, every save either
commits or raises ``SaveFailedError`` naming the location and the other save;
the manifest left names files that all exist and verify, holds exactly one of
the two states, and nothing of the loser is left.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

import pytest
import torch

import rayckpt
from rayckpt.format.manifest import MANIFEST_NAME
from rayckpt.ray.metadata.commit_tracker import COMMITTED, FAILED, CommitTracker
from rayckpt.ray.records import SaveTarget
from rayckpt.storage import lease
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import SaveSpec, commit_save
from rayckpt.storage.lease import LEASE_PREFIX
from rayckpt.testing.multiproc import run_ranks
from tests.helpers import concurrent_workers as workers
from tests.helpers.concurrent_workers import (
    assert_one_whole_checkpoint,
    assert_refused_naming,
    go,
    group_save,
    manifest_of,
    race_two_claims,
    ready,
    result,
    save_worker,
    start,
    state_of,
)

pytestmark = pytest.mark.slow


def test_a_save_in_flight_refuses_a_second_save_to_its_location_naming_it(tmp_path):
    path, sync = str(tmp_path / "ckpt"), str(tmp_path)
    rayckpt.save(state_of(1), path)  # an older checkpoint there
    a = start(save_worker, path, 2, sync, "a", "commit")
    a_id = ready(sync, "a")  # a's shard files are written, its commit is next
    b = start(save_worker, path, 3, sync, "b")
    assert_refused_naming(result(sync, "b", b), path, a_id)
    assert "refused before writing anything" in json.dumps(result(sync, "b", b))
    go(sync, "a")
    assert result(sync, "a", a) == {"ok": True, "save_id": a_id}
    assert assert_one_whole_checkpoint(path, (2,)) == 2


def test_two_saves_claiming_at_once_let_exactly_one_through(tmp_path):
    path, sync = str(tmp_path / "ckpt"), str(tmp_path)
    won = race_two_claims(lambda name, value: start(save_worker, path, value, sync, name, "claim"), path, sync)
    assert assert_one_whole_checkpoint(path, (1, 2)) == won


@pytest.mark.parametrize("round_", range(4))
def test_concurrent_saves_with_staggered_starts_never_mix(tmp_path, round_):
    path, sync = str(tmp_path / "ckpt"), str(tmp_path)
    rng = random.Random(round_)
    procs = {
        name: start(save_worker, path, value, sync, name, None, rng.uniform(0, 0.15))
        for name, value in (("a", 10 + round_), ("b", 20 + round_))
    }
    outcomes = {name: result(sync, name, p) for name, p in procs.items()}
    ok = {name: o["save_id"] for name, o in outcomes.items() if o["ok"]}
    assert ok, outcomes  # one of them always gets through
    for o in outcomes.values():
        if not o["ok"]:
            (winner,) = ok.values()
            assert_refused_naming(o, path, winner)
    step = assert_one_whole_checkpoint(path, (10 + round_, 20 + round_))
    assert manifest_of(path).save_id == ok["a" if step < 20 else "b"]


def test_two_process_groups_every_rank_of_the_refused_one_names_the_save_in_flight(tmp_path):
    path, sync = str(tmp_path / "ckpt"), str(tmp_path)
    a_outcomes: list = []
    a = threading.Thread(target=lambda: a_outcomes.extend(run_ranks(group_save, 2, path, 1, sync, "a", "commit")))
    a.start()
    a_id = ready(sync, "a")  # group a's ranks wrote their shards; rank 0 is about to commit
    b_outcomes = run_ranks(group_save, 2, path, 2, sync, "b", None)
    go(sync, "a")
    a.join(120)
    assert a_outcomes == [{"ok": True, "save_id": a_id}] * 2
    for o in b_outcomes:
        assert_refused_naming(o, path, a_id)
    assert assert_one_whole_checkpoint(path, (1,)) == 1


def test_a_save_whose_lease_lapsed_does_not_commit_over_the_save_that_took_over(tmp_path):
    path, sync = str(tmp_path / "ckpt"), str(tmp_path)
    a = start(save_worker, path, 1, sync, "a", "commit")
    a_id = ready(sync, "a")
    ckdir = CheckpointDir.resolve(path)
    lease.write_lease(ckdir, a_id, lease.HELD, ttl_s=-1)  # as if a had stalled past its TTL
    b_id = rayckpt.save(state_of(2), path).save_id  # a's lease is dead: b claims, commits, sweeps a's files
    go(sync, "a")
    outcome = result(sync, "a", a)
    assert_refused_naming(outcome, path, b_id)
    assert "committed there after this save claimed" in outcome["error"]
    assert assert_one_whole_checkpoint(path, (2,)) == 2


def test_the_commit_sweep_keeps_the_files_of_a_save_with_a_live_lease(tmp_path):
    path = str(tmp_path / "ckpt")
    ckdir = CheckpointDir.resolve(path)
    rayckpt.save(state_of(1), path)
    # Another save (another host: its pid means nothing here) holds a live lease and wrote a file.
    other = "20990101T000000-0000abcd"
    ckdir.write_atomic(
        f"{LEASE_PREFIX}{other}",
        json.dumps({"state": "claiming", "owner": "elsewhere/pid:[1]", "pid": 1, "expires": time.time() + 60}).encode(),
    )
    ckdir.write_atomic(f"{other}-r00000-float.arrow", b"in flight")
    # A crashed save: a dead lease and its file.
    crashed = "20000101T000000-0000dead"
    lease.write_lease(ckdir, crashed, ttl_s=-1)
    ckdir.write_atomic(f"{crashed}-r00000-float.arrow", b"orphan")
    manifest = commit_save(ckdir, spec_of("20500101T000000-00000001", state_of(3)), [])
    assert manifest.save_id.startswith("2050")
    names = set(os.listdir(path))
    assert {f"{other}-r00000-float.arrow", f"{LEASE_PREFIX}{other}"} <= names
    assert not {f"{crashed}-r00000-float.arrow", f"{LEASE_PREFIX}{crashed}"} & names


def spec_of(save_id: str, state: dict) -> SaveSpec:
    """A spec with values only (no tensors), for commits driven by hand."""
    return SaveSpec(
        save_id=save_id, world_size=1, block_size=64, tensors={}, values={"step": state["step"]}, metadata={}
    )


def test_a_live_lease_of_a_dead_process_on_this_host_does_not_block(tmp_path):
    path = str(tmp_path / "ckpt")
    ckdir = CheckpointDir.resolve(path)
    proc = start(time.sleep, 0)
    proc.join()
    ckdir.makedirs()
    ckdir.write_atomic(
        f"{LEASE_PREFIX}20000101T000000-00000bad",
        json.dumps(
            {"state": "held", "owner": lease.owner_id(), "pid": proc.pid, "expires": time.time() + 600}
        ).encode(),
    )
    rayckpt.save(state_of(5), path)  # the owner is gone: its lease is dead
    assert assert_one_whole_checkpoint(path, (5,)) == 5  # and the sweep removed it


def test_overwrite_false_is_refused_by_a_live_save_then_by_the_committed_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    ckdir = CheckpointDir.resolve(path)
    held = "20990101T000000-00000001"
    lease.write_lease(ckdir, held)  # a save of this process holds the location
    with pytest.raises(rayckpt.SaveFailedError, match=f"{path}: another save is writing.*{held}"):
        rayckpt.save(state_of(1), path, overwrite=False)
    lease.release_lease(ckdir, held)
    rayckpt.save(state_of(1), path, overwrite=False)
    with pytest.raises(rayckpt.CheckpointExistsError, match="already holds a committed checkpoint"):
        rayckpt.save(state_of(2), path, overwrite=False)
    assert assert_one_whole_checkpoint(path, (1,)) == 1


def test_the_tracker_keeps_the_lease_fresh_and_refuses_a_commit_into_a_location_someone_else_holds(tmp_path):
    path = str(tmp_path / "ckpt")
    ckdir = CheckpointDir.resolve(path)
    tracker = CommitTracker(600)
    spec = spec_of("20260101T000000-0000000a", state_of(1))
    lease.claim_location(ckdir, spec.save_id)
    tracker.begin_save(
        spec, SaveTarget(save_id=spec.save_id, run="run", step=1, location=path)
    )  # world of 1, no shard reported yet
    before = lease.read_leases(ckdir)[0]
    tracker.refresh_leases(now=time.time() + 3600)
    after = lease.read_leases(ckdir)[0]
    assert after.expires > before.expires and after.pid == os.getpid()
    # Another run's save took the location over (as if this one had stalled): the commit is refused.
    lease.write_lease(ckdir, "20260101T000000-0000000b", lease.HELD)
    (outcome,) = tracker.report_written(SaveTarget(save_id=spec.save_id), _no_files())
    assert outcome.entry.status == FAILED and "20260101T000000-0000000b" in outcome.entry.error
    assert "owns this location (this save's lease lapsed)" in outcome.entry.error
    assert not os.path.exists(os.path.join(path, MANIFEST_NAME))
    assert {x.save_id for x in lease.read_leases(ckdir)} == {"20260101T000000-0000000b"}  # its own lease went
    lease.release_lease(ckdir, "20260101T000000-0000000b")
    spec2 = spec_of("20260101T000000-0000000c", state_of(2))
    tracker.begin_save(spec2, SaveTarget(save_id=spec2.save_id, run="run", step=2, location=path))
    (outcome,) = tracker.report_written(SaveTarget(save_id=spec2.save_id), _no_files())
    assert outcome.entry.status == COMMITTED and lease.read_leases(ckdir) == []


def _no_files():
    from rayckpt.storage.commit import WrittenShard

    return WrittenShard(0, (), ())


def test_two_imports_into_one_new_directory_one_wins_the_other_names_it(tmp_path):
    src, dst, sync = str(tmp_path / "src.pt"), str(tmp_path / "dst"), str(tmp_path)
    torch.save(state_of(7), src)
    a = start(workers.import_worker, src, dst, sync, "a", "import")
    a_id = ready(sync, "a")  # a claimed dst and is about to write
    b = start(workers.import_worker, src, dst, sync, "b")
    assert_refused_naming(result(sync, "b", b), dst, a_id)
    go(sync, "a")
    assert result(sync, "a", a)["ok"]
    assert manifest_of(dst).save_id == a_id
    assert assert_one_whole_checkpoint(dst, (7,)) == 7
    # Once a committed, another import into dst is refused as before: the destination exists.
    with pytest.raises(ValueError, match="already exists"):
        rayckpt.convert(src, dst, from_="torch")


def test_two_imports_claiming_at_once_leave_one_checkpoint(tmp_path):
    src, dst, sync = str(tmp_path / "src.pt"), str(tmp_path / "dst"), str(tmp_path)
    torch.save(state_of(8), src)
    procs = {name: start(workers.import_worker, src, dst, sync, name, "claim") for name in ("a", "b")}
    ids = {name: ready(sync, name) for name in procs}
    for name in procs:
        go(sync, name)
    outcomes = {name: result(sync, name, p) for name, p in procs.items()}
    winner = min(ids, key=ids.get)
    loser = "b" if winner == "a" else "a"
    assert outcomes[winner]["ok"], outcomes
    assert_refused_naming(outcomes[loser], dst, ids[winner])
    assert manifest_of(dst).save_id == ids[winner]
    assert_one_whole_checkpoint(dst, (8,))


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_two_exports_to_one_destination_one_wins_the_other_removes_its_output(tmp_path, fmt):
    ckpt, sync = str(tmp_path / "ckpt"), str(tmp_path)
    rayckpt.save(state_of(4), ckpt)
    dst = str(tmp_path / ("out.pt" if fmt == "torch" else "out"))
    a = start(workers.export_worker, ckpt, dst, fmt, sync, "a", "publish")
    ready(sync, "a")  # a's output is complete beside dst, not yet published
    b = start(workers.export_worker, ckpt, dst, fmt, sync, "b")
    assert result(sync, "b", b) == {"ok": True, "save_id": dst}
    go(sync, "a")
    outcome = result(sync, "a", a)
    assert outcome["type"] == "SaveFailedError" and f"{dst}: another writer" in outcome["error"], outcome
    sync_files = [f for f in os.listdir(sync) if f.startswith(("a.", "b."))]
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", os.path.basename(dst), *sync_files])  # no leftovers
    if fmt == "torch":
        loaded = torch.load(dst, weights_only=True)
        assert torch.equal(loaded["w"], state_of(4)["w"])


def test_a_location_where_no_lease_can_be_written_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(rayckpt.SaveFailedError, match=r"file/ckpt: cannot write the save's lease there"):
        rayckpt.save(state_of(1), str(tmp_path / "file" / "ckpt"))


def test_a_claim_gives_up_on_a_rival_that_neither_wins_nor_goes(tmp_path):
    ckdir = CheckpointDir.resolve(str(tmp_path / "ckpt"))
    rival = "20990101T000000-0000ffff"  # a larger id, claiming, on another host: we wait for it, then give up
    ckdir.makedirs()
    ckdir.write_atomic(
        f"{LEASE_PREFIX}{rival}",
        json.dumps({"state": "claiming", "owner": "elsewhere/x", "pid": 1, "expires": time.time() + 60}).encode(),
    )
    with pytest.raises(rayckpt.SaveFailedError, match=f"another save is writing this checkpoint: save {rival}"):
        lease.claim_location(ckdir, "20260101T000000-00000001", wait_s=0.2)
    assert os.listdir(ckdir.fs_path) == [f"{LEASE_PREFIX}{rival}"]  # our lease went again


def test_an_unreadable_lease_counts_as_live_for_one_ttl_after_it_was_written(tmp_path):
    ckdir = CheckpointDir.resolve(str(tmp_path / "ckpt"))
    garbled = tmp_path / "ckpt" / f"{LEASE_PREFIX}20000101T000000-00000bad"
    ckdir.makedirs()
    garbled.write_bytes(b"{trunc")
    with pytest.raises(rayckpt.SaveFailedError, match="save 20000101T000000-00000bad"):
        rayckpt.save(state_of(1), ckdir.fs_path)
    old = time.time() - lease.LEASE_TTL_S - 1
    os.utime(garbled, (old, old))
    rayckpt.save(state_of(1), ckdir.fs_path)  # dead now: saved, and the commit removed it
    assert assert_one_whole_checkpoint(ckdir.fs_path, (1,)) == 1
