"""Agreeing on a save's plan (``engine.save_layout``) with ranks as threads: rank 0 plans, each rank
gets its own plan, the plans are cached while every rank's layout repeats, and what each rank
sends and receives. Real process groups: tests/multiproc/test_save_plan_cache.py."""

from __future__ import annotations

import pytest
import torch

from rayckpt.engine.save import SaveOptions, collect_state
from rayckpt.engine.save_layout import PlanCache, PlanCounts
from rayckpt.engine.state import flatten
from rayckpt.errors import InvalidStateError
from rayckpt.format import shard_file
from rayckpt.planning.save_columns import create_save_plans
from rayckpt.planning.save_plan import LocalShard
from tests.helpers.thread_ranks import ThreadGroup


def state(rank: int, step: int, rows: int = 4, extra: bool = False) -> dict:
    """A per-rank tensor, a replicated one, a plain value; ``extra``: one more tensor."""
    s = {"w": {f"r{rank}": torch.full((rows, 3), float(rank))}, "shared": torch.arange(6.0), "step": step}
    if extra:
        s["extra"] = torch.ones(2)
    return s


def expected_plans(states: list[dict]) -> list:
    shards = []
    for s in states:
        flat = flatten(s)
        shards.append([LocalShard(t.key, t.dtype, t.shape, b) for t in flat.tensors.values() for b in t.boxes()])
    return create_save_plans(shards)


def save_plans(group: ThreadGroup, states: list[dict], plans: list[PlanCache] | None = None) -> list:
    """Every rank's ``SaveContext``; ``plans``: each rank's plan cache (as each rank process holds its own)."""
    caches = plans or [PlanCache() for _ in range(group.world_size)]

    def collect(coord):
        return collect_state(coord, states[coord.rank], node=f"node{coord.rank % 2}", plans=caches[coord.rank])

    results = group.run(collect)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def test_rank_0_plans_each_rank_gets_its_plan_and_only_rank_0_holds_the_spec():
    states = [state(r, 1) for r in range(3)]
    ctxs = save_plans(ThreadGroup(3), states)
    assert [c.plan for c in ctxs] == expected_plans(states)
    assert len({c.spec.save_id for c in ctxs}) == 1 and [c.cached for c in ctxs] == [False] * 3
    spec = ctxs[0].spec
    assert set(spec.tensors) == {"w.r0", "w.r1", "w.r2", "shared"} and spec.tensors["shared"] == ("float32", (6,))
    assert spec.values == {"step": 1} and spec.paths["w.r2"] == ("w", "r2")
    for c in ctxs[1:]:
        assert (c.spec.tensors, c.spec.values, c.spec.paths) == ({}, {}, {})
        assert (c.spec.world_size, c.spec.block_size, c.spec.previous) == (3, spec.block_size, None)
    assert [c.nodes for c in ctxs] == [("node0", "node1")] * 3


def test_a_repeated_layout_reuses_the_cached_plans_and_sends_only_a_small_header():
    group, plans = ThreadGroup(3), [PlanCache() for _ in range(3)]
    first = save_plans(group, [state(r, 1) for r in range(3)], plans)
    sent_first = list(group.sent)
    second = save_plans(group, [state(r, 2) for r in range(3)], plans)  # new values and data, same layout
    assert [c.cached for c in second] == [True] * 3
    assert [c.plan for c in second] == [c.plan for c in first]
    assert second[0].spec.values == {"step": 2}  # values are not layout: they still travel
    assert second[0].spec.tensors == first[0].spec.tensors and second[0].spec.paths == first[0].spec.paths
    assert second[0].spec.save_id != first[0].spec.save_id
    sent_second = [b - a for a, b in zip(sent_first, group.sent)]
    assert all(s < 600 for s in sent_second[1:]), sent_second  # the header: hashes, node, values
    assert [p.counts() for p in plans] == [PlanCounts(planned=1, cached=1)] * 3


@pytest.mark.parametrize(
    "change",
    [
        lambda r, step: state(r, step, rows=5 if r == 2 else 4),  # one rank's shape
        lambda r, step: state(r, step, extra=r == 1),  # one rank's keys
        lambda r, step: {**state(r, step), "lr": 0.1} if r == 0 else state(r, step),  # one rank's value keys
    ],
    ids=["shape", "key", "value key"],
)
def test_any_ranks_layout_change_makes_every_rank_plan_again(change):
    group, plans = ThreadGroup(3), [PlanCache() for _ in range(3)]
    save_plans(group, [state(r, 1) for r in range(3)], plans)
    states = [change(r, 2) for r in range(3)]
    ctxs = save_plans(group, states, plans)
    assert [c.cached for c in ctxs] == [False] * 3
    assert [c.plan for c in ctxs] == expected_plans(states)
    assert set(ctxs[0].spec.tensors) == {k for s in states for k in flatten(s).tensors}
    again = save_plans(group, [change(r, 3) for r in range(3)], plans)
    assert [c.cached for c in again] == [True] * 3 and [c.plan for c in again] == [c.plan for c in ctxs]


def test_one_rank_without_its_cached_plan_makes_every_rank_plan_again():
    group, plans = ThreadGroup(3), [PlanCache() for _ in range(3)]
    save_plans(group, [state(r, 1) for r in range(3)], plans)
    plans[1].clear()  # rank 1 forgot (a restart)
    ctxs = save_plans(group, [state(r, 2) for r in range(3)], plans)
    assert [c.cached for c in ctxs] == [False] * 3


def test_each_process_group_has_its_own_cached_plan():
    a, b = ThreadGroup(3), ThreadGroup(3)
    plans = [PlanCache() for _ in range(3)]  # one process per rank, in each of which both groups run
    states = [state(r, 1) for r in range(3)]
    save_plans(a, states, plans)
    assert [c.cached for c in save_plans(b, states, plans)] == [False] * 3  # same layouts, another group
    assert [c.cached for c in save_plans(a, states, plans)] == [True] * 3
    assert [c.cached for c in save_plans(ThreadGroup(2), states[:2], plans)] == [False] * 2


def test_ranks_disagreeing_on_a_shape_fail_on_every_rank_naming_key_and_ranks():
    states = [{"shared": torch.zeros(4 if r < 2 else 5)} for r in range(3)]
    results = ThreadGroup(3).run(lambda coord: collect_state(coord, states[coord.rank], plans=PlanCache()))
    for r in results:
        assert isinstance(r, InvalidStateError), r
        assert "key 'shared': rank 0 has dtype float32 shape [4] but rank 2 has dtype float32 shape [5]" in str(r)
        assert str(r).startswith("save (planning) failed on 1 of 3 rank(s):")


def test_a_key_that_is_a_tensor_on_one_rank_and_a_value_on_another_fails_on_every_rank():
    states = [{"x": torch.zeros(2)}, {"x": 3}]
    results = ThreadGroup(2).run(lambda coord: collect_state(coord, states[coord.rank], plans=PlanCache()))
    for r in results:
        assert isinstance(r, InvalidStateError), r
        assert "key 'x' is a tensor on one rank and a plain value on another" in str(r)


def test_what_a_rank_receives_does_not_grow_with_the_world_and_what_it_sends_grows_with_its_shards():
    def planning_bytes(world: int, keys: int) -> tuple[int, int]:
        group = ThreadGroup(world)
        states = [{f"k{i}": torch.zeros(3) + r for i in range(keys)} for r in range(world)]
        save_plans(group, states)
        return group.sent[1], group.received[1]

    sent_small, received_small = planning_bytes(2, 20)
    sent_large, received_large = planning_bytes(6, 20)
    assert received_large <= received_small + 64  # its own plan, not everyone's
    assert sent_large == sent_small
    assert planning_bytes(2, 200)[0] < 12 * sent_small


def test_rank_0_picks_the_block_size_from_the_largest_state_and_every_rank_uses_it(monkeypatch):
    monkeypatch.setattr(shard_file, "MAX_AUTO_BLOCKS", 4)
    states = [state(0, 1), state(1, 1, rows=30_000), state(2, 1)]
    ctxs = save_plans(ThreadGroup(3), states)
    assert [c.spec.block_size for c in ctxs] == [128 * 1024] * 3  # rank 1's 360 KB in at most 4 blocks
    group = ThreadGroup(3)
    options = SaveOptions(block_size=4096)
    explicit = group.run(lambda coord: collect_state(coord, states[coord.rank], options, plans=PlanCache()))
    assert [c.spec.block_size for c in explicit] == [4096] * 3  # the caller's, as given


def test_the_automatic_block_size_doubles_past_32_gib():
    gib = 2**30
    assert [shard_file.auto_block_size(n) for n in (0, 32 * gib, 32 * gib + 1, 136 * 10**9)] == [
        64 * 1024,
        64 * 1024,
        128 * 1024,
        256 * 1024,
    ]
