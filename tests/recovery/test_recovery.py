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
from rayckpt.data import DataPosition
from rayckpt.format.manifest import MANIFEST_NAME
from rayckpt.storage.catalog import checkpoint_dir_name
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.lease import LEASE_PREFIX
from tests.helpers import recovery_job
from tests.helpers.cluster_jobs import run_cluster_job
from tests.helpers.ray_workers import DATA_LEN
from tests.helpers.recovery_faults import killed_marker
from tests.helpers.recovery_job import (
    CHAIN,
    ELASTIC_SAVE_AT,
    ELASTIC_STEPS,
    ELASTIC_WORKERS,
    FIXED_WORKERS,
    GATED,
    RESTORES,
    SAVE_AT,
    STEPS,
)
from tests.helpers.sample_log import check_exactly_once, read_steps

pytestmark = pytest.mark.slow
#: The dumps of a fixed scenario's rank 0 (``ray_workers.toy_train_loop``'s, named by the world size).
FINAL, RESTORED = f"final-{FIXED_WORKERS}.pt", f"restored-{FIXED_WORKERS}.pt"
#: The chain's faults that strike in the middle of a save (each fails that save).
IN_A_SAVE = ["staging", "in_flight", "writer"]
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


def killed(recovery, phase: str) -> dict:
    """What the chain's fault of ``phase`` recorded as it struck."""
    return json.loads(open(killed_marker(str(recovery["out"] / "chain"), phase)).read())


def check_checkpoints(recovery, scenario: str, save_at: list[int] = SAVE_AT) -> dict[int, str]:
    """Every step saved is committed (its manifest exists), verifies, and its directory holds exactly its
    files (nothing of a failed save, no lease); no other checkpoint directory. The save id of each step."""
    run_dir = recovery["out"] / "storage" / scenario
    names = sorted(n for n in os.listdir(run_dir) if n.startswith("rayckpt-step-"))
    assert names == [checkpoint_dir_name(s) for s in save_at], names
    save_ids = {}
    for step, name in zip(save_at, names):
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


def test_the_chain_of_faults_finishes_bit_identical_to_an_uninterrupted_run(recovery):
    """Ray Train restarts the group after each fault, once: four worker-group failures, in the chain's
    order, and the fifth attempt ends with exactly the state of the uninterrupted run."""
    result = recovery["chain"]
    assert result["error"] is None, result["error"]
    times = []
    for phase, step in CHAIN.items():
        mark = killed(recovery, phase)
        assert (mark["phase"], mark["rank"], mark["step"]) == (phase, 1, step)
        times.append(mark["time"])
    assert times == sorted(times)
    assert len(events(recovery, "chain", "exception")) == len(CHAIN)  # one worker-group failure per fault
    final, reference = dump(recovery, "chain", FINAL), dump(recovery, "baseline", FINAL)
    assert final["step"] == STEPS
    assert final["state"].keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        assert torch.equal(final["state"][key], value), key


@pytest.mark.parametrize("phase", list(CHAIN))
def test_restart_restores_the_last_committed_checkpoint(recovery, phase):
    """After each fault the restored step is the newest one committed before it: its manifest was there,
    it verifies, and the state restored is the uninterrupted run's at that step, bit for bit."""
    restored = dump(recovery, "chain", f"restored-{FIXED_WORKERS}-after-{phase}.pt")
    step = RESTORES[phase]
    assert restored["step"] == step
    committed = [e for e in events(recovery, "chain", "committed") if e["step"] == step]
    assert committed and committed[0]["time"] < killed(recovery, phase)["time"]  # committed before, not re-saved
    assert restored["load"].path.rstrip("/").endswith(checkpoint_dir_name(step))
    assert restored["load"].bytes_read > 0
    reference = dump(recovery, "baseline", f"state-{step}.pt")
    assert restored["state"].keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        assert torch.equal(restored["state"][key], value), key


def final_position(recovery, scenario: str, step: int) -> DataPosition:
    path = str(recovery["out"] / "storage" / scenario / checkpoint_dir_name(step))
    return DataPosition.from_json(rayckpt.read_manifest(CheckpointDir.resolve(path)).data_position, path)


def test_after_each_sigkill_the_data_goes_on_as_the_uninterrupted_run_s(recovery):
    """Every restart resumed the data from its checkpoint's position: what each rank trained on at each
    step (as the attempt that finished the step ran it) is the uninterrupted run's, in its order."""
    chain, baseline = read_steps(recovery["out"] / "chain"), read_steps(recovery["out"] / "baseline")
    assert len({s.attempt for s in chain.values()}) > 2  # the steps of several worker groups
    assert {n: s.ids for n, s in chain.items()} == {n: s.ids for n, s in baseline.items()}
    check_exactly_once(chain, DATA_LEN, final_position(recovery, "chain", STEPS))


def test_the_elastic_run_s_data_is_consumed_once_per_epoch_across_its_worker_counts(recovery):
    steps = read_steps(recovery["out"] / "elastic")
    assert [steps[n].world_size for n in (1, 4, 7)] == [2, 1, 2]
    check_exactly_once(steps, DATA_LEN, final_position(recovery, "elastic", ELASTIC_STEPS))


def exception_after(recovery, phase: str) -> dict:
    """The worker-group failure the fault of ``phase`` caused: the chain's failures come in its order."""
    return events(recovery, "chain", "exception")[list(CHAIN).index(phase)]


@pytest.mark.parametrize("phase", IN_A_SAVE)
def test_interrupted_save_fails_at_once_leaves_nothing_and_is_saved_again(recovery, phase):
    """The save the fault interrupted is settled as failed within seconds (the rollback, not its 300 s
    commit timeout), never commits, leaves no file, and the restarted run's own save of that step
    commits."""
    step, mark = CHAIN[phase], killed(recovery, phase)
    failed = [e for e in events(recovery, "chain", "failed") if e["step"] == step]
    assert len(failed) == 1, failed
    (failed,) = failed
    assert 0 <= failed["time"] - mark["time"] < ROLLBACK_BOUND_S, (failed, mark)
    committed = events(recovery, "chain", "committed")
    assert failed["save_id"] not in {e["save_id"] for e in committed}
    again = [e for e in committed if e["step"] == step]
    assert len(again) == 1 and again[0]["time"] > failed["time"]
    save_ids = check_checkpoints(recovery, "chain")  # no file of a failed save is left
    assert save_ids[step] == again[0]["save_id"]
    exception = exception_after(recovery, phase)
    if phase == "writer":  # the writer's death failed the save; the ranks' error then failed the group
        assert "ShardWriter" in failed["error"] or "ActorDied" in failed["error"], failed["error"]
        assert "SaveFailedError" in exception["reason"]
    else:  # the worker's death failed the group, and RayckptCallback rolled its in-flight save back
        assert exception["failed_saves"] == [failed["save_id"]]
        assert "worker group failed" in failed["error"]


def test_only_the_saves_the_faults_struck_failed(recovery):
    """Every failed save is one a fault interrupted: one each, in the chain's order."""
    failed = events(recovery, "chain", "failed")
    assert [e["step"] for e in failed] == [CHAIN[p] for p in IN_A_SAVE], failed


def test_writes_in_flight_were_held_at_the_gate(recovery):
    """For ``in_flight`` and ``writer`` the killed save was really in flight: the victim rank's shard file
    had reached its writer's gated write when the fault struck (the gate opened only on restart)."""
    for phase in GATED:
        reached = (recovery["out"] / f"gate-{phase}.reached").read_text().split()
        assert reached and all(checkpoint_dir_name(CHAIN[phase]) in p for p in reached), reached
        assert any("-r00001-" in p for p in reached), reached


@pytest.mark.parametrize("scenario", ["baseline", "chain"])
def test_fixed_runs_have_one_rank_on_each_node_of_their_lane(recovery, scenario):
    """The fixed scenarios' ``FIXED_WORKERS`` ranks ran on as many nodes (the last attempt; SPREAD): the victim's
    node (its ShardWriter, its staging directory) is not rank 0's."""
    nodes = {(recovery["out"] / scenario / f"node-{FIXED_WORKERS}-{r}.txt").read_text() for r in range(FIXED_WORKERS)}
    assert len(nodes) == FIXED_WORKERS
    lanes = recovery["nodes"]
    assert nodes <= set(lanes["slot_a"]) or nodes <= set(lanes["slot_b"]), (nodes, lanes)


def test_a_killed_shard_writer_is_replaced(recovery):
    """After the chain each node has a live ShardWriter, none of them the one killed."""
    pids = recovery["chain"]["writer_pids"]
    assert len(pids) == 2 and killed(recovery, "writer")["pid"] not in pids.values()


def test_between_saves_nothing_fails(recovery):
    """A worker killed with no save in flight fails no save; the run re-does the steps after the last one."""
    exception = exception_after(recovery, "between")
    assert exception["failed_saves"] == []
    before_staging = [e for e in events(recovery, "chain", "failed") if e["time"] < killed(recovery, "staging")["time"]]
    assert before_staging == []


def test_no_staging_file_is_left_on_any_node(recovery):
    """Nothing a save staged outlives the runs, killed ranks' and writers' included."""
    dirs = sorted(recovery["out"].glob("shm-*"))
    assert len(dirs) == 5  # every node's, the one added included
    assert {d.name: os.listdir(d) for d in dirs} == {d.name: [] for d in dirs}


def test_elastic_run_shrinks_on_node_loss_and_grows_back(recovery):
    """``num_workers=(1, 2)``, one per node: a node lost after step 3 -> Ray Train restarts with 1 worker,
    which restores the 2 workers' step 3; a node added after step 6 -> Ray Train grows the group to 2, which
    restore the 1 worker's step 6 and finish. Every checkpoint is committed and verifies."""
    result = recovery["elastic"]
    assert result["error"] is None, result["error"]
    assert recovery["metadata_actor_node"] == recovery["head"]  # not lost with the node: its events are whole
    fewest, most = ELASTIC_WORKERS
    shrunk, grown = (dump(recovery, "elastic", f"restored-{n}.pt") for n in (fewest, most))
    run_dir = recovery["out"] / "storage" / "elastic"
    for restored, step, saved_by in ((shrunk, 3, most), (grown, 6, fewest)):
        assert restored["step"] == step
        path = str(run_dir / checkpoint_dir_name(step))
        assert restored["load"].path.rstrip("/") == path
        assert rayckpt.read_manifest(CheckpointDir.resolve(path)).world_size == saved_by
    times = result["node_times"]
    assert times["removed"] < shrunk["time"] < times["added"] < grown["time"]
    last = str(run_dir / checkpoint_dir_name(ELASTIC_STEPS))
    assert rayckpt.read_manifest(CheckpointDir.resolve(last)).world_size == most
    assert dump(recovery, "elastic", f"final-{most}.pt")["step"] == ELASTIC_STEPS
    # one rank per node (SPREAD) in the grown group: the node kept and the one added in the lost one's place
    nodes = {(recovery["out"] / "elastic" / f"node-{most}-{r}.txt").read_text() for r in range(most)}
    assert nodes == {recovery["nodes"]["slot_a"][0], result["added_node"]}, nodes
    check_checkpoints(recovery, "elastic", ELASTIC_SAVE_AT)
    assert not events(recovery, "elastic", "failed")
