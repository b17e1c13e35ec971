"""The MetadataActor restarted by Ray mid-save (a real kill, Ray restarts it): the save fails at once,
its files go, the next save commits, and the checkpoint committed before is untouched."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import ray
import torch

import rayckpt
from rayckpt.engine.writer import ShareSpec, write_chunks
from rayckpt.format.boxes import Box
from rayckpt.format.shard_file import ChunkData
from rayckpt.ray.metadata.actor import get_metadata_actor
from rayckpt.ray.rank import async_save
from rayckpt.ray.rank.copier import CopyJob
from rayckpt.ray.rank.save_handle import SaveHandle, StartedSave
from rayckpt.ray.records import SaveTarget
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import SaveSpec, WrittenFiles
from tests.helpers.gated_fs import gated_filesystem, wait_for_file

pytestmark = pytest.mark.slow

#: A bound, not a timing: the commit timeout these saves keep is the default 600 s.
FAILS_WITHIN_S = 60.0


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 64, generator=g), "b": torch.randn(5, generator=g), "step": seed}


def assert_loads_bit_exact(path: str, seed: int) -> None:
    out = {"w": torch.zeros(300, 64), "b": torch.zeros(5), "step": -1}
    rayckpt.load(out, path)
    expected = state(seed)
    assert torch.equal(out["w"], expected["w"]) and torch.equal(out["b"], expected["b"]) and out["step"] == seed


class ErrorCatcher(threading.Thread):
    """Runs ``fn`` in a thread and keeps what it raised."""

    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn, self.errors = fn, []
        self.start()

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self.errors.append(exc)


def restart_metadata_actor() -> tuple[str, str]:
    """Kill the MetadataActor as a crash would (Ray restarts it); its incarnation ids before and after."""
    meta = get_metadata_actor()
    before = ray.get(meta.incarnation.remote())
    ray.kill(meta, no_restart=False)
    deadline = time.monotonic() + FAILS_WITHIN_S
    after = before
    while after == before:  # the kill is asynchronous: the old process may still answer, or a request fail
        assert time.monotonic() < deadline, "the MetadataActor did not come back"
        try:
            after = ray.get(get_metadata_actor().incarnation.remote())
        except ray.exceptions.ActorUnavailableError:
            pass
        time.sleep(0.05)
    return before, after


def test_a_save_whose_actor_restarted_fails_at_once_and_the_next_save_commits(ray_session, tmp_path):
    run, root = "restarted", tmp_path / "restarted"
    good, lost, after = (str(root / f"rayckpt-step-{s:08d}") for s in (1, 2, 3))
    async_save.save_async(state(1), good, run=run, step=1).wait()

    gate = str(tmp_path / "gate")
    start = time.monotonic()
    handle = async_save.save_async(state(2), lost, run=run, step=2, filesystem=gated_filesystem(gate))
    wait_for_file(f"{gate}.reached", "the ShardWriter reaching the gate")  # staged and handed over; writer paused
    registered_with = ray.get(handle._registered)
    before, now = restart_metadata_actor()
    assert registered_with == before
    # As in Ray Train: the save's own wait() runs in another thread while training goes on to the next save.
    owner = ErrorCatcher(handle.wait)
    while handle._watchers == 0:
        assert owner.is_alive()
        time.sleep(0.01)
    open(gate, "w").close()  # the writer finishes and reports to the new incarnation
    next_save = async_save.save_async(state(3), after, run=run, step=3)  # waits for save 2: its error is not ours
    owner.join(FAILS_WITHIN_S)
    assert not owner.is_alive() and time.monotonic() - start < FAILS_WITHIN_S
    (failed,) = owner.errors
    assert isinstance(failed, rayckpt.SaveFailedError)
    message = str(failed)
    assert f"(save {handle.save_id}) failed; nothing was committed" in message
    assert f"the MetadataActor restarted while this save was in flight (it began under incarnation {before}" in message
    assert not os.path.exists(lost)  # its shard file and then its directory removed at once
    with pytest.raises(rayckpt.SaveFailedError, match=handle.save_id):
        handle.wait()  # its own wait() keeps saying so

    entry = next_save.wait()
    assert entry.status == "committed" and entry.save_id != handle.save_id
    assert_loads_bit_exact(good, 1)
    assert_loads_bit_exact(after, 3)
    catalog = ray.get(get_metadata_actor().register_run.remote(run, str(root)))
    assert [(e.step, e.status) for e in catalog] == [(1, "committed"), (2, "failed"), (3, "committed")]
    (event,) = [e for e in ray.get(get_metadata_actor().events.remote(run)) if e["kind"] == "failed"]
    assert event["save_id"] == handle.save_id and now in event["error"]


def test_a_rank_waiting_when_the_actor_restarts_is_answered_at_once(ray_session, tmp_path):
    """Rank 1 of 2 never reports; rank 0 waits in ``wait_commit`` when the actor is killed under it."""
    meta = get_metadata_actor()
    path, save_id = str(tmp_path / "waiting"), "sid-waiting"
    spec = SaveSpec(save_id=save_id, world_size=2, block_size=64, tensors={"w": ("float32", (4, 4))}, values={})
    target = SaveTarget(save_id=save_id, run="waiting", step=7, location=path, rank=0)
    registered = meta.begin_save.remote(spec, target.for_rank(None))
    incarnation = ray.get(registered)
    rows = np.arange(8, dtype=np.float32)
    chunk = ChunkData("w", "float32", Box((0, 0), (2, 4)), rows.view(np.uint8))
    shard = write_chunks(WrittenFiles(CheckpointDir.resolve(path), save_id), [chunk], ShareSpec(rank=0, block_size=64))
    ray.get(meta.report_written.remote(replace(target, incarnation=incarnation), shard, 0.0))
    handle = SaveHandle(
        target,
        CheckpointDir.resolve(path),
        StartedSave(
            copy=CopyJob.finished(ray.put(None), 0.0), staged_ref=None, stall_seconds=0.0, registered=registered
        ),
        timeout=600.0,
    )
    start = time.monotonic()
    waiter = ErrorCatcher(handle.wait)
    while ray.get(meta.debug_stats.remote())["waited_saves"] == 0:  # rank 0 now waits inside the actor
        assert waiter.is_alive() and time.monotonic() - start < FAILS_WITHIN_S
        time.sleep(0.05)
    restart_metadata_actor()
    waiter.join(FAILS_WITHIN_S)
    assert not waiter.is_alive() and time.monotonic() - start < FAILS_WITHIN_S
    (error,) = waiter.errors
    assert isinstance(error, rayckpt.SaveFailedError) and "the MetadataActor restarted" in str(error)
    assert not os.path.exists(path)  # rank 0's file removed by the new incarnation


def test_a_save_committed_just_before_the_restart_stays_committed(ray_session, tmp_path):
    """The actor committed and died before the rank heard: the new incarnation finds it in storage."""
    path = str(tmp_path / "committed")
    handle = async_save.save_async(state(4), path, run="committed", step=4)
    assert ray.get(get_metadata_actor().wait_commit.remote(handle.target, 60)).entry.status == "committed"
    restart_metadata_actor()
    entry = handle.wait()
    assert entry.status == "committed" and entry.save_id == handle.save_id
    assert_loads_bit_exact(path, 4)


def test_a_save_the_actor_lost_fails_at_its_commit_timeout_and_only_for_its_own_wait(ray_session, tmp_path):
    """Nothing will settle this save (the actor never heard of it): a shorter wait() times out and
    leaves it in flight; at the commit timeout it fails, once, and the next save does not hear of it."""
    saver = async_save.saver()
    path = tmp_path / "unheard"
    path.mkdir()
    (path / "sid-unheard-r00000-float.arrow").write_bytes(b"written, then the report was lost")
    handle = SaveHandle(
        SaveTarget(save_id="sid-unheard", run="unheard", step=3, location=str(path), rank=0),
        CheckpointDir.resolve(str(path)),
        StartedSave(copy=CopyJob.finished(ray.put(None), 0.0), staged_ref=None, stall_seconds=0.0),
        timeout=2.0,
        on_outcome=saver._seen,
    )
    saver.inflight = handle
    with pytest.raises(TimeoutError, match="sid-unheard"):
        handle.wait(timeout=0.1)
    assert saver.inflight is handle  # still in flight: the next save would wait for it
    with pytest.raises(rayckpt.SaveFailedError, match=r"sid-unheard.*not committed within 2s: rank 0 stopped waiting"):
        handle.wait()
    assert saver.inflight is None and async_save.wait_inflight() is None
    assert not path.exists()  # the actor failed it and removed its files
