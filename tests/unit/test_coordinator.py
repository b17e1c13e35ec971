"""``gather`` / ``scatter`` / ``plan_at_root`` in one process: the local world, a coordinator with
only ``all_gather`` (the fallback), and a collective that breaks. Real groups: tests/multiproc."""

from __future__ import annotations

import pytest

from rayckpt.engine.coordinator import LocalCoordinator, gather, plan_at_root, scatter
from rayckpt.errors import IncompatibleStateError, PeerLostError, RayckptError, SaveFailedError


class AllGatherOnly:
    """A world of one that only has ``all_gather`` (what older custom coordinators implement)."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.calls = 0

    def all_gather(self, obj):
        self.calls += 1
        return [obj]


class Broken(AllGatherOnly):
    def all_gather(self, obj):
        raise RuntimeError("[gloo] Connection closed by peer")


def test_the_local_world_plans_its_own_part():
    assert plan_at_root(LocalCoordinator(), "p", lambda: 5, lambda vs: [v * 2 for v in vs], RayckptError) == 10
    assert gather(LocalCoordinator(), "x") == ["x"] and scatter(LocalCoordinator(), ["y"]) == "y"


def test_a_coordinator_with_only_all_gather_falls_back_to_it():
    coord = AllGatherOnly()
    assert plan_at_root(coord, "p", lambda: 5, lambda vs: [v + 1 for v in vs], RayckptError) == 6
    assert coord.calls == 2  # the gather and the scatter


def test_a_rayckpt_error_in_a_world_of_one_is_raised_as_itself():
    def local():
        raise IncompatibleStateError("key 'w': shape [3] but the checkpoint has [4]")

    with pytest.raises(IncompatibleStateError, match=r"^key 'w': shape \[3\]"):
        plan_at_root(LocalCoordinator(), "load (planning)", local, lambda vs: vs, RayckptError)


def test_a_failing_plan_is_the_callers_error_naming_rank_0_and_the_cause():
    def plan(values):
        raise ValueError("no chunk covers rows [0, 4)")

    with pytest.raises(RayckptError) as err:
        plan_at_root(LocalCoordinator(), "load (planning)", lambda: 1, plan, RayckptError)
    msg = str(err.value)
    assert msg.startswith("load (planning) failed on 1 of 1 rank(s):\n  rank 0: ValueError: no chunk covers")
    assert isinstance(err.value.__cause__, ValueError)


def test_a_broken_collective_raises_the_lost_error_naming_gather_scatter_and_rank():
    with pytest.raises(PeerLostError, match=r"^save \(planning\) failed: the gather/scatter collective failed on "):
        plan_at_root(Broken(), "save (planning)", lambda: 1, lambda vs: vs, SaveFailedError, PeerLostError)
