"""The commit protocol without Ray: a CommitTracker driven by hand, with real shard files and manifests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import rayckpt
from rayckpt.engine.writer import ShareSpec, write_chunks
from rayckpt.format.boxes import Box
from rayckpt.format.shard_file import ChunkData
from rayckpt.ray.metadata.commit_tracker import ORPHAN_TIMEOUT_S, CommitTracker
from rayckpt.ray.metadata.save_history import RUNS_KEPT, SETTLED_KEPT_PER_RUN, SaveHistory, SettledSave
from rayckpt.ray.records import SaveTarget
from rayckpt.storage.catalog import CatalogEntry
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import SaveSpec, WrittenFiles, WrittenShard, commit_save

ROWS, COLS, BLOCK = 8, 4, 64
DATA = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)


class Clock:
    """A wall clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def spec_of(save_id: str, world_size: int = 2) -> SaveSpec:
    return SaveSpec(
        save_id=save_id,
        world_size=world_size,
        block_size=BLOCK,
        tensors={"w": ("float32", (ROWS, COLS))},
        values={},
        metadata={"note": save_id},
    )


def at(save_id: str, **where) -> SaveTarget:
    """A report's record of the save (``run``, ``step``, ``location``, ``rank`` where it says them)."""
    return SaveTarget(save_id=save_id, **where)


def write_rank(path: str, save_id: str, rank: int, world_size: int = 2) -> WrittenShard:
    """Rank ``rank``'s dim-0 share of ``DATA``, written as a real shard file."""
    per = ROWS // world_size
    rows = np.ascontiguousarray(DATA[rank * per : (rank + 1) * per])
    chunk = ChunkData("w", "float32", Box((rank * per, 0), (per, COLS)), rows.reshape(-1).view(np.uint8))
    return write_chunks(
        WrittenFiles(CheckpointDir.resolve(path), save_id), [chunk], ShareSpec(rank=rank, block_size=BLOCK)
    )


def shard_files(path: str) -> list[str]:
    """The shard files at ``path`` (not the chunk table: ``loaded`` needs it, so it is checked there)."""
    if not os.path.isdir(path):
        return []
    return sorted(n for n in os.listdir(path) if n.endswith(".arrow") and not n.endswith("-chunks.arrow"))


def loaded(path: str) -> np.ndarray:
    out = {"w": torch.zeros(ROWS, COLS)}
    rayckpt.load(out, path)
    return out["w"].numpy()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def tracker(clock) -> CommitTracker:
    return CommitTracker(60.0, clock=clock)


def test_registered_first_commits_when_the_last_rank_reports(tracker, clock, tmp_path):
    path = str(tmp_path / "ck")
    assert tracker.begin_save(spec_of("s1"), at("s1", run="run", step=7, location=path)) == []
    assert tracker.report_written(at("s1"), write_rank(path, "s1", 0), "node-a") == []
    assert not os.path.exists(os.path.join(path, "manifest.json"))  # rank 1 is missing
    assert tracker.entry("s1").status == "pending" and tracker.settled_seconds("s1") is None
    clock.now += 2.5
    (outcome,) = tracker.report_written(at("s1"), write_rank(path, "s1", 1), "node-b")
    clock.now += 30  # rank 0 learns it later: what its commit line prints is still the commit's time
    assert tracker.settled_seconds("s1") == 2.5
    m = rayckpt.read_manifest(CheckpointDir.resolve(path))
    assert outcome.entry.status == "committed" and outcome.entry.bytes == m.total_bytes > 0
    assert outcome.entry.step == 7 and outcome.entry.world_size == 2 and outcome.entry.path == path
    assert outcome.writer_nodes == {0: "node-a", 1: "node-b"} and outcome.seconds == 2.5
    assert m.save_id == "s1" and m.user_metadata == {"note": "s1"} and len(m.files) == 2
    assert np.array_equal(loaded(path), DATA)
    assert tracker.entry("s1") == outcome.entry


def test_reports_before_the_registration_commit_only_once_it_arrives(tracker, tmp_path):
    path = str(tmp_path / "ck")
    for rank in (1, 0):
        assert tracker.report_written(at("s2"), write_rank(path, "s2", rank)) == []
    assert not os.path.exists(os.path.join(path, "manifest.json"))  # every rank wrote, nobody registered
    (outcome,) = tracker.begin_save(spec_of("s2"), at("s2", run="run", step=1, location=path))
    assert outcome.entry.status == "committed"
    assert np.array_equal(loaded(path), DATA)


def test_a_failure_report_fails_the_save_and_removes_its_files(tracker, tmp_path):
    path = str(tmp_path / "ck")
    tracker.begin_save(spec_of("s3"), at("s3", run="run", step=3, location=path))
    tracker.report_written(at("s3"), write_rank(path, "s3", 0))
    assert shard_files(path) == ["s3-r00000-float.arrow"]
    (outcome,) = tracker.report_failed(at("s3", rank=1), "disk full")
    assert outcome.entry.status == "failed" and outcome.entry.error == "rank 1: disk full"
    assert not os.path.exists(path)  # its file, then the empty directory
    assert tracker.report_failed(at("s3", rank=0), "again") == []  # settled once

    # A rank whose files became durable only after the failure: removed on arrival.
    late = write_rank(path, "s3", 1)
    assert shard_files(path) == ["s3-r00001-float.arrow"]
    assert tracker.report_written(at("s3"), late) == []
    assert shard_files(path) == [] and tracker.entry("s3").status == "failed"


def test_a_failed_save_leaves_the_committed_checkpoint_at_its_location(tracker, tmp_path):
    path = str(tmp_path / "ck")
    tracker.begin_save(spec_of("old"), at("old", run="run", step=1, location=path))
    for rank in (0, 1):
        tracker.report_written(at("old"), write_rank(path, "old", rank))
    tracker.begin_save(spec_of("new"), at("new", run="run", step=2, location=path))
    tracker.report_written(at("new"), write_rank(path, "new", 0))
    (outcome,) = tracker.report_failed(at("new", rank=1), "oom")
    assert outcome.entry.status == "failed"
    assert shard_files(path) == ["old-r00000-float.arrow", "old-r00001-float.arrow"]
    assert rayckpt.read_manifest(CheckpointDir.resolve(path)).save_id == "old"


def test_a_failure_before_the_registration_names_and_cleans_the_save(tracker, tmp_path):
    path = tmp_path / "early"
    path.mkdir()
    (path / "s4-r00001-float.arrow").write_bytes(b"partial")
    (outcome,) = tracker.report_failed(at("s4", run="early", step=5, location=str(path), rank=1), "staging: OSError")
    assert (outcome.entry.run, outcome.entry.step, outcome.entry.path) == ("early", 5, str(path))
    assert not path.exists()
    assert (
        tracker.begin_save(spec_of("s4"), at("s4", run="early", step=5, location=str(path))) == []
    )  # nothing left to commit
    assert tracker.entry("s4").status == "failed" and "rank 1: staging: OSError" in tracker.entry("s4").error


def test_a_save_past_its_deadline_fails_naming_the_missing_ranks(tracker, clock, tmp_path):
    path = str(tmp_path / "ck")
    tracker.begin_save(
        spec_of("s5", world_size=4),
        at("s5", run="run", step=1, location=path),
        timeout_s=10.0,
    )
    tracker.begin_save(
        spec_of("patient", world_size=2),
        at("patient", run="run", step=2, location=str(tmp_path / "p")),
    )  # the default: 60 s
    tracker.report_written(at("s5"), write_rank(path, "s5", 2, world_size=4))
    clock.now += 9
    assert tracker.expire() == []
    clock.now += 2
    (outcome,) = tracker.expire()
    assert outcome.entry.save_id == "s5" and outcome.entry.status == "failed"
    assert outcome.entry.error == "rank(s) [0, 1, 3] did not report within 10s"
    assert not os.path.exists(path)  # rank 2's file removed
    assert tracker.entry("patient").status == "pending" and tracker.has_pending()
    assert [o.entry.save_id for o in tracker.expire(now=clock.now + 60)] == ["patient"]
    assert not tracker.has_pending()


def test_files_of_a_save_nobody_registers_are_removed_once_the_orphan_timeout_passes(tracker, clock, tmp_path):
    path = str(tmp_path / "ck")
    tracker.report_written(at("s6", location=path), write_rank(path, "s6", 1), "node-a")
    assert tracker.has_pending() and tracker.counts()["unregistered"] == 1
    clock.now += ORPHAN_TIMEOUT_S - 1
    assert tracker.expire() == [] and shard_files(path) == ["s6-r00001-float.arrow"]
    clock.now += 2
    (outcome,) = tracker.expire()
    assert outcome.entry.status == "failed" and outcome.entry.path == path
    assert outcome.entry.error == (
        f"rank(s) [1] wrote files, but rank 0 did not register the save with this MetadataActor within "
        f"{ORPHAN_TIMEOUT_S:g}s (it restarted, or rank 0 died)"
    )
    assert not os.path.exists(path) and not tracker.has_pending()
    assert (
        tracker.begin_save(spec_of("s6"), at("s6", run="run", step=1, location=path)) == []
    )  # too late: it stays failed
    assert tracker.entry("s6").status == "failed"


def test_the_orphan_timeout_is_never_longer_than_the_commit_timeout(clock, tmp_path):
    tracker = CommitTracker(5.0, clock=clock)
    tracker.report_written(at("s6", location=str(tmp_path / "ck")), write_rank(str(tmp_path / "ck"), "s6", 0))
    clock.now += 6
    assert [o.entry.status for o in tracker.expire()] == ["failed"]


def test_a_save_of_an_earlier_incarnation_fails_at_once_and_its_files_go(tracker, tmp_path):
    path = str(tmp_path / "ck")
    # The writer's report reaches the restarted actor, which never saw the registration.
    tracker.report_written(at("s9", run="run", step=2, location=path), write_rank(path, "s9", 0), "node-a")
    (outcome,) = tracker.lost(at("s9", run="run", step=2, location=path, rank=0), "the MetadataActor restarted")
    assert outcome.entry.status == "failed" and outcome.entry.error == "the MetadataActor restarted"
    assert [(e.step, e.status) for e in tracker.catalog("run")] == [(2, "failed")]
    assert not os.path.exists(path)
    # The waiting rank asks next: already settled, answered at once.
    assert tracker.lost(at("s9", run="run", step=2, location=path, rank=0), "again") == []
    assert tracker.entry("s9").status == "failed"
    # A rank that only waits (its writer reported to the dead incarnation): its save id's files go too.
    other = str(tmp_path / "other")
    write_rank(other, "s10", 1)
    (outcome,) = tracker.lost(at("s10", run="run", step=3, location=other, rank=1), "the MetadataActor restarted")
    assert (outcome.entry.run, outcome.entry.step, outcome.entry.status) == ("run", 3, "failed")
    assert not os.path.exists(other)


def test_a_save_an_earlier_incarnation_committed_is_found_in_storage_and_kept(tracker, tmp_path):
    path = str(tmp_path / "ck")
    shards = [write_rank(path, "s11", r) for r in (0, 1)]
    commit_save(CheckpointDir.resolve(path), spec_of("s11"), shards)  # then that incarnation died
    (outcome,) = tracker.report_failed(
        at("s11", run="run", step=4, location=path, rank=1), "the writer's report was cut off"
    )
    assert outcome.entry.status == "committed" and outcome.entry.bytes > 0 and outcome.entry.step == 4
    assert tracker.lost(at("s11", run="run", step=4, location=path, rank=0), "restarted") == []
    assert shard_files(path) == ["s11-r00000-float.arrow", "s11-r00001-float.arrow"]
    assert np.array_equal(loaded(path), DATA)


def test_lost_spares_a_save_registered_here_unless_the_asking_ranks_files_went_elsewhere(tracker, tmp_path):
    path = str(tmp_path / "ck")
    tracker.begin_save(
        spec_of("s12"), at("s12", run="run", step=1, location=path)
    )  # rank 0's registration reached this incarnation
    tracker.report_written(at("s12"), write_rank(path, "s12", 0))
    assert tracker.lost(at("s12", rank=0), "restarted") == []  # rank 0's files were reported here
    (outcome,) = tracker.lost(at("s12", rank=1), "restarted")  # rank 1's report went to the incarnation that died
    assert outcome.entry.status == "failed" and not os.path.exists(path)


def test_a_repeated_report_of_a_committed_save_leaves_its_files(tracker, tmp_path):
    path = str(tmp_path / "ck")
    tracker.begin_save(spec_of("s13"), at("s13", run="run", step=1, location=path))
    shards = [write_rank(path, "s13", r) for r in (0, 1)]
    for shard in shards:
        tracker.report_written(at("s13"), shard)
    assert tracker.report_written(at("s13"), shards[1]) == []
    assert np.array_equal(loaded(path), DATA)


def test_settled_saves_keep_only_a_bounded_history_of_small_entries(tracker, tmp_path):
    def commit(save_id: str, run: str) -> None:
        path = str(tmp_path / save_id)
        tracker.begin_save(spec_of(save_id), at(save_id, run=run, step=1, location=path))
        for rank in (0, 1):
            tracker.report_written(at(save_id), write_rank(path, save_id, rank))

    for i in range(SETTLED_KEPT_PER_RUN + 8):
        commit(f"a{i}", "a")
    assert tracker.counts() == {"in_flight": 0, "unregistered": 0, "settled": SETTLED_KEPT_PER_RUN, "runs": 1}
    assert tracker._saves == {}  # no spec, no chunk records, no checksums kept
    kept = {e.save_id for e in tracker.catalog("a")}
    assert kept == {f"a{i}" for i in range(8, SETTLED_KEPT_PER_RUN + 8)}  # the newest
    assert tracker.entry("a0") == CatalogEntry(
        run="", step=None, path="", status="pending", created=0.0, world_size=0, bytes=0, save_id="a0"
    )  # forgotten
    assert tracker.entry("a8").status == "committed"
    for r in range(RUNS_KEPT):  # one save in each of as many other runs as are kept: run "a" goes
        commit(f"r{r}", f"run{r}")
    assert tracker.counts()["runs"] == RUNS_KEPT and tracker.counts()["settled"] == RUNS_KEPT
    assert tracker.catalog("a") == [] and tracker.entry("r0").status == "committed"


def test_save_history_bounds_runs_by_recent_activity():
    def settled(run: str, save_id: str) -> SettledSave:
        return SettledSave(
            CatalogEntry(
                run=run,
                step=1,
                path=f"/{save_id}",
                status="committed",
                created=0.0,
                world_size=1,
                bytes=0,
                save_id=save_id,
            ),
            None,
        )

    history = SaveHistory(per_run=2, runs=2)
    for run, save_id in (("x", "x1"), ("y", "y1"), ("x", "x2"), ("x", "x3"), ("z", "z1")):
        history.add(settled(run, save_id))
    assert [d.entry.save_id for d in history.of_run("x")] == ["x2", "x3"]
    assert history.of_run("y") == [] and history.get("y1") is None  # least recently active run forgotten
    assert len(history) == 3 and history.run_count() == 2
    history.add(settled("z", "x3"))  # one id settles once; re-adding moves it
    assert [d.entry.save_id for d in history.of_run("x")] == ["x2"] and history.get("x3").entry.run == "z"


def test_fail_pending_fails_only_that_runs_saves_in_flight(tracker, tmp_path):
    def begin(save_id: str, run: str) -> str:
        path = str(tmp_path / save_id)
        tracker.begin_save(spec_of(save_id), at(save_id, run=run, step=1, location=path))
        tracker.report_written(at(save_id), write_rank(path, save_id, 0))
        return path

    done = begin("done", "a")
    tracker.report_written(at("done"), write_rank(done, "done", 1))
    lost, other = begin("lost", "a"), begin("other", "b")
    outcomes = tracker.fail_pending("a", "worker group failed: boom")
    assert [(o.entry.save_id, o.entry.error) for o in outcomes] == [("lost", "worker group failed: boom")]
    assert not os.path.exists(lost) and shard_files(other) == ["other-r00000-float.arrow"]
    assert tracker.entry("done").status == "committed" and tracker.entry("other").status == "pending"
    assert tracker.fail_pending("a", "again") == []


def test_the_catalog_holds_the_last_tracked_save_per_location(tracker, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    tracker.begin_save(spec_of("a1"), at("a1", run="run", step=1, location=a))
    assert [(e.save_id, e.status) for e in tracker.catalog("run")] == [("a1", "pending")]
    for rank in (0, 1):
        tracker.report_written(at("a1"), write_rank(a, "a1", rank))
    tracker.begin_save(spec_of("b2"), at("b2", run="run", step=2, location=b))
    tracker.report_failed(at("b2", rank=0), "boom")
    assert [(e.step, e.save_id, e.status) for e in tracker.catalog("run")] == [
        (1, "a1", "committed"),
        (2, "b2", "failed"),
    ]
    tracker.begin_save(spec_of("a3"), at("a3", run="run", step=3, location=a))  # a new save at a's location
    assert [(e.step, e.save_id, e.status) for e in tracker.catalog("run")] == [
        (2, "b2", "failed"),
        (3, "a3", "pending"),
    ]
    assert tracker.catalog("other run") == []


def test_a_commit_that_raises_fails_the_save_and_removes_its_files(clock, tmp_path):
    def commit(ckdir, spec, shards):
        raise OSError("manifest write refused")

    tracker = CommitTracker(60.0, commit=commit, clock=clock)
    path = str(tmp_path / "ck")
    tracker.begin_save(spec_of("s7"), at("s7", run="run", step=1, location=path))
    tracker.report_written(at("s7"), write_rank(path, "s7", 0))
    (outcome,) = tracker.report_written(at("s7"), write_rank(path, "s7", 1))
    assert outcome.entry.status == "failed" and outcome.entry.error == "commit: OSError: manifest write refused"
    assert not os.path.exists(path)


def test_a_failure_during_the_commit_does_not_remove_the_files_the_manifest_names(clock, tmp_path):
    during: list = []

    def commit(ckdir, spec, shards):
        # Arrives while the manifest is being written: every rank's files are durable, the commit wins.
        during.append(tracker.report_failed(at("s8", rank=0), "late news") + tracker.expire(now=clock.now + 3600))
        return commit_save(ckdir, spec, shards)

    tracker = CommitTracker(60.0, commit=commit, clock=clock)
    path = str(tmp_path / "ck")
    tracker.begin_save(spec_of("s8"), at("s8", run="run", step=1, location=path))
    tracker.report_written(at("s8"), write_rank(path, "s8", 0))
    (outcome,) = tracker.report_written(at("s8"), write_rank(path, "s8", 1))
    assert during == [[]] and outcome.entry.status == "committed"
    assert np.array_equal(loaded(path), DATA)


def test_the_ray_side_parts_import_no_ray():
    script = (
        "import json, sys, rayckpt.ray.metadata.commit_tracker, rayckpt.ray.metadata.plan_cache, "
        "rayckpt.ray.metadata.save_history; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded_modules = json.loads(proc.stdout)
    assert "rayckpt.ray.metadata.plan_cache" in loaded_modules
    assert not [m for m in loaded_modules if m == "ray" or m.startswith("ray.")]
