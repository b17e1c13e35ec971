"""The save plan cache over a real gloo group: a repeated layout reuses every rank's plan, one
rank's change makes every rank plan again, and each checkpoint loads back bit-exact."""

from __future__ import annotations

import pytest

from rayckpt.testing.multiproc import run_ranks
from tests.helpers.save_plan_workers import cached_saves_worker

pytestmark = pytest.mark.slow


def test_a_repeated_layout_uses_the_cached_plan_and_one_ranks_change_plans_again(tmp_path):
    results = run_ranks(cached_saves_worker, 3, str(tmp_path / "ck"))
    for per_rank in results:
        assert [s["loaded"] for s in per_rank] == [True, True, True]
        stats = [s["stats"] for s in per_rank]
        # step 1 plans, step 2 reuses, step 3 (rank 2 holds one more tensor) plans again on every rank
        assert stats == [{"planned": 1, "cached": 0}, {"planned": 1, "cached": 1}, {"planned": 2, "cached": 1}]
