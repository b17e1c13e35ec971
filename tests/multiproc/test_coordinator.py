"""``plan_at_root`` over a real gloo group: gather to rank 0, one plan, each rank gets its own part."""

from __future__ import annotations

import pytest

from rayckpt.engine.slots import SLOT_BYTES
from rayckpt.testing.multiproc import run_ranks
from tests.helpers.coordinator_workers import payload_worker, plan_worker

pytestmark = pytest.mark.slow


def test_each_rank_gets_its_own_part_of_rank_0s_plan_and_subgroups_root_at_their_first_rank():
    results = run_ranks(plan_worker, 3, "")
    assert [r["world"] for r in results] == [(0, 30), (10, 30), (20, 30)]
    assert "sub" not in results[0]
    assert [r["sub"] for r in results[1:]] == [(100, 300), (200, 300)]  # rank 1 is the subgroup's root


@pytest.mark.parametrize(
    ("fail", "kind", "text"),
    [
        ("local", "IncompatibleStateError", "rank 1: IncompatibleStateError: rank 1 has no such key 'w'"),
        ("plan", "RayckptError", "rank 0: ValueError: the planner broke"),
    ],
)
def test_a_failure_on_any_rank_is_raised_on_every_rank_naming_it(fail, kind, text):
    results = run_ranks(plan_worker, 3, fail)
    for r in results:
        assert "world" not in r
        name, msg = r["error"]
        assert name == kind
        assert msg.startswith("load (planning) failed on 1 of 3 rank(s):") and text in msg
    assert [r["sub"] for r in results[1:]] == [(100, 300), (200, 300)]  # the groups still work afterwards


def test_small_objects_take_one_gather_and_one_scatter_and_large_ones_the_rest_point_to_point():
    small = run_ranks(payload_worker, 3, [10, 20, 30])
    assert [r["total"] for r in small] == [60] * 3 and all(r["back_ok"] for r in small)
    assert [r["counts"] for r in small] == [{"gather": 1, "scatter": 1}] * 3
    # rank 1's object and rank 0's answer to rank 1 overflow their slots: only ranks 0 and 1 exchange the rest
    sizes = [10, 3 * SLOT_BYTES, 30]
    large = run_ranks(payload_worker, 3, sizes)
    assert [r["total"] for r in large] == [sum(sizes)] * 3 and all(r["back_ok"] for r in large)
    assert large[0]["counts"] == {"gather": 1, "scatter": 1, "recv": 1, "send": 1}
    assert large[1]["counts"] == {"gather": 1, "scatter": 1, "send": 1, "recv": 1}
    assert large[2]["counts"] == {"gather": 1, "scatter": 1}
