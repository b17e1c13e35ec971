"""The MetadataActor's plan cache without Ray: hits, forgetting, eviction, and many threads at once."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

import rayckpt
from rayckpt.planning.load_plan import LoadPlan
from rayckpt.ray.metadata import plan_cache
from rayckpt.ray.metadata.plan_cache import BULK_PLANS_CACHED, MANIFESTS_CACHED, PLANS_CACHED, PlanCache
from rayckpt.storage.checkpoint_dir import CheckpointDir
from tests.helpers.plan_asks import PlanAsk, asks_for, expected_plan, save_small_checkpoints

NUM_CHECKPOINTS = 12  # more than the cache holds: planning them all at once evicts


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> list[str]:
    return save_small_checkpoints(str(tmp_path_factory.mktemp("plan-cache")), NUM_CHECKPOINTS)


@pytest.fixture(scope="module")
def asks(paths) -> list[PlanAsk]:
    return [a for p in paths for a in asks_for(p)]


@pytest.fixture(scope="module")
def expected(asks) -> list[LoadPlan]:
    return [expected_plan(a) for a in asks]


def counting_reads() -> tuple[Callable, list[str]]:
    reads: list[str] = []

    def read(location, filesystem):
        reads.append(location)
        return rayckpt.read_manifest(CheckpointDir.resolve(location, filesystem))

    return read, reads


def plan_of(cache: PlanCache, ask: PlanAsk):
    return cache.plan(ask.location, None, ask.read_ask())


def test_a_bundle_carries_the_plan_and_the_manifest_facts(paths):
    ask = asks_for(paths[3])[4]  # planned alone
    bundle = plan_of(PlanCache(), ask)
    m = rayckpt.read_manifest(CheckpointDir.resolve(paths[3]))
    assert bundle.plan == expected_plan(ask)
    assert bundle.values == {"step": 3} and bundle.save_id == m.save_id and bundle.blocks == m.blocks
    assert bundle.file_sizes == {f.path: f.size for f in m.files} and bundle.plan_seconds > 0


def test_cache_hits_return_the_identical_plan(paths, monkeypatch):
    cache = PlanCache()
    alone = asks_for(paths[0])[4]
    first = plan_of(cache, alone).plan
    assert plan_of(cache, alone).plan is first and cache.cached_plans() == 1
    bulk_made = []
    real = plan_cache.create_dim0_plans
    monkeypatch.setattr(plan_cache, "create_dim0_plans", lambda *a, **k: bulk_made.append(a) or real(*a, **k))
    ranks = asks_for(paths[0])[:3]
    for _ in range(2):
        assert [plan_of(cache, a).plan for a in ranks] == [expected_plan(a) for a in ranks]
    assert len(bulk_made) == 1 and cache.cached_plans() == 2  # one all-ranks plan served every rank, twice


def test_forget_drops_a_checkpoints_manifest_and_plans(paths):
    read, reads = counting_reads()
    cache = PlanCache(read)
    keep, drop = asks_for(paths[0])[4], asks_for(paths[1])[4]
    kept_plan = plan_of(cache, keep).plan
    dropped_plan = plan_of(cache, drop).plan
    plan_of(cache, asks_for(paths[1])[0])  # and an all-ranks plan
    assert cache.cached_plans() == 3 and reads == paths[:2]
    cache.forget(paths[1])
    assert cache.cached_plans() == 1
    again = plan_of(cache, drop).plan
    assert again == dropped_plan and again is not dropped_plan and reads == paths[:2] + [paths[1]]
    assert plan_of(cache, keep).plan is kept_plan and len(reads) == 3


def test_manifests_beyond_the_limit_are_evicted_oldest_first(paths):
    read, reads = counting_reads()
    cache = PlanCache(read)
    for p in paths:
        assert plan_of(cache, asks_for(p)[3]).plan == expected_plan(asks_for(p)[3])
    assert reads == paths
    cache.manifest(paths[-1])  # still cached
    assert len(reads) == NUM_CHECKPOINTS
    cache.manifest(paths[0])  # evicted by the ninth: read again
    assert reads[-1] == paths[0] and len(reads) == NUM_CHECKPOINTS + 1
    evicted = NUM_CHECKPOINTS - MANIFESTS_CACHED
    cache.manifest(paths[evicted + 1])  # was still cached, but the re-read of paths[0] pushed out paths[evicted]
    assert len(reads) == NUM_CHECKPOINTS + 1


def test_a_failed_read_reaches_every_waiter_and_is_not_cached(paths):
    calls = []
    started = threading.Event()

    def read(location, filesystem):
        calls.append(location)
        if len(calls) == 1:
            started.set()
            time.sleep(0.3)  # the other threads ask meanwhile
            raise OSError("storage unreachable")
        return rayckpt.read_manifest(CheckpointDir.resolve(location, filesystem))

    cache = PlanCache(read)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(cache.manifest, paths[0])
        started.wait(5)
        waiters = [pool.submit(cache.manifest, paths[0]) for _ in range(3)]
        for f in [first, *waiters]:
            with pytest.raises(OSError, match="storage unreachable"):
                f.result()
    assert len(calls) == 1  # the waiters did not read again
    assert cache.manifest(paths[0]).save_id and len(calls) == 2


def test_every_rank_asking_for_one_load_at_once_plans_it_once(paths, monkeypatch):
    made = []
    real = plan_cache.create_dim0_plans

    def slow(*args, **kwargs):
        made.append(args)
        time.sleep(0.2)  # every rank arrives while the first plans
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_cache, "create_dim0_plans", slow)
    cache = PlanCache()
    ranks = asks_for(paths[5])[:3] * 4
    with ThreadPoolExecutor(len(ranks)) as pool:
        got = list(pool.map(lambda a: plan_of(cache, a).plan, ranks))
    assert got == [expected_plan(a) for a in ranks]
    assert len(made) == 1


def plan_concurrently(
    plan: Callable[[PlanAsk], LoadPlan], asks: list[PlanAsk], expected: list[LoadPlan], threads: int = 24
) -> None:
    """Ask every question twice, shuffled, from ``threads`` threads at once; compare with ``expected``."""
    work = [i for i in range(len(asks)) for _ in range(2)]
    random.Random(len(work)).shuffle(work)
    with ThreadPoolExecutor(threads) as pool:
        got = list(pool.map(lambda i: plan(asks[i]), work))
    for i, p in zip(work, got):
        assert p == expected[i], asks[i]


@pytest.mark.parametrize("pause", [0.0, 0.005], ids=["as-is", "descheduled-after-the-manifest"])
def test_many_checkpoints_planned_from_many_threads_at_once(asks, expected, pause, monkeypatch):
    """12 checkpoints (the cache holds 8) planned by 24 threads at once, four rounds: no error, right plans.

    ``pause``: every plan stalls between fetching its checkpoint and planning from it,
    as a thread descheduled there would, while other threads evict that checkpoint.
    """
    if pause:
        real = plan_cache.is_dim0_layout
        monkeypatch.setattr(plan_cache, "is_dim0_layout", lambda *a: time.sleep(pause) or real(*a))
    # Switch threads often, so that any unguarded read-modify-write of the cache interleaves.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(4):  # a fresh cache each round: every round misses, evicts and plans
            cache = PlanCache()
            plan_concurrently(lambda a, c=cache: plan_of(c, a).plan, asks, expected)
            assert cache.cached_plans() <= PLANS_CACHED + BULK_PLANS_CACHED
    finally:
        sys.setswitchinterval(interval)
