"""Recovery under Ray Train, as a user gets it: real TorchTrainer runs on a real ``ray.cluster_utils.Cluster``
lose a worker (between saves, while staging, while its save is in flight), a node's ShardWriter mid-save,
or a whole node (elastic worker counts), and Ray Train restarts them.

One subprocess (``tests.helpers.recovery_job``) runs every scenario on one shared cluster; the tests
read what it left: its result JSON (the MetadataActor's events per run, timings), the rank-0 dumps
of each attempt, the checkpoints and the files the fault injection wrote (``recovery_faults``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import rayckpt
from rayckpt.format.manifest import MANIFEST_NAME
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.lease import LEASE_PREFIX
from tests.helpers import recovery_job
from tests.helpers.cluster_jobs import run_cluster_job
from tests.helpers.recovery_faults import KILLED
from tests.helpers.recovery_job import FIXED_WORKERS, SAVE_AT, STEPS

pytestmark = pytest.mark.slow
#: The dumps of a fixed scenario's rank 0 (``ray_workers.toy_train_loop``'s, named by the world size).
FINAL, RESTORED = f"final-{FIXED_WORKERS}.pt", f"restored-{FIXED_WORKERS}.pt"
#: A generous logical bound: a killed save settled by the rollback, not by its 300 s commit timeout.
ROLLBACK_BOUND_S = 60.0


@pytest.fixture(scope="module")
def recovery(tmp_path_factory):
    out = tmp_path_factory.mktemp("recovery")
    return run_cluster_job("tests.helpers.recovery_job", out, timeout=900, env=recovery_job.ENV)


def dump(recovery, scenario: str, name: str) -> dict:
    return torch.load(recovery["out"] / scenario / name, weights_only=False)


def events(recovery, scenario: str, kind: str) -> list[dict]:
    return [e for e in recovery[scenario]["events"] if e["kind"] == kind]


def check_checkpoints(recovery, scenario: str) -> dict[int, str]:
    """Every step saved is committed (its manifest exists), verifies, and its directory holds exactly its
    files (nothing of a failed save, no lease); no other checkpoint directory. The save id of each step."""
    run_dir = recovery["out"] / "storage" / scenario
    names = sorted(n for n in os.listdir(run_dir) if n.startswith("rayckpt-step-"))
    assert names == [f"rayckpt-step-{s:08d}" for s in SAVE_AT], names
    save_ids = {}
    for step, name in zip(SAVE_AT, names):
        path = str(run_dir / name)
        manifest = rayckpt.read_manifest(CheckpointDir.resolve(path))
        expected = {MANIFEST_NAME, *(f.path for f in manifest.files), *manifest.table_files}
        listed = set(os.listdir(path))
        assert listed == expected, (name, sorted(listed - expected), sorted(expected - listed))
        assert not any(n.startswith(LEASE_PREFIX) for n in listed)
        assert manifest.user_metadata["step"] == step
        report = rayckpt.verify(path)
        assert report.ok, report.problems
        save_ids[step] = manifest.save_id
    return save_ids


def test_uninterrupted_run_commits_every_save(recovery):
    base = recovery["baseline"]
    assert base["error"] is None, base["error"]
    save_ids = check_checkpoints(recovery, "baseline")
    committed = {e["step"]: e["save_id"] for e in events(recovery, "baseline", "committed")}
    assert committed == save_ids
    assert not events(recovery, "baseline", "failed") and not events(recovery, "baseline", "exception")
    assert dump(recovery, "baseline", FINAL)["step"] == STEPS
    assert not os.path.exists(recovery["out"] / "baseline" / RESTORED)  # it never restarted


#: Scenario -> the step its restarted attempt restores (the newest checkpoint committed before the kill).
KILLS = {"between": 6, "staging": 3, "in_flight": 3, "writer": 3}


@pytest.mark.parametrize("scenario", list(KILLS))
def test_killed_run_finishes_bit_identical_to_an_uninterrupted_one(recovery, scenario):
    """Ray Train restarts the group once; it restores a committed checkpoint and ends with exactly the
    state of the uninterrupted run."""
    result = recovery[scenario]
    assert result["error"] is None, result["error"]
    killed = json.loads((recovery["out"] / scenario / KILLED).read_text())
    assert (killed["phase"], killed["rank"]) == (scenario, 1)
    assert len(events(recovery, scenario, "exception")) == 1  # one worker-group failure: the kill
    final, reference = dump(recovery, scenario, FINAL), dump(recovery, "baseline", FINAL)
    assert final["step"] == STEPS
    assert final["state"].keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        assert torch.equal(final["state"][key], value), key


@pytest.mark.parametrize("scenario", list(KILLS))
def test_restart_restores_the_last_committed_checkpoint(recovery, scenario):
    """The restored step is the newest one committed before the kill: its manifest was there, it
    verifies, and the state restored is the uninterrupted run's at that step, bit for bit."""
    restored = dump(recovery, scenario, RESTORED)
    step = KILLS[scenario]
    assert restored["step"] == step
    killed = json.loads((recovery["out"] / scenario / KILLED).read_text())
    committed = [e for e in events(recovery, scenario, "committed") if e["step"] == step]
    assert committed and committed[0]["time"] < killed["time"]  # committed before the kill, not re-saved
    assert restored["load"].path.rstrip("/").endswith(f"rayckpt-step-{step:08d}")
    assert restored["load"].bytes_read > 0
    reference = dump(recovery, "baseline", f"state-{step}.pt")
    assert restored["state"].keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        assert torch.equal(restored["state"][key], value), key


@pytest.mark.parametrize("scenario", ["staging", "in_flight", "writer"])
def test_interrupted_save_fails_at_once_leaves_nothing_and_is_saved_again(recovery, scenario):
    """The save of step 6 the kill interrupted is settled as failed within seconds (the rollback, not
    its 300 s commit timeout), never commits, leaves no file, and the restarted run's own save of
    step 6 commits."""
    killed = json.loads((recovery["out"] / scenario / KILLED).read_text())
    failed = events(recovery, scenario, "failed")
    assert [e["step"] for e in failed] == [6], failed
    (failed,) = failed
    assert 0 <= failed["time"] - killed["time"] < ROLLBACK_BOUND_S, (failed, killed)
    committed = events(recovery, scenario, "committed")
    assert failed["save_id"] not in {e["save_id"] for e in committed}
    again = [e for e in committed if e["step"] == 6]
    assert len(again) == 1 and again[0]["time"] > failed["time"]
    save_ids = check_checkpoints(recovery, scenario)  # no file of the failed save is left
    assert save_ids[6] == again[0]["save_id"]
    (exception,) = events(recovery, scenario, "exception")
    if scenario == "writer":  # the writer's death failed the save; the ranks' error then failed the group
        assert "ShardWriter" in failed["error"] or "ActorDied" in failed["error"], failed["error"]
        assert "SaveFailedError" in exception["reason"]
    else:  # the worker's death failed the group, and RayckptCallback rolled its in-flight save back
        assert exception["failed_saves"] == [failed["save_id"]]
        assert "worker group failed" in failed["error"]


def test_writes_in_flight_were_held_at_the_gate(recovery):
    """In ``in_flight`` and ``writer`` the killed save was really in flight: the victim rank's shard file
    had reached its writer's gated write when the kill came (the gate opened only on restart)."""
    for scenario in ("in_flight", "writer"):
        reached = (recovery["out"] / f"gate-{scenario}.reached").read_text().split()
        assert any("rayckpt-step-00000006" in p and "-r00001-" in p for p in reached), reached


@pytest.mark.parametrize("scenario", ["baseline", *KILLS])
def test_fixed_runs_have_one_rank_on_each_node_of_their_lane(recovery, scenario):
    """The fixed scenarios' ``FIXED_WORKERS`` ranks ran on as many nodes (the last attempt; SPREAD): the victim's
    node (its ShardWriter, its staging directory) is not rank 0's."""
    nodes = {(recovery["out"] / scenario / f"node-{FIXED_WORKERS}-{r}.txt").read_text() for r in range(FIXED_WORKERS)}
    assert len(nodes) == FIXED_WORKERS
    lanes = recovery["nodes"]
    assert nodes <= set(lanes["slot_a"]) or nodes <= set(lanes["slot_b"]), (nodes, lanes)


def test_a_killed_shard_writer_is_replaced(recovery):
    """After the ``writer`` scenario each node has a live ShardWriter, none of them the one killed."""
    killed = json.loads((recovery["out"] / "writer" / KILLED).read_text())
    pids = recovery["writer"]["writer_pids"]
    assert len(pids) == 2 and killed["pid"] not in pids.values()


def test_between_saves_nothing_fails(recovery):
    """A worker killed with no save in flight fails no save; the run re-does steps 7-9 only."""
    assert not events(recovery, "between", "failed")
    (exception,) = events(recovery, "between", "exception")
    assert exception["failed_saves"] == []
    check_checkpoints(recovery, "between")


def test_no_staging_file_is_left_on_any_node(recovery):
    """Nothing a save staged outlives the runs, killed ranks' and writers' included."""
    dirs = sorted(recovery["out"].glob("shm-*"))
    assert len(dirs) == 5  # every node's, the one added included
    assert {d.name: os.listdir(d) for d in dirs} == {d.name: [] for d in dirs}


def test_elastic_run_shrinks_on_node_loss_and_grows_back(recovery):
    """``num_workers=(2, 4)``: a node lost after step 3 -> Ray Train restarts with 2 workers, which restore
    the 4 workers' step 3; a node added after step 6 -> Ray Train grows the group to 4, which restore the 2
    workers' step 6 and finish. Every checkpoint is committed and verifies."""
    result = recovery["elastic"]
    assert result["error"] is None, result["error"]
    assert recovery["metadata_actor_node"] == recovery["head"]  # not lost with the node: its events are whole
    shrunk, grown = dump(recovery, "elastic", "restored-2.pt"), dump(recovery, "elastic", "restored-4.pt")
    run_dir = recovery["out"] / "storage" / "elastic"
    for restored, step, saved_by in ((shrunk, 3, 4), (grown, 6, 2)):
        assert restored["step"] == step
        path = str(run_dir / f"rayckpt-step-{step:08d}")
        assert restored["load"].path.rstrip("/") == path
        assert rayckpt.read_manifest(CheckpointDir.resolve(path)).world_size == saved_by
    times = result["node_times"]
    assert times["removed"] < shrunk["time"] < times["added"] < grown["time"]
    assert rayckpt.read_manifest(CheckpointDir.resolve(str(run_dir / "rayckpt-step-00000009"))).world_size == 4
    assert dump(recovery, "elastic", "final-4.pt")["step"] == STEPS
    check_checkpoints(recovery, "elastic")
    assert not events(recovery, "elastic", "failed")
