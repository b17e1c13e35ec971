"""The order ``Checkpointer.restore`` tries a run's checkpoints in (``train.restore``), without Ray:
newest step first, memory before storage of one step, Ray Train's latest tried even when storage lost it,
and corrupt manifests newer than anything loadable passed over with their reason."""

from __future__ import annotations

from rayckpt.storage.catalog import CatalogEntry
from rayckpt.train.restore import candidates, reason


def entry(step: int | None, status: str = "committed", root: str = "/ck/run", created: float = 0.0, error=None):
    name = "odd" if step is None else f"rayckpt-step-{step:08d}"
    return CatalogEntry(
        run="run",
        step=step,
        path=f"{root}/{name}",
        status=status,
        created=created or float(step or 0),
        world_size=2,
        bytes=10,
        save_id="s",
        error=error,
    )


def test_the_newest_committed_step_comes_first_and_unfinished_saves_are_never_tried():
    entries = [entry(2), entry(5, "failed"), entry(4), entry(6, "pending"), entry(7, "incomplete"), entry(None)]
    tried, passed_over = candidates(entries, [], None)
    assert [(step, tier) for _, step, tier in tried] == [(4, "storage"), (2, "storage"), (None, "storage")]
    assert passed_over == []


def test_of_one_step_memory_comes_before_storage_and_a_newer_step_before_both():
    storage = [entry(3), entry(4)]
    # made before the storage one of its step (its creation time, then its path, would put it second)
    held = [entry(4, root="mem:/run", created=0.5), entry(5, root="mem:/run"), entry(6, "pending", root="mem:/run")]
    tried, _ = candidates(storage, held, None)
    assert [(step, tier) for _, step, tier in tried] == [(5, "memory"), (4, "memory"), (4, "storage"), (3, "storage")]
    assert tried[1][0] == "mem:/run/rayckpt-step-00000004"


def test_a_commit_ray_train_has_not_registered_comes_before_ray_train_s_latest():
    tried, _ = candidates([entry(3), entry(4)], [], "/ck/run/rayckpt-step-00000003")
    assert [step for _, step, _ in tried] == [4, 3]


def test_ray_train_s_latest_is_tried_in_its_place_when_storage_no_longer_lists_it():
    gone = "/ck/run/rayckpt-step-00000005"
    tried, _ = candidates([entry(3), entry(6, "failed")], [], gone + "/")
    assert tried == [(gone + "/", 5, "storage"), ("/ck/run/rayckpt-step-00000003", 3, "storage")]
    # listed, in whatever state (here failed): not tried again in its place
    tried, _ = candidates([entry(3), entry(6, "failed")], [], "/ck/run/rayckpt-step-00000006")
    assert [step for _, step, _ in tried] == [3]


def test_corrupt_manifests_newer_than_the_newest_loadable_are_passed_over_with_their_reason():
    entries = [entry(2, "corrupt"), entry(3), entry(5, "corrupt", error="manifest.json: bad JSON"), entry(6, "corrupt")]
    held = [entry(7, "corrupt", root="mem:/run", error="memory manifest unreadable")]
    tried, passed_over = candidates(entries, held, None)
    assert [step for _, step, _ in tried] == [3]
    assert passed_over == [
        ("mem:/run/rayckpt-step-00000007", 7, "memory manifest unreadable"),
        ("/ck/run/rayckpt-step-00000006", 6, "its manifest is corrupt"),
        ("/ck/run/rayckpt-step-00000005", 5, "manifest.json: bad JSON"),
    ]  # newest first; step 2, older than step 3, is not mentioned


def test_with_nothing_committed_every_corrupt_one_is_passed_over():
    tried, passed_over = candidates([entry(1, "corrupt"), entry(2, "failed")], [], None)
    assert tried == [] and [step for _, step, _ in passed_over] == [1]


def test_a_reason_is_one_line_and_never_empty():
    assert reason(RuntimeError("rank 0: checksum mismatch\n  rank 1: checksum mismatch\n")) == (
        "rank 0: checksum mismatch rank 1: checksum mismatch"
    )
    assert reason(KeyError()) == "KeyError"
