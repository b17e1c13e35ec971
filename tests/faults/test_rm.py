"""``rayckpt rm`` against real saves in other processes, each stopped at a chosen point (no timing)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import rayckpt
from rayckpt.tools import removal
from tests.helpers.concurrent_workers import go, ready, result, save_worker, start, state_of

pytestmark = pytest.mark.slow


def test_rm_refuses_a_save_in_flight_then_removes_the_checkpoint_it_committed(tmp_path):
    ckpt, sync = str(tmp_path / "run" / "rayckpt-step-00000001"), str(tmp_path)
    rayckpt.save(state_of(1), ckpt)
    live = start(save_worker, ckpt, 2, sync, "z", "commit")  # shards written, paused before its commit
    live_id = ready(sync, "z")
    before = sorted(os.listdir(ckpt))
    r = subprocess.run(
        [sys.executable, "-m", "rayckpt", "rm", ckpt, "--yes"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr.startswith(f"rayckpt: error: {ckpt}: a save is writing this checkpoint: save {live_id} (held by")
    assert sorted(os.listdir(ckpt)) == before  # nothing removed
    go(sync, "z")
    assert result(sync, "z", live) == {"ok": True, "save_id": live_id}
    assert rayckpt.verify(ckpt).ok
    report = rayckpt.tools.remove(ckpt)
    assert report.save_id == live_id and not os.path.exists(ckpt)


def test_a_save_that_starts_while_rm_runs_is_refused(tmp_path, monkeypatch):
    ckpt, sync = str(tmp_path / "c"), str(tmp_path)
    rayckpt.save(state_of(1), ckpt)
    real_claim = removal.claim_location
    outcome = {}

    def claim_then_a_save_starts(ckdir, save_id, **kw):
        previous = real_claim(ckdir, save_id, **kw)
        outcome["rm"] = save_id
        outcome["save"] = result(sync, "late", start(save_worker, ckpt, 3, sync, "late"))
        return previous

    monkeypatch.setattr(removal, "claim_location", claim_then_a_save_starts)
    rayckpt.tools.remove(ckpt)
    assert outcome["save"]["type"] == "SaveFailedError", outcome
    assert f"another save is writing this checkpoint: save {outcome['rm']}" in outcome["save"]["error"]
    assert not os.path.exists(ckpt)  # rm finished, and the refused save left nothing there (no lease, no shard)
