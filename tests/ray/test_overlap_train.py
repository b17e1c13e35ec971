"""Saves beside training under TorchTrainer on a real local Ray: FSDP2 and AdamW in an ``AppState``, saved at
every step with the default overlap, their optimizer's tensors copied while the next step's forward and
backward run (held there by ``copy_gate.CopyGate``), restored bit-exact with another worker count."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.overlap_workers import overlap_train_loop
from tests.helpers.ray_train import fit, memory_steps

pytestmark = pytest.mark.slow


def saves_of(out, world: int) -> list[dict]:
    """What each rank's saves did (``saves-<world>-<rank>.json``), by rank."""
    return [json.loads((out / f"saves-{world}-{rank}.json").read_text()) for rank in range(world)]


def check_overlapped(ranks: list[dict], steps: list[int]) -> None:
    """Every rank saved ``steps``, each with bytes copied after the save returned, and the optimizer step
    after each save (all but the last) left its copy done: the step waited for it."""
    for rank, summary in enumerate(ranks):
        saves = summary["saves"]
        assert [s["step"] for s in saves] == steps, rank
        for save in saves:
            assert save["staging"] == "shm" and save["late_bytes"] > 0, (rank, save)
        assert all(s["copied_after_step"] for s in saves[:-1]), (rank, saves)
        assert summary["last"] == {"step": steps[-1], "status": "committed"}, rank


def check_equal(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), f"{what}: {key} differs"


def test_fsdp2_saved_every_step_beside_training_restores_bit_exact_4_to_3(ray_session, tmp_path):
    storage, first, second = tmp_path / "storage", tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    steps = [1, 2, 3]
    fit(storage, first, 4, 3, steps, name="overlap", loop=overlap_train_loop, num_to_keep=None)
    check_overlapped(saves_of(first, 4), steps)
    saved = {step: torch.load(first / f"state-{step}.pt", weights_only=False) for step in steps}
    assert not torch.equal(saved[2]["state"]["app.model.head.weight"], saved[3]["state"]["app.model.head.weight"])

    # 3 workers load each checkpoint into a fresh model, restore the last, then train and save one step more
    fit(storage, second, 3, 4, [4], name="overlap", loop=overlap_train_loop, num_to_keep=None, check_steps=steps)
    for step in steps:
        loaded = torch.load(second / f"loaded-3-{step}.pt", weights_only=False)
        assert loaded["step"] == step
        check_equal(loaded["state"], saved[step]["state"], f"step {step} loaded by 3 workers")
    restored = torch.load(second / "restored-3.pt", weights_only=False)
    assert restored["step"] == 3 and restored["restored_from"]["tier"] == "storage"
    check_equal(restored["state"], saved[3]["state"], "step 3 restored by 3 workers")
    check_overlapped(saves_of(second, 3), [4])


def test_memory_tier_every_step_beside_training_commits_and_restores_bit_exact(ray_session, tmp_path):
    storage, first, second = tmp_path / "storage", tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    # steps 1-4 saved to memory (the newest 2 kept), step 3 to storage as well
    fit(
        storage, first, 2, 4, [1, 2, 3, 4], name="overlap-mem", loop=overlap_train_loop, memory_every=1, persist_every=3
    )
    ranks = saves_of(first, 2)
    check_overlapped(ranks, [1, 2, 3, 4])  # step 3's handle is its storage save's
    assert [r["memory_skipped"] for r in ranks] == [0, 0]
    assert memory_steps("overlap-mem") == [3, 4]
    assert sorted(p.name for p in (storage / "overlap-mem").glob("rayckpt-step-*")) == ["rayckpt-step-00000003"]

    # a new group restores step 4 from memory, then saves step 5 there beside training too
    fit(storage, second, 2, 5, [5], name="overlap-mem", loop=overlap_train_loop, memory_every=1, persist_every=3)
    restored = torch.load(second / "restored-2.pt", weights_only=False)
    assert restored["step"] == 4 and restored["restored_from"]["tier"] == "memory"
    check_equal(restored["state"], torch.load(first / "state-4.pt", weights_only=False)["state"], "step 4 restored")
    check_overlapped(saves_of(second, 2), [5])
    assert memory_steps("overlap-mem") == [4, 5]
