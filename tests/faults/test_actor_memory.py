"""The MetadataActor's records and memory stay flat over many saves (200 saves through the real actor)."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from rayckpt.ray.metadata.actor import get_metadata_actor
from rayckpt.ray.metadata.plan_cache import MANIFESTS_CACHED
from rayckpt.ray.metadata.save_history import SETTLED_KEPT_PER_RUN
from rayckpt.ray.metadata.save_log import SAVES_KEPT
from rayckpt.ray.metadata.views import EVENTS_KEPT
from rayckpt.ray.rank import async_save
from rayckpt.ray.rank.loading import load as ray_load

pytestmark = pytest.mark.slow

SAVES = 200
#: Generous: the records are bounded exactly; this only catches a leak of megabytes per save.
RSS_GROWTH_LIMIT = 50 * 2**20


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(3, generator=g), "step": seed}


def test_two_hundred_saves_keep_the_actors_records_and_memory_flat(ray_session, tmp_path):
    import psutil  # Ray's own copy: importable once ray is

    ray.kill(get_metadata_actor(), no_restart=False)  # a fresh incarnation: only this test's records
    meta = get_metadata_actor()
    for _ in range(60):  # the handle may still name the dying incarnation for a moment
        try:
            actor = psutil.Process(ray.get(meta.debug_stats.remote())["pid"])
            break
        except ray.exceptions.ActorUnavailableError:
            time.sleep(0.5)
    else:
        raise AssertionError("the MetadataActor did not come back within 30 s of ray.kill")
    rss: dict[int, int] = {}
    for i in range(1, SAVES + 1):
        path = str(tmp_path / f"rayckpt-step-{i:08d}")
        assert async_save.save_async(state(i), path, run="many", step=i).wait().status == "committed"
        if i % 10 == 0:  # loads fill the plan cache too
            out = {"w": torch.zeros(64, 32), "b": torch.zeros(3), "step": 0}
            ray_load(out, path, run="many")
            assert torch.equal(out["w"], state(i)["w"]) and out["step"] == i
        if i in (50, SAVES):
            rss[i] = actor.memory_info().rss
    stats = ray.get(meta.debug_stats.remote())
    assert stats["pid"] == actor.pid
    held = {k: stats[k] for k in ("in_flight", "unregistered", "settled", "runs", "waited_saves")}
    assert held == {"in_flight": 0, "unregistered": 0, "settled": SETTLED_KEPT_PER_RUN, "runs": 1, "waited_saves": 0}
    assert (stats["event_runs"], stats["events"]) == (1, EVENTS_KEPT)
    assert stats["logged_saves"] == SAVES_KEPT  # the timeline's log: a few numbers per save, the newest kept
    assert stats["cached_manifests"] == MANIFESTS_CACHED
    assert len(ray.get(meta.checkpoints.remote("many"))) == SETTLED_KEPT_PER_RUN
    assert rss[SAVES] - rss[50] < RSS_GROWTH_LIMIT, f"actor RSS grew {(rss[SAVES] - rss[50]) / 2**20:.1f} MiB"
