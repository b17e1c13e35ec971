"""A peer dying mid-save: every rank left gets PeerLostError (a SaveFailedError), never gloo's
RuntimeError, and this save's files are removed unless rank 0 had taken the commit."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

import rayckpt
from rayckpt.engine.coordinator import gather_or_raise
from rayckpt.engine.increments import FULL
from rayckpt.engine.save import PROCESS_PLANS
from rayckpt.engine.save_layout import Decision, SaveIds, Share
from rayckpt.errors import PeerLostError, RayckptError, SaveFailedError
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.testing.multiproc import RankFailure, run_ranks
from tests.helpers import fault_workers

GLOO_ERROR = "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"
#: A save's all-gathers before it writes, with no plan cached: the headers, then the layouts
#: (each a gather and a scatter, ``plan_at_root``). Writing shards is the next; the commit after.
PLAN_CALLS = 4
WRITE_CALL, COMMIT_CALL = PLAN_CALLS + 1, PLAN_CALLS + 2


def load_full(path: str, world_size: int) -> dict:
    target = fault_workers.full_peer_state(world_size, 0)
    target = {"w": {k: torch.zeros_like(v) for k, v in target["w"].items()}, "shared": torch.zeros(16), "step": -1}
    rayckpt.load(target, path)
    return target


def assert_state_equal(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    assert torch.equal(got["shared"], want["shared"])
    assert got["w"].keys() == want["w"].keys()
    for k, v in want["w"].items():
        assert torch.equal(got["w"][k], v), k


@pytest.mark.slow
def test_a_rank_killed_mid_save_gives_peer_lost_error_and_leaves_nothing(tmp_path):
    path = str(tmp_path / "ck")
    first = run_ranks(fault_workers.peer_death_worker, 3, path, 1, False, pg_timeout=10, timeout=120)
    assert [r["error"] for r in first] == [None, None, None]
    manifest_before = open(os.path.join(path, "manifest.json")).read()
    files_before = sorted(os.listdir(path))

    results = run_ranks(
        fault_workers.peer_death_worker, 3, path, 2, True, pg_timeout=10, timeout=120, allow_failures=True
    )
    dead = results[2]
    assert isinstance(dead, RankFailure) and dead.exitcode == -signal.SIGKILL
    for rank in (0, 1):
        r = results[rank]
        assert r["error"] == "PeerLostError", r  # a SaveFailedError, not gloo's RuntimeError
        msg = r["message"]
        assert "save (writing shards) failed: the all_gather collective failed" in msg, msg
        assert f"on rank {rank} of 3" in msg and "peer rank that died" in msg, msg
        assert f"rank {rank} removed the files of save" in msg and "nothing was committed" in msg, msg
    # the ranks left removed this save's files (theirs and the dead rank's); the old checkpoint is untouched
    assert sorted(os.listdir(path)) == files_before
    assert open(os.path.join(path, "manifest.json")).read() == manifest_before
    assert_state_equal(load_full(path, 3), fault_workers.full_peer_state(3, 1))

    # the next save, with a fresh process group, works
    again = run_ranks(fault_workers.peer_death_worker, 3, path, 3, False, pg_timeout=10, timeout=120)
    assert [r["error"] for r in again] == [None, None, None]
    assert_state_equal(load_full(path, 3), fault_workers.full_peer_state(3, 3))


class BrokenCollective:
    """Rank ``rank`` (0, or 1 of 2 beside a rank 0 with nothing to write) whose ``break_at``-th
    all-gather fails as gloo's does when a peer died; ``decision``: what the store says
    ("first": the first claim wins)."""

    def __init__(self, break_at: int, decision: str | None = "first", rank: int = 0) -> None:
        self.rank = rank
        self.world_size = rank + 1
        self.break_at = break_at
        self.decision = decision
        self.calls = 0
        self.claims: list[tuple[str, str]] = []
        self.held: dict[str, str] = {}
        PROCESS_PLANS.clear()  # so a save's first PLAN_CALLS all-gathers agree on its plan

    def all_gather(self, obj):
        self.calls += 1
        if self.calls == self.break_at:
            raise RuntimeError(GLOO_ERROR)
        if self.rank == 0:
            return [obj]
        # With no gather/scatter of its own each planning round is two all-gathers: the ranks'
        # parts (rank 1 ignores rank 0's), then rank 0's answers (rank 1 takes its own).
        assert self.calls <= PLAN_CALLS, "rank 1's fake rank 0 only takes part in agreeing on the plan"
        if self.calls == 2:  # the save id, not incremental, no cached plan, the nodes, the block size
            decision = Decision(
                ids=SaveIds("20260101T000000-0badc0de", None, FULL), nodes=("",), block_size=65536, cached=None
            )
            return [[(True, decision)] * 2, None]
        if self.calls == 4:  # rank 0 holds nothing: rank 1 writes both its shards (a bit each)
            return [[(True, Share(b"", np.packbits(np.ones(2, dtype=bool)).tobytes()))] * 2, None]
        return [None, obj]

    def claim(self, key: str, value: str) -> str | None:
        self.claims.append((key, value))
        return self.held.setdefault(key, value) if self.decision == "first" else self.decision


def saved_once(path: str) -> list[str]:
    rayckpt.save(fault_workers.peer_state(0, 1, 1), path)
    return sorted(os.listdir(path))


def test_a_broken_collective_raises_the_callers_error_naming_phase_collective_and_rank():
    assert issubclass(PeerLostError, SaveFailedError)  # callers catching SaveFailedError catch it too
    with pytest.raises(PeerLostError, match=r"save \(x\) failed: the all_gather collective failed on rank 0 of 1: "):
        gather_or_raise(BrokenCollective(1), "save (x)", lambda: 1, SaveFailedError, PeerLostError)
    with pytest.raises(RayckptError, match=r"load failed: the all_gather collective failed .*Connection closed") as err:
        gather_or_raise(BrokenCollective(1), "load", lambda: 1, RayckptError)
    assert type(err.value) is RayckptError and isinstance(err.value.__cause__, RuntimeError)

    def fails():
        raise OSError(28, "No space left on device")

    with pytest.raises(PeerLostError, match=r"Rank 0 had failed too: OSError: \[Errno 28\] No space left"):
        gather_or_raise(BrokenCollective(1), "save (x)", fails, SaveFailedError, PeerLostError)


@pytest.mark.parametrize(
    "phase, break_at",
    [("collecting state", 1), ("collecting state", 2), ("planning", 3), ("writing shards", WRITE_CALL)],
)
def test_a_save_whose_collective_breaks_before_the_commit_removes_its_files(tmp_path, phase, break_at):
    path = str(tmp_path / "ck")
    before = saved_once(path)
    coord = BrokenCollective(break_at)
    with pytest.raises(PeerLostError, match=rf"save \({phase}\) failed: .*Connection closed by peer") as err:
        rayckpt.save(fault_workers.peer_state(0, 1, 2), path, coordinator=coord)
    if phase == "writing shards":
        assert "rank 0 removed the files of save" in str(err.value)
    assert coord.claims == []  # rank 0, the committer, knows it did not commit
    assert sorted(os.listdir(path)) == before
    assert_state_equal(load_full(path, 1), fault_workers.full_peer_state(1, 1))


def test_a_rank_that_lost_the_save_before_rank_0_took_the_commit_removes_the_files(tmp_path):
    path = str(tmp_path / "ck")
    before = saved_once(path)
    coord = BrokenCollective(WRITE_CALL, rank=1)
    with pytest.raises(PeerLostError, match=r"rank 1 removed the files of save .*; nothing was committed"):
        rayckpt.save(fault_workers.peer_state(1, 2, 2), path, coordinator=coord)
    assert [v for _, v in coord.claims] == ["abort"]  # so rank 0 will not commit it
    assert sorted(os.listdir(path)) == before
    assert_state_equal(load_full(path, 1), fault_workers.full_peer_state(1, 1))


def test_a_collective_breaking_after_rank_0_committed_keeps_the_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    saved_once(path)
    coord = BrokenCollective(COMMIT_CALL)
    info = rayckpt.save(fault_workers.peer_state(0, 1, 2), path, coordinator=coord)
    assert [v for _, v in coord.claims] == ["commit"] and info.num_files >= 1
    assert rayckpt.read_manifest(CheckpointDir.resolve(path)).save_id == info.save_id
    assert_state_equal(load_full(path, 1), fault_workers.full_peer_state(1, 2))


@pytest.mark.parametrize("decision", ["commit", None])
def test_files_are_kept_when_rank_0_may_commit(tmp_path, decision):
    """A rank that lost the save while rank 0 had taken the commit (or with no store to ask)
    must not delete files a manifest may name."""
    path = str(tmp_path / "ck")
    before = saved_once(path)
    coord = BrokenCollective(WRITE_CALL, decision, rank=1)
    with pytest.raises(PeerLostError) as err:
        rayckpt.save(fault_workers.peer_state(1, 2, 2), path, coordinator=coord)
    expected = "rank 0 had taken the commit" if decision == "commit" else "could not reach the process group's store"
    assert expected in str(err.value) and "rank 1 kept its files" in str(err.value), str(err.value)
    assert [n for n in os.listdir(path) if n not in before]  # rank 1's file of this save is still there
    assert_state_equal(load_full(path, 1), fault_workers.full_peer_state(1, 1))  # the committed one loads


def test_rank_0_does_not_commit_a_save_another_rank_gave_up_on(tmp_path):
    path = str(tmp_path / "ck")
    before = saved_once(path)
    with pytest.raises(SaveFailedError, match=r"rank 0 did not commit save .*: a rank gave up on it"):
        rayckpt.save(fault_workers.peer_state(0, 1, 2), path, coordinator=BrokenCollective(0, "abort"))
    assert sorted(os.listdir(path)) == before


def test_any_other_exception_inside_save_becomes_save_failed_error(tmp_path, monkeypatch):
    from rayckpt.engine import save_layout

    def broken_plans(*args, **kwargs):
        raise KeyError("planner bug")

    monkeypatch.setattr(save_layout, "assign_writers", broken_plans)
    PROCESS_PLANS.clear()
    with pytest.raises(
        SaveFailedError, match=r"save \(planning\) failed on 1 of 1 rank\(s\):\n  rank 0: KeyError: 'planner bug'"
    ):
        rayckpt.save(fault_workers.peer_state(0, 1, 1), str(tmp_path / "ck"))
