"""``Checkpointer.restore`` falls back to the last good checkpoint, loudly; when none loads it names them all.

Real TorchTrainer runs on the session's local Ray: a run saves steps 2 and 3, a
test damages (or adds to) a copy of what storage holds, and a second ``fit`` of the
copy (Ray Train hands it step 3 as its latest) restores.
"""

from __future__ import annotations

import logging
import os
import re
import shutil

import pytest
import ray
import torch
from ray.train import WorkerGroupError

import rayckpt
from rayckpt.errors import RestoreFailedError
from rayckpt.ray import metrics
from rayckpt.ray.metadata.actor import get_metadata_actor
from rayckpt.train import checkpointer as checkpointer_module
from rayckpt.train.checkpointer import Checkpointer
from tests.helpers.checkpoints import flip_byte, manifest_of, rewrite_manifest
from tests.helpers.ray_train import fit
from tests.ray.test_train import driver_output

pytestmark = pytest.mark.slow

WORKERS = 2


def step_dir(storage, run: str, step: int) -> str:
    return str(storage / run / f"rayckpt-step-{step:08d}")


@pytest.fixture(scope="module")
def saved(ray_session, tmp_path_factory):
    """One run of ``WORKERS`` workers that committed steps 2 and 3 (its storage root, its name): each test
    restores a copy of it (``saved_run``), so the module trains it once."""
    storage, out = tmp_path_factory.mktemp("fallback-saved") / "storage", tmp_path_factory.mktemp("fallback-out")
    fit(storage, out, WORKERS, 3, {2, 3}, name="fallback-saved")
    return storage, "fallback-saved"


def saved_run(saved, tmp_path, run: str):
    """The saved run copied to ``run`` under a storage of this test's (Ray Train's records name checkpoints by
    directory, so the copy is that run as if it had trained there, its manifests naming ``run``); (storage, out dir)."""
    source, name = saved
    storage, out = tmp_path / "storage", tmp_path / "out"
    out.mkdir()
    shutil.copytree(source / name, storage / run)
    for step in (2, 3):
        rewrite_manifest(step_dir(storage, run, step), lambda doc: doc["user_metadata"].update(run=run))
    return storage, out


def a_chunk(path: str) -> dict:
    """The first stored chunk of a tensor with data (its file, byte offset and length)."""
    doc = manifest_of(path)
    chunks = (c for e in doc["entries"].values() if e.get("kind") == "tensor" for c in e["chunks"])
    return next(c for c in chunks if c["byte_length"])


def remove_a_shard_file(path: str) -> str:
    name = a_chunk(path)["file"]
    os.remove(os.path.join(path, name))
    return name


def flip_a_payload_byte(path: str) -> str:
    chunk = a_chunk(path)
    flip_byte(path, chunk["file"], chunk["byte_offset"])
    return chunk["file"]


def corrupt_the_manifest(path: str) -> str:
    with open(os.path.join(path, "manifest.json"), "r+") as f:
        f.truncate(100)
    return "manifest.json"


def fallback_events(run: str) -> list[dict]:
    return [e for e in ray.get(get_metadata_actor().events.remote(run)) if e["kind"] == "restore_fallback"]


def test_damaged_newest_checkpoints_restore_the_last_good_one_with_a_warning_each(saved, tmp_path, capfd):
    """Two damaged checkpoints, one restore. Step 4 (committed after Ray Train's latest, so never registered)
    has a corrupt manifest: the catalog lists it corrupt and it is passed over. Step 3 (Ray Train's latest)
    has a flipped payload byte: its load fails a checksum. Step 2 is restored, never a fresh start; one
    WARNING (rank 0's) and one event for each checkpoint passed over, naming both and the reason."""
    run = "fallback-damaged"
    storage, out = saved_run(saved, tmp_path, run)
    corrupt, latest, previous = (step_dir(storage, run, step) for step in (4, 3, 2))
    shutil.copytree(latest, corrupt)
    damaged = {4: corrupt_the_manifest(corrupt), 3: flip_a_payload_byte(latest)}
    capfd.readouterr()

    fit(storage, out, WORKERS, 5, {5}, name=run)

    restored = torch.load(out / f"restored-{WORKERS}.pt", weights_only=False)
    assert restored["step"] == 2
    assert restored["load"].path.rstrip("/").endswith("rayckpt-step-00000002")
    falls = [(4, corrupt, "JSON", 3, latest), (3, latest, "checksum", 2, previous)]
    patterns = [
        rf"rayckpt: run {run}: cannot restore step {step} from {re.escape(path)} \(.*{reason}.*\); "
        rf"restoring step {next_step} from {re.escape(next_path)} instead"
        for step, path, reason, next_step, next_path in falls
    ]
    seen = driver_output(capfd, [*patterns, r"rayckpt: \S+ committed step 5"])
    for (step, *_), pattern in zip(falls, patterns):
        assert len(re.findall(pattern, seen)) == 1, seen[-4000:]
        assert damaged[step] in re.search(pattern, seen).group(0)
    # counted where the driver can see it: the MetadataActor's events, in the order they happened
    events = fallback_events(run)
    assert [(e["step"], e["path"], e["next_step"], e["next"]) for e in events] == [
        (step, path, next_step, next_path) for step, path, _, next_step, next_path in falls
    ]
    for (_, _, reason, _, _), event in zip(falls, events):
        assert reason in event["reason"], event
    # the run went on from step 2 and committed step 5; the damaged checkpoints were left as they were
    assert rayckpt.verify(step_dir(storage, run, 5)).ok
    assert not rayckpt.verify(latest).ok
    assert os.path.getsize(os.path.join(corrupt, "manifest.json")) == 100


def test_a_commit_ray_train_has_not_registered_yet_is_restored(saved, tmp_path):
    """A worker dying right after its commit: storage holds a newer checkpoint than Ray Train reports."""
    run = "fallback-unregistered"
    storage, out = saved_run(saved, tmp_path, run)
    newer = step_dir(storage, run, 4)
    shutil.copytree(step_dir(storage, run, 3), newer)  # committed in storage, never reported to Ray Train
    rewrite_manifest(newer, lambda doc: doc["user_metadata"].update(step=4))

    fit(storage, out, WORKERS, 5, {5}, name=run)

    restored = torch.load(out / f"restored-{WORKERS}.pt", weights_only=False)
    assert restored["step"] == 4 and restored["load"].path.rstrip("/") == newer
    assert not fallback_events(run)
    assert rayckpt.verify(step_dir(storage, run, 5)).ok


def test_no_checkpoint_that_loads_raises_naming_each_one_tried(saved, tmp_path):
    run = "fallback-none"
    storage, out = saved_run(saved, tmp_path, run)
    for step in (3, 2):
        remove_a_shard_file(step_dir(storage, run, step))

    with pytest.raises(WorkerGroupError) as err:
        fit(storage, out, WORKERS, 4, {4}, name=run)
    assert sorted(err.value.worker_failures) == list(range(WORKERS))  # every rank raised it
    for failure in err.value.worker_failures.values():
        assert isinstance(failure, RestoreFailedError), repr(failure)
    msg = str(err.value.worker_failures[0])
    assert f"run '{run}': no committed checkpoint could be restored (2 tried, newest first)" in msg
    for step in (3, 2):
        assert f"step {step} at {step_dir(storage, run, step)}: " in msg
    assert msg.count("is missing from") >= 2
    assert not (out / f"restored-{WORKERS}.pt").exists()  # nothing restored, and no fresh start either
    assert not os.path.exists(step_dir(storage, run, 4))
    assert [(e["step"], e["next_step"]) for e in fallback_events(run)] == [(3, 2)]


def test_a_fallback_is_counted_in_the_metric_and_warned_once(ray_session, monkeypatch, caplog):
    """Rank 0's side of a fallback: one WARNING, ``rayckpt_restore_fallbacks`` + 1, the event."""
    counted: list[tuple[str, float, dict]] = []
    # sent to the MetadataActor, which records it (tests/e2e sees it reach a real Prometheus)
    monkeypatch.setattr(metrics, "send", lambda name, value, **tags: counted.append((name, value, tags)))
    ckpt = object.__new__(Checkpointer)
    ckpt.run, ckpt.rank, ckpt.fallbacks = "fallback-unit", 0, []
    with caplog.at_level(logging.WARNING, logger=checkpointer_module.__name__):
        ckpt._fell_back(("/r/rayckpt-step-00000009", 9, "shard file 'x' is missing"), ("/r/rayckpt-step-00000006", 6))
    assert counted == [("rayckpt_restore_fallbacks", 1.0, {"run": "fallback-unit"})]
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "cannot restore step 9" in record.getMessage()
    assert "restoring step 6 from /r/rayckpt-step-00000006" in record.getMessage()
    assert ckpt.fallbacks == [
        {
            "path": "/r/rayckpt-step-00000009",
            "step": 9,
            "reason": "shard file 'x' is missing",
            "next": "/r/rayckpt-step-00000006",
            "next_step": 6,
        }
    ]
    ray.get(get_metadata_actor().ping.remote())  # the event was sent before this call: it is recorded
    assert [e["step"] for e in fallback_events("fallback-unit")] == [9]

    caplog.clear()
    other = object.__new__(Checkpointer)  # another rank: lists it, but neither warns nor counts
    other.run, other.rank, other.fallbacks = "fallback-unit", 1, []
    with caplog.at_level(logging.WARNING, logger=checkpointer_module.__name__):
        other._fell_back(("/r/a", 9, "why"), ("/r/b", 6))
    assert not caplog.records and len(counted) == 1 and len(other.fallbacks) == 1
