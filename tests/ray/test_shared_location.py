"""Two runs whose async saves point at one storage location: never a mix, never a silent loss.

Each run's rank is its own Ray task (a fresh worker process); the MetadataActor
commits both runs' saves. A run whose rank 0 claimed the location holds it until
its save settles; the other run's save is refused, naming it.
"""

from __future__ import annotations

import pytest
import ray

from tests.helpers.concurrent_workers import assert_one_whole_checkpoint, assert_refused_naming, go, ready, state_of

pytestmark = pytest.mark.slow


@ray.remote(max_calls=1)
def run_save(path: str, value: int, run: str, sync_dir: str, name: str, pause: bool) -> dict:
    """A one-rank run's ``save_async`` + ``wait``; with ``pause``, rank 0 stops once it claimed the location."""
    from rayckpt.ray.rank import async_save
    from tests.helpers import concurrent_workers as workers

    if pause:
        real = async_save._check_reachable

        def check_reachable(ckdir, ctx, local_is_shared):
            workers._pause(sync_dir, name, ctx.spec.save_id)
            return real(ckdir, ctx, local_is_shared)

        async_save._check_reachable = check_reachable  # this worker runs one task (max_calls=1)
    try:
        handle = async_save.save_async(state_of(value), path, run=run, step=value)
        return {"ok": True, "save_id": handle.save_id, "status": handle.wait(timeout=120).status}
    except Exception as exc:  # noqa: BLE001 - the test judges every outcome
        return {"ok": False, "type": type(exc).__name__, "error": str(exc)}


def test_a_run_saving_to_a_location_another_run_is_saving_to_is_refused_naming_it(ray_session, tmp_path):
    path, sync = str(tmp_path / "shared"), str(tmp_path)
    a = run_save.remote(path, 1, "run-a", sync, "a", True)
    a_id = ready(sync, "a")  # run a's rank 0 claimed the location; nothing is staged yet
    b = ray.get(run_save.remote(path, 2, "run-b", sync, "b", False), timeout=120)
    assert_refused_naming(b, path, a_id)
    go(sync, "a")
    assert ray.get(a, timeout=120) == {"ok": True, "save_id": a_id, "status": "committed"}
    assert assert_one_whole_checkpoint(path, (1,)) == 1  # the MetadataActor released a's lease


def test_two_runs_saving_to_one_location_at_once_never_mix(ray_session, tmp_path):
    for round_ in range(2):
        path, sync = str(tmp_path / f"shared{round_}"), str(tmp_path)
        refs = {n: run_save.remote(path, v, f"run-{n}", sync, n, False) for n, v in (("a", 1), ("b", 2))}
        outcomes = {n: ray.get(r, timeout=120) for n, r in refs.items()}
        ok = {n: o["save_id"] for n, o in outcomes.items() if o["ok"]}
        assert ok, outcomes
        for o in outcomes.values():
            if o["ok"]:
                assert o["status"] == "committed"
            else:
                (winner,) = ok.values()
                assert_refused_naming(o, path, winner)
        assert_one_whole_checkpoint(path, (1, 2))
