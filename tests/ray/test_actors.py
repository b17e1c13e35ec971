"""The actors on a real local Ray, driven from one process: commit protocol, catalog, plans."""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time

import pytest
import ray
import torch

import rayckpt
from rayckpt.engine import save as save_engine
from rayckpt.engine.writer import parts_here
from rayckpt.format.boxes import Box
from rayckpt.planning import load_plan as planner
from rayckpt.ray.metadata.actor import get_metadata_actor
from rayckpt.ray.metadata.plan_cache import ReadAsk
from rayckpt.ray.rank import async_save, save_handle, staging
from rayckpt.ray.rank.copier import CopyJob
from rayckpt.ray.rank.loading import load as ray_load
from rayckpt.ray.records import SaveTarget
from rayckpt.ray.writer.actor import ShardWrite, get_shard_writer
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import SaveSpec
from rayckpt.storage.lease import LEASE_PREFIX
from tests.helpers import plan_asks

pytestmark = pytest.mark.slow


def state(seed: int, rows: int = 1000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, 256, generator=g), "b": torch.randn(7, generator=g), "step": seed}


def target(rows: int = 1000) -> dict:
    return {"w": torch.zeros(rows, 256), "b": torch.zeros(7), "step": -1}


def committed_order(run: str) -> list[str]:
    return [e["save_id"] for e in ray.get(get_metadata_actor().events.remote(run)) if e["kind"] == "committed"]


def test_async_save_commits_and_loads_with_an_actor_plan(ray_session, tmp_path):
    path = str(tmp_path / "a")
    handle = async_save.save_async(state(1), path, run="basic", step=1)
    assert handle.stall_seconds > 0 and handle.commit_seconds is None
    entry = handle.wait()
    assert entry.status == "committed" and entry.step == 1 and entry.path == path
    assert handle.commit_seconds is not None and handle.commit_seconds > 0  # the MetadataActor's own measure
    assert os.path.exists(os.path.join(path, "manifest.json"))
    out = target()
    info = ray_load(out, path, run="basic")
    assert torch.equal(out["w"], state(1)["w"]) and out["step"] == 1
    assert info.bytes_read == info.bytes_needed
    before = ray.get(get_metadata_actor().cached_plans.remote())
    ray_load(target(), path, run="basic")
    assert ray.get(get_metadata_actor().cached_plans.remote()) == before  # served from the cache


def test_dim0_loads_are_planned_once_for_every_rank_and_match_the_per_rank_planner(ray_session, tmp_path):
    path = str(tmp_path / "bulk")
    async_save.save_async(state(3), path, run="bulk", step=1).wait()
    meta = get_metadata_actor()
    m = rayckpt.read_manifest(CheckpointDir.resolve(path))
    shapes = {"w": (1000, 256), "b": (7,)}

    def requests(rank: int, world: int, boxes=planner.dim0_box) -> tuple:
        return tuple(planner.TensorRequest(k, "float32", s, boxes(s, world, rank)) for k, s in shapes.items())

    before = ray.get(meta.cached_plans.remote())
    for rank in range(3):
        bundle = ray.get(
            meta.read_plan.remote(
                path, None, ReadAsk(requests=requests(rank, 3), value_keys=("step",), rank=rank, world_size=3), "bulk"
            )
        )
        assert bundle.plan == planner.create_load_plan(m, requests(rank, 3), ("step",))
        assert bundle.values == {"step": 3}
    assert ray.get(meta.cached_plans.remote()) == before + 1  # one all-ranks plan served all three

    # Not FSDP2's layout (rank 0 asks for rows 1..10): planned for that rank alone.
    odd = tuple(
        planner.TensorRequest(k, "float32", s, Box((1,) + (0,) * (len(s) - 1), (9,) + s[1:])) for k, s in shapes.items()
    )
    bundle = ray.get(meta.read_plan.remote(path, None, ReadAsk(requests=odd, rank=0, world_size=3), "bulk"))
    assert bundle.plan == planner.create_load_plan(m, odd)
    assert ray.get(meta.cached_plans.remote()) == before + 2


def test_twelve_checkpoints_planned_at_once_through_the_actor(ray_session, tmp_path):
    """More checkpoints than the actor caches, every rank of each asking at once: each gets its plan."""
    asks = [a for p in plan_asks.save_small_checkpoints(str(tmp_path), 12) for a in plan_asks.asks_for(p)]
    meta = get_metadata_actor()
    work = [i for i in range(len(asks)) for _ in range(4)]
    random.Random(0).shuffle(work)  # checkpoints interleaved: each plan races the others' evictions
    refs = [meta.read_plan.remote(a.location, None, a.read_ask(), "many") for a in (asks[i] for i in work)]
    bundles = ray.get(refs)
    expected = [plan_asks.expected_plan(a) for a in asks]
    for i, bundle in zip(work, bundles):
        assert bundle.plan == expected[i], asks[i]
        assert bundle.values == {"step": int(asks[i].location[-2:])}


def test_writer_is_the_one_on_this_node(ray_session, tmp_path):
    node = ray.get_runtime_context().get_node_id()
    writer = get_shard_writer()
    assert ray.get(writer.node.remote()) == node
    handle = async_save.save_async(state(2), str(tmp_path / "n"), run="nodes", step=2)
    handle.wait()
    committed = [e for e in ray.get(get_metadata_actor().events.remote("nodes")) if e["kind"] == "committed"]
    assert committed[-1]["writer_nodes"] == {0: node}


def test_second_save_waits_for_the_first_and_both_commit_in_order(ray_session, tmp_path):
    h1 = async_save.save_async(state(3, rows=20000), str(tmp_path / "s1"), run="bp", step=1)
    h2 = async_save.save_async(state(4, rows=20000), str(tmp_path / "s2"), run="bp", step=2)
    # backpressure: save_async(2) returned only after save 1 committed
    assert committed_order("bp") == [h1.save_id]
    h2.wait()
    assert committed_order("bp") == [h1.save_id, h2.save_id]


def test_a_save_in_another_lane_does_not_wait_for_the_one_in_flight(ray_session, tmp_path):
    h1 = async_save.save_async(state(5, rows=20000), str(tmp_path / "l1"), run="lanes", step=1)
    h2 = async_save.save_async(state(6, rows=20000), str(tmp_path / "l2"), run="lanes-mem", step=2, lane="memory")
    assert async_save.saver().inflight is h1  # the second save did not wait for (and clear) the first
    assert async_save.saver("memory").inflight is h2
    first, second = async_save.saver().buffer, async_save.saver("memory").buffer
    assert first.inode != second.inode  # each lane staged into its own buffer
    assert h1.wait().status == "committed" and h2.wait().status == "committed"
    for path, seed in (("l1", 5), ("l2", 6)):
        out = target(rows=20000)
        ray_load(out, str(tmp_path / path), run="lanes")
        assert torch.equal(out["w"], state(seed, rows=20000)["w"]) and out["step"] == seed
    async_save.release_staging("memory")
    assert async_save.saver("memory").buffer is None and async_save.saver().buffer is first


def test_failed_save_is_never_silent(ray_session, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    # A location nothing can be written to fails at once: rank 0 cannot claim it (write its lease).
    with pytest.raises(rayckpt.SaveFailedError, match=r"file/ckpt: cannot write the save's lease"):
        async_save.save_async(state(5), str(blocker / "ckpt"), run="bad", step=1)
    # A shard file the ShardWriter cannot write (a link into nowhere) fails the save at wait().
    ids = ["20260101T000000-0badf001", "20260101T000000-0badf002"]
    real_id = save_engine.new_save_id
    monkeypatch.setattr(save_engine, "new_save_id", lambda: ids.pop(0) if ids else real_id())
    for n, save_id in ((1, ids[0]), (2, ids[1])):
        (tmp_path / f"ckpt{n}").mkdir()
        os.symlink(tmp_path / "nowhere" / "x", tmp_path / f"ckpt{n}" / f"{save_id}-r00000-float.arrow")
    handle = async_save.save_async(state(5), str(tmp_path / "ckpt1"), run="bad", step=1)
    with pytest.raises(rayckpt.SaveFailedError, match=r"(?s)step 1.*ShardWriter on node"):
        handle.wait()
    # not waiting does not hide it either: the next save raises it
    async_save.save_async(state(5), str(tmp_path / "ckpt2"), run="bad", step=2)
    with pytest.raises(rayckpt.SaveFailedError, match="step 2"):
        async_save.save_async(state(6), str(tmp_path / "fine"), run="bad", step=3)
    async_save.wait_inflight()


def test_rank_that_never_reports_fails_the_save_after_its_timeout(ray_session, tmp_path):
    meta = get_metadata_actor()
    path = str(tmp_path / "t")
    os.makedirs(path)
    spec = SaveSpec(save_id="sid-timeout", world_size=2, block_size=64, tensors={}, values={})
    ray.get(meta.begin_save.remote(spec, SaveTarget(save_id=spec.save_id, run="timeouts", step=9, location=path), 1.0))
    answer = ray.get(meta.wait_commit.remote(SaveTarget(save_id="sid-timeout"), 30))
    entry = answer.entry
    assert entry.status == "failed" and answer.seconds is not None
    assert "rank(s) [0, 1] did not report within 1s" in entry.error
    assert not os.path.exists(os.path.join(path, "manifest.json"))


def test_killed_metadata_actor_rebuilds_its_catalog_from_storage(ray_session, tmp_path):
    root = tmp_path / "run"
    for step in (1, 2):
        async_save.save_async(state(step), str(root / f"rayckpt-step-{step:08d}"), run="phoenix", step=step).wait()
    (root / "rayckpt-step-00000003").mkdir()
    (root / "rayckpt-step-00000003" / "partial-r00000-float.arrow").write_bytes(b"x")
    ray.kill(get_metadata_actor(), no_restart=True)
    deadline = time.monotonic() + 30
    while True:  # the lookup may still name the killed actor for a moment: then a new one is asked
        try:
            entries = ray.get(get_metadata_actor().register_run.remote("phoenix", str(root)))
            break
        except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError):
            assert time.monotonic() < deadline, "no new MetadataActor within 30 s of the kill"
            time.sleep(0.2)
    assert [(e.step, e.status) for e in entries] == [(1, "committed"), (2, "committed"), (3, "incomplete")]
    assert ray.get(get_metadata_actor().latest.remote("phoenix")).step == 2
    out = target()
    ray_load(out, str(root / "rayckpt-step-00000002"), run="phoenix")
    assert torch.equal(out["w"], state(2)["w"])


def test_rank_with_nothing_to_write_still_commits(ray_session, tmp_path):
    """Only plain values: this rank's plan is empty, its writer reports 0 bytes."""
    path = str(tmp_path / "values")
    entry = async_save.save_async({"step": 7, "note": "only values"}, path, run="empty", step=7).wait()
    assert entry.status == "committed"
    out = {"step": 0, "note": ""}
    info = ray_load(out, path, run="empty")
    assert out == {"step": 7, "note": "only values"} and info.bytes_read == 0


def my_staging_files() -> list[str]:
    return [n for n in os.listdir(staging.SHM_DIR) if n.startswith(f"{staging.PREFIX}{os.getpid()}-")]


def held_here(name: str) -> bool:
    """Whether this process still has a descriptor of the (unlinked) staging file ``name``."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == f"{name} (deleted)":
                return True
        except OSError:
            pass
    return False


def test_saves_stage_into_one_reused_shared_memory_buffer(ray_session, tmp_path):
    dead = multiprocessing.get_context("spawn").Process(target=int)
    dead.start()
    dead.join()
    stale = os.path.join(staging.SHM_DIR, f"{staging.PREFIX}{dead.pid}-0123456789ab")
    open(stale, "wb").close()  # left behind by a rank that died
    async_save.release_staging()
    handles = [async_save.save_async(state(s), str(tmp_path / f"s{s}"), run="shm", step=s) for s in (1, 2, 3)]
    assert [h.staging for h in handles] == ["shm", "shm", "shm"]  # the first save made the buffer
    handles[-1].wait()
    assert ray.get(handles[-1]._copy.write_ref)["seconds"] > 0
    stats = ray.get(get_shard_writer().debug_stats.remote())  # the writer's own record of what it wrote
    writes = [w for w in stats["writes"] if w["run"] == "shm"]
    assert [(w["step"], w["rank"], w["staging"], w["staged_dir"]) for w in writes] == [
        (s, 0, "shm", staging.SHM_DIR) for s in (1, 2, 3)
    ]
    assert stats["staging_dir"] == staging.SHM_DIR and {w["node"] for w in writes} == {stats["node"]}
    # the rank let its writer write a type as several files at once, one per core it has to itself
    assert {w["max_parts"] for w in writes} == {parts_here(1, 1)}
    assert not os.path.exists(stale)  # the node's writer removed it
    assert my_staging_files() == [] and os.path.exists(async_save.saver().buffer.path)  # one nameless file, reused
    for s in (1, 2, 3):
        out = target()
        ray_load(out, str(tmp_path / f"s{s}"), run="shm")
        assert torch.equal(out["w"], state(s)["w"]) and torch.equal(out["b"], state(s)["b"])
    async_save.release_staging()
    assert my_staging_files() == [] and async_save.saver().buffer is None


def test_a_buffer_a_writer_may_still_read_is_not_reused(ray_session, tmp_path):
    async_save.prepare_staging(state(1), wait=True)
    async_save.save_async(state(1), str(tmp_path / "a"), run="busy", step=1).wait()
    first = async_save.saver().buffer.name

    @ray.remote(num_cpus=0)
    def never_done() -> None:
        import time

        time.sleep(600)

    async_save.saver().buffer.busy = busy = never_done.remote()  # as if its writer were still reading
    async_save.save_async(state(2), str(tmp_path / "b"), run="busy", step=2).wait()
    ray.cancel(busy, force=True)
    assert async_save.saver().buffer.name != first and not held_here(first)
    out = target()
    ray_load(out, str(tmp_path / "b"), run="busy")
    assert torch.equal(out["w"], state(2)["w"])


def test_object_store_staging_and_the_fallback_when_shm_has_no_room(ray_session, tmp_path, monkeypatch):
    h = async_save.save_async(state(3), str(tmp_path / "os"), run="stg", step=1, staging="object_store")
    assert h.staging == "object_store" and h.wait().status == "committed"
    (w,) = [w for w in ray.get(get_shard_writer().debug_stats.remote())["writes"] if w["save_id"] == h.save_id]
    assert (w["staging"], w["staged_dir"]) == ("object_store", None)
    async_save.release_staging()
    monkeypatch.setattr(async_save.saver(), "buffer", staging.StagingBuffer(str(tmp_path / "no-shm")))
    h = async_save.save_async(state(4), str(tmp_path / "auto"), run="stg", step=2)
    assert h.staging == "object_store" and h.wait().status == "committed"
    for name, s in (("os", 3), ("auto", 4)):
        out = target()
        ray_load(out, str(tmp_path / name), run="stg")
        assert torch.equal(out["w"], state(s)["w"])
    with pytest.raises(rayckpt.SaveFailedError, match=r"staging failed on rank 0: cannot create a staging file in"):
        async_save.save_async(state(5), str(tmp_path / "shm"), run="stg", step=3, staging="shm")
    assert not os.path.exists(tmp_path / "shm" / "manifest.json")
    # It failed before its registration went out: the registration is sent with the failure, so the actor
    # settles the save and removes its lease (else the location stays claimed for the lease's minute).
    deadline = time.monotonic() + 30
    while os.path.isdir(tmp_path / "shm") and any(n.startswith(LEASE_PREFIX) for n in os.listdir(tmp_path / "shm")):
        assert time.monotonic() < deadline, os.listdir(tmp_path / "shm")
        time.sleep(0.05)
    h = async_save.save_async(state(5), str(tmp_path / "shm"), run="stg", step=3, staging="object_store")
    assert h.wait().status == "committed"
    monkeypatch.setenv(staging.STAGING_ENV, "disk")
    with pytest.raises(ValueError, match=r"staging='disk': expected one of auto, shm, object_store"):
        async_save.save_async(state(6), str(tmp_path / "bad"), run="stg", step=4)


def test_writer_refuses_a_region_staged_on_another_node(ray_session, tmp_path):
    region = staging.StagedRegion("/dev/shm/x", "f" * 56, ((0, 4),))
    writer = get_shard_writer()
    with pytest.raises(ray.exceptions.RayTaskError, match=r"staging file /dev/shm/x is on node ffffffffffff"):
        ray.get(
            writer.write.remote(
                ShardWrite(
                    target=SaveTarget(save_id="sid-node", location=str(tmp_path / "n"), rank=0),
                    block_size=64,
                    chunks=(),
                ),
                region,
            )
        )


def test_wait_survives_the_metadata_actor_dying_and_asks_storage(ray_session, tmp_path, monkeypatch):
    path = str(tmp_path / "orphan")
    handle = async_save.save_async(state(8), path, run="orphan", step=8)
    dying = get_metadata_actor()
    assert ray.get(dying.wait_commit.remote(SaveTarget(save_id=handle.save_id), 60)).entry.status == "committed"
    ray.kill(dying, no_restart=True)
    # the race the Ray Train test hit: this rank looked the actor up just before it was killed
    monkeypatch.setattr(save_handle, "get_metadata_actor", lambda: dying)
    entry = handle.wait()
    assert entry.status == "committed" and entry.save_id == handle.save_id and entry.step == 8
    assert handle.commit_seconds is None  # storage answered: no actor timed it
    # a save storage does not hold (another save's manifest is there) failed
    other = async_save.SaveHandle(
        SaveTarget(save_id="sid-never", run="orphan", step=9, location=path, rank=0),
        CheckpointDir.resolve(path),
        save_handle.StartedSave(copy=CopyJob.finished(ray.put(None), 0.0), staged_ref=None, stall_seconds=0.0),
        timeout=30.0,
    )
    with pytest.raises(rayckpt.SaveFailedError, match=r"sid-never.*the MetadataActor died before this save was"):
        other.wait()


def test_a_registration_that_failed_fails_the_save(ray_session, tmp_path):
    @ray.remote(num_cpus=0)
    def begin_save_raising() -> None:
        raise RuntimeError("cannot decode the filesystem")

    handle = async_save.SaveHandle(
        SaveTarget(save_id="sid-unregistered", run="unregistered", step=1, location=str(tmp_path / "u"), rank=0),
        CheckpointDir.resolve(str(tmp_path / "u")),
        save_handle.StartedSave(
            copy=CopyJob.finished(ray.put(None), 0.0),
            staged_ref=None,
            stall_seconds=0.0,
            registered=begin_save_raising.remote(),
        ),
        timeout=30.0,
    )
    with pytest.raises(
        rayckpt.SaveFailedError, match=r"(?s)registering with the MetadataActor: .*cannot decode the filesystem"
    ):
        handle.wait()


def test_a_registration_that_cannot_be_sent_fails_the_save_for_every_rank(ray_session, tmp_path):
    import threading

    path = str(tmp_path / "unsent")
    with pytest.raises(rayckpt.SaveFailedError, match=r"registering with the MetadataActor: TypeError: .*lock"):
        async_save.save_async(state(1), path, run="unsent", step=1, metadata={"lock": threading.Lock()})
    failed = [e for e in ray.get(get_metadata_actor().events.remote("unsent")) if e["kind"] == "failed"]
    assert len(failed) == 1 and "rank 0: registering" in failed[0]["error"]
    assert not os.path.exists(os.path.join(path, "manifest.json"))


def test_a_failure_reported_before_the_registration_still_names_and_cleans_the_save(ray_session, tmp_path):
    meta = get_metadata_actor()
    path = tmp_path / "early"
    path.mkdir()
    (path / "sid-early-r00001-float.arrow").write_bytes(b"partial")  # written before rank 1 failed
    early = SaveTarget(save_id="sid-early", run="early", step=5, location=str(path))
    ray.get(meta.report_failed.remote(early.for_rank(1), "staging: OSError"))
    spec = SaveSpec(save_id="sid-early", world_size=2, block_size=64, tensors={}, values={})
    ray.get(meta.begin_save.remote(spec, early, 30.0))
    entry = ray.get(meta.wait_commit.remote(early, 5)).entry
    assert entry.status == "failed" and entry.step == 5 and "rank 1: staging: OSError" in entry.error
    (event,) = [e for e in ray.get(meta.events.remote("early")) if e["kind"] == "failed"]
    assert event["step"] == 5 and event["location"] == str(path)
    assert not path.exists()  # its partial file removed, then the empty directory


def test_rank_zero_takes_the_incarnation_from_its_registration(ray_session, tmp_path, monkeypatch):
    """Rank 0 sends one call to the MetadataActor before its copy (``begin_save``, which answers with the
    incarnation), not a separate ``incarnation()`` as well; the save commits and its wait knows the incarnation."""
    real = async_save.get_metadata_actor
    asked: list[str] = []

    class Recording:
        def __init__(self, handle):
            self._handle = handle

        def __getattr__(self, name):
            asked.append(name)
            return getattr(self._handle, name)

    monkeypatch.setattr(async_save, "get_metadata_actor", lambda *a: Recording(real(*a)))
    handle = async_save.save_async(state(1), str(tmp_path / "c"), run="rank0-incarnation", step=1)
    assert handle.wait().status == "committed"
    assert "begin_save" in asked and "incarnation" not in asked, asked


def test_prepare_staging_makes_the_buffer_the_first_save_uses_in_the_background(ray_session, tmp_path, monkeypatch):
    async_save.release_staging()
    st = state(9)
    need = staging.staged_size([st["w"], st["b"]])
    made = threading.Event()
    create = staging.StagingBuffer._create

    def slow_create(self, size):
        made.wait(30)  # held until the test lets it go: prepare_staging must not wait for it
        return create(self, size)

    monkeypatch.setattr(staging.StagingBuffer, "_create", slow_create)
    size = async_save.prepare_staging(st)
    buffer = async_save.saver().buffer
    assert size >= need and buffer.preparing and buffer.path is None  # returned before the buffer exists
    made.set()
    h = async_save.save_async(st, str(tmp_path / "p"), run="prep", step=1)  # waits for the rest of it
    assert h.staging == "shm" and h.wait().status == "committed"
    assert my_staging_files() == [] and buffer.capacity == size and os.path.exists(buffer.path)
    out = target()
    ray_load(out, str(tmp_path / "p"), run="prep")
    assert torch.equal(out["w"], st["w"])
    # wait=True: made when it returns
    async_save.release_staging()
    assert async_save.prepare_staging(st, wait=True) == size and os.path.exists(async_save.saver().buffer.path)
    async_save.release_staging()
    assert async_save.prepare_staging(st, staging="object_store") == 0 and my_staging_files() == []
    monkeypatch.setattr(async_save.saver(), "buffer", staging.StagingBuffer(str(tmp_path / "no-shm")))
    assert async_save.prepare_staging(st) == 0
    with pytest.raises(staging.StagingUnavailable, match="cannot create a staging file in .*no-shm"):
        async_save.prepare_staging(st, staging="shm")


def test_prepare_staging_starts_the_nodes_shard_writer_and_finds_the_metadata_actor(ray_session, monkeypatch):
    started = []
    monkeypatch.setattr(async_save, "get_shard_writer", lambda: started.append("writer"))
    monkeypatch.setattr(async_save, "get_metadata_actor", lambda: started.append("metadata"))
    async_save.prepare_staging(state(1), staging="object_store")
    assert started == []  # nothing to stage into, nothing started
    async_save.prepare_staging(state(1))
    assert started == ["writer", "metadata"]
    async_save.release_staging()
