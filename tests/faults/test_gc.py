"""``rayckpt gc``: what crashed saves left is removed; committed files and live saves' files never are."""

from __future__ import annotations

import json
import os

import pytest

import rayckpt
from rayckpt.cli.commands import main
from rayckpt.format.manifest import MANIFEST_NAME
from rayckpt.storage import lease
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.lease import LEASE_PREFIX
from rayckpt.tools import gc
from tests.helpers.concurrent_workers import go, manifest_of, ready, result, save_worker, start, state_of

pytestmark = pytest.mark.slow


def listing(path: str) -> list[str]:
    return sorted(os.listdir(path))


def committed(path: str) -> list[str]:
    manifest = manifest_of(path)
    return sorted([MANIFEST_NAME, *manifest.table_files] + [f.path for f in manifest.files])


def test_gc_removes_what_crashed_saves_left_and_keeps_committed_and_live_files(tmp_path, capsys):
    run, sync = tmp_path / "run", str(tmp_path)
    step1, step2, step3 = (str(run / f"rayckpt-step-0000000{i}") for i in (1, 2, 3))
    rayckpt.save(state_of(1), step1)
    kept1 = committed(step1)
    # Two saves killed after writing their shards: over step1's checkpoint, and into a new step2.
    crashed = {name: start(save_worker, where, 9, sync, name, "commit") for name, where in (("x", step1), ("y", step2))}
    crashed_ids = {name: ready(sync, name) for name in crashed}
    for p in crashed.values():
        p.kill()
        p.join()
    live = start(save_worker, step3, 3, sync, "z", "commit")  # a save in flight, paused before its commit
    live_id = ready(sync, "z")
    before3 = listing(step3)
    assert any(n.endswith(".arrow") for n in before3) and f"{LEASE_PREFIX}{live_id}" in before3

    assert main(["gc", str(run), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("would remove 6 files")  # x and y: two shard files (float, int64) and a lease each
    assert f"kept the files of 1 save in flight: {live_id}" in out
    assert listing(step1) != kept1 and os.path.isdir(step2) and listing(step3) == before3  # nothing removed

    report = gc(str(run))
    gone = {os.path.basename(f.path) for f in report.removed}
    assert {n for n in gone if not n.startswith(LEASE_PREFIX)} == {
        n for n in gone if n.startswith(tuple(crashed_ids.values()))
    }
    assert {f"{LEASE_PREFIX}{i}" for i in crashed_ids.values()} <= gone
    assert report.live_saves == (live_id,) and report.directories == 3
    assert listing(step1) == kept1 and rayckpt.verify(step1).ok  # committed files untouched
    assert not os.path.exists(step2)  # the crashed save into a new directory left nothing
    assert listing(step3) == before3  # the live save's files and lease are kept
    go(sync, "z")
    assert result(sync, "z", live) == {"ok": True, "save_id": live_id}
    assert listing(step3) == committed(step3) and rayckpt.verify(step3).ok
    assert gc(str(run)).removed == ()


def test_gc_of_one_checkpoint_removes_orphans_and_dead_leases_and_reports_them(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    rayckpt.save(state_of(1), path)
    ckdir = CheckpointDir.resolve(path)
    dead = "20000101T000000-0000dead"
    lease.write_lease(ckdir, dead, ttl_s=-1)
    ckdir.write_atomic(f"{dead}-r00000-float.arrow", b"x" * 100)
    ckdir.write_atomic(f".{MANIFEST_NAME}.tmp-0123abcd", b"{")  # an interrupted manifest write
    assert main(["gc", path, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dry_run"] is False and report["bytes_removed"] >= 101
    assert sorted(os.path.basename(f["path"]) for f in report["removed"]) == sorted(
        [f".{MANIFEST_NAME}.tmp-0123abcd", f"{LEASE_PREFIX}{dead}", f"{dead}-r00000-float.arrow"]
    )
    assert "no manifest names it" in json.dumps(report)
    assert listing(path) == committed(path) and rayckpt.verify(path).ok


def test_gc_leaves_a_directory_whose_manifest_cannot_be_read_alone(tmp_path, capsys):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / MANIFEST_NAME).write_text("{not json")
    (path / "20000101T000000-0000dead-r00000-float.arrow").write_bytes(b"x")
    assert main(["gc", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("removed 0 files") and f"skipped {path}: manifest unreadable, nothing removed" in out
    assert len(os.listdir(path)) == 2


def test_gc_of_a_missing_path_is_a_usage_error(tmp_path, capsys):
    assert main(["gc", str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'}: no such directory" in capsys.readouterr().err


def test_gc_of_a_file_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["gc", str(tmp_path / "f")]) == 2
    assert f"{tmp_path / 'f'}: not a directory" in capsys.readouterr().err
