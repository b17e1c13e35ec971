"""TorchTrainer on a real local Ray: async saves through the actors, N -> M resume."""

from __future__ import annotations

import glob
import os
import re
import time

import pytest
import ray
import torch

import rayckpt
from rayckpt.data import DataPosition
from rayckpt.ray.metadata.actor import get_metadata_actor
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.testing.toy import ToyModel
from rayckpt.tools.listing import ls
from tests.helpers import ray_workers
from tests.helpers.ray_train import fit
from tests.helpers.ray_workers import DATA_LEN
from tests.helpers.sample_log import check_exactly_once, read_steps

pytestmark = pytest.mark.slow


def driver_output(capfd, patterns: list[str], timeout: float = 60.0) -> str:
    """This process's output (Ray forwards the workers' to it, asynchronously) once it
    matches every regex of ``patterns``, or after ``timeout`` seconds."""
    seen = ""
    deadline = time.monotonic() + timeout
    while True:
        out, err = capfd.readouterr()
        seen += out + err
        if all(re.search(p, seen) for p in patterns) or time.monotonic() > deadline:
            return seen
        time.sleep(0.1)


def metadata_actor_log() -> str:
    """The MetadataActor's stderr file (``<session>/logs/worker-*-<pid>.err``)."""
    pid = ray.get(get_metadata_actor().debug_stats.remote())["pid"]
    logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    paths = glob.glob(os.path.join(logs, f"worker-*-{pid}.err"))
    assert paths, f"no log file of the MetadataActor (pid {pid}) in {logs}"
    return "".join(open(p, encoding="utf-8", errors="replace").read() for p in paths)


def test_save_with_4_restore_with_3(ray_session, tmp_path, capfd):
    storage, out = tmp_path / "storage", tmp_path / "out"
    out.mkdir()
    result = fit(storage, out, 4, 3, {2, 3})
    assert result.checkpoint is not None
    # rank 0's line per committed save reaches the driver; the MetadataActor's log has its own
    lines = [rf"rayckpt: toy committed step {step} \(\d+\.\d MiB, \d+\.\d\d s\)" for step in (2, 3)]
    seen = driver_output(capfd, lines)
    assert all(re.search(p, seen) for p in lines), seen[-4000:]
    assert "failed to save" not in seen
    log = metadata_actor_log()
    for step in (2, 3):
        assert re.search(
            rf"INFO rayckpt.metadata_actor: committed step {step} of run 'toy': \S+ \(\d+ bytes from 4 ranks", log
        )
    assert os.path.basename(result.checkpoint.path) == "rayckpt-step-00000003"
    assert os.path.exists(os.path.join(result.checkpoint.path, "manifest.json"))
    final4 = torch.load(out / "final-4.pt", weights_only=False)

    # the MetadataActor dies between runs: its catalog comes back from storage
    ray.kill(get_metadata_actor(), no_restart=True)
    result = fit(storage, out, 3, 4, {4}, kill_actor_at=4)
    restored3 = torch.load(out / "restored-3.pt", weights_only=False)
    assert restored3["step"] == 3
    for key, value in final4["state"].items():
        assert torch.equal(restored3["state"][key], value), key
    assert restored3["load"].bytes_read > 0
    assert restored3["staging_bytes"] >= restored3["load"].bytes_needed  # restore made the staging buffer
    assert os.path.basename(result.checkpoint.path) == "rayckpt-step-00000004"
    final3 = torch.load(out / "final-3.pt", weights_only=False)
    assert final3["step"] == 4
    assert not torch.equal(final3["state"]["app.model.head.weight"], final4["state"]["app.model.head.weight"])

    # retention (num_to_keep=2) removed the oldest checkpoint directory; the catalog agrees
    run_dir = storage / "toy"
    kept = sorted(p for p in os.listdir(run_dir) if p.startswith("rayckpt-step-"))
    assert kept == ["rayckpt-step-00000003", "rayckpt-step-00000004"]
    assert [e.step for e in ls(str(storage), run="toy") if e.status == "committed"] == [3, 4]
    # events live in the actor's memory: the one killed after step 4's commit took 2-4's along. The
    # controller sends its "reported" event without waiting: it may land just after fit() returns.
    deadline = time.monotonic() + 30
    while True:
        reported = [e["step"] for e in ray.get(get_metadata_actor().events.remote("toy")) if e["kind"] == "reported"]
        if reported or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert reported == [4]
    # a committed checkpoint is a plain rayckpt checkpoint too
    m = rayckpt.read_manifest(CheckpointDir.resolve(str(run_dir / "rayckpt-step-00000004")))
    assert m.world_size == 3 and m.user_metadata["step"] == 4
    # the data: 3 workers went on from the 4 workers' position, into the next epoch, every sample once
    steps = read_steps(out)
    assert [steps[n].world_size for n in (1, 3, 4)] == [4, 4, 3]
    check_exactly_once(steps, DATA_LEN, DataPosition.from_json(m.data_position, "step 4"))
    assert [steps[n].epoch for n in (1, 2, 3, 4)] == [0, 0, 1, 1]
    # the MetadataActor's commit records each key's path (a module's dotted keys stay one part)
    weights = [k for k in m.entries if k.endswith("weight") and ".model." in k]
    assert weights and all(m.path(k)[-1].endswith("weight") and "." in m.path(k)[-1] for k in weights)


def test_a_restore_of_a_run_reading_ray_data_warns_once_that_its_position_is_not_restored(ray_session, tmp_path, capfd):
    storage, out = tmp_path / "storage", tmp_path / "out"
    out.mkdir()
    data = {"train": ray.data.range(8)}
    fit(storage, out, 1, 1, set(), name="raydata", loop=ray_workers.ray_data_loop, datasets=data)
    fit(storage, out, 1, 1, set(), name="raydata", loop=ray_workers.ray_data_loop, datasets=data)
    line = r"rayckpt: run raydata restored step 1, and it reads Ray Data dataset\(s\) \['train'\]: Ray Data keeps no"
    seen = driver_output(capfd, [line, r"rayckpt: raydata committed step 2"])
    assert len(re.findall(line, seen)) == 1, seen[-3000:]
    assert "each worker's shard starts its dataset over" in seen and "rayckpt.data.ResumableSampler" in seen


def test_worker_failing_mid_save_commits_nothing(ray_session, tmp_path):
    """Rank 1's save of step 3 fails while rank 0 writes, in two attempts: the first's rank 1 is killed, Ray
    Train restarts the group from step 2; the second's raises a full disk's error, which the run ends with."""
    storage, out = tmp_path / "storage", tmp_path / "out"
    out.mkdir()
    name = "fail"
    with pytest.raises(Exception) as err:
        fit(storage, out, 2, 3, {2, 3}, name=name, fail_step=3, fail_modes=["kill", "raise"], max_failures=1)
    assert "No space left on device (injected)" in str(err.value)
    assert torch.load(out / "restored-2.pt", weights_only=False)["step"] == 2  # the restart, from step 2
    run_dir = storage / name
    failed_dir = run_dir / "rayckpt-step-00000003"
    # nothing of either failed save is left: no manifest, no shard files
    assert not failed_dir.exists() or not [f for f in os.listdir(failed_dir) if f != ".lock"]
    # the previous checkpoint is intact and loads
    model = ToyModel()
    rayckpt.load({"app": {"model": model.state_dict()}}, str(run_dir / "rayckpt-step-00000002"))
    failed = [e for e in ray.get(get_metadata_actor().events.remote(name)) if e["kind"] == "failed"]
    assert [e["step"] for e in failed] == [3, 3]
    assert "worker group failed" in failed[0]["error"]
    assert "No space left on device (injected)" in failed[1]["error"]
    # each rollback is a WARNING in the MetadataActor's log
    rolled_back = (
        rf"WARNING rayckpt.metadata_actor: save \S+ of run '{name}' \(step 3\) to \S+ failed and was rolled back"
    )
    assert len(re.findall(rolled_back, metadata_actor_log())) == 2


def test_retention_keeps_what_later_incremental_checkpoints_share(ray_session, tmp_path):
    """The blocks frozen, the head trained, a save every step: each storage save after the first shares the
    blocks' chunks with an earlier save's files. Ray Train's retention (num_to_keep=2) deletes the first
    checkpoint directories; the kept checkpoints name files those deleted saves wrote, verify, and restore
    bit-exact into another worker count."""
    storage, out = tmp_path / "storage", tmp_path / "out"
    out.mkdir()
    fit(storage, out, 2, 4, {1, 2, 3, 4}, name="inc", freeze_blocks=True, dump_saves=True)
    run_dir = storage / "inc"
    kept = sorted(p for p in os.listdir(run_dir) if p.startswith("rayckpt-step-"))
    assert kept == ["rayckpt-step-00000003", "rayckpt-step-00000004"]
    manifests = [rayckpt.read_manifest(CheckpointDir.resolve(str(run_dir / name))) for name in kept]
    kept_ids = {m.save_id for m in manifests}
    for name, m in zip(kept, manifests):
        assert m.version == 5 and rayckpt.verify(str(run_dir / name)).ok
        writers = {os.path.basename(f.path).split("-r0")[0] for f in m.files}
        assert writers - kept_ids, (name, writers)  # bytes of a save whose directory retention deleted
        assert rayckpt.inspect(str(run_dir / name)).bytes_shared > 0
    named = {os.path.basename(f.path) for m in manifests for f in m.files}
    assert named <= set(os.listdir(run_dir / ".rayckpt-shared"))
    # Retention deleted the last directory after the last commit's collection: gc collects its files.
    rayckpt.tools.gc(str(run_dir))
    assert set(os.listdir(run_dir / ".rayckpt-shared")) == named

    fit(storage, out, 3, 4, set(), name="inc", freeze_blocks=True)
    restored = torch.load(out / "restored-3.pt", weights_only=False)
    saved = torch.load(out / "state-4.pt", weights_only=False)
    assert restored["step"] == 4
    for key, value in saved["state"].items():
        assert torch.equal(restored["state"][key], value), key
