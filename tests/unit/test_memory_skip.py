"""``Checkpointer.save`` to the memory tier never waits for the save before it: memory saves have their own
lane (a storage save being written does not hold them up), and while the memory save before is not yet
written on some rank, every rank skips the new one (one collective decides it for all)."""

from __future__ import annotations

from types import SimpleNamespace

from rayckpt.train import checkpointer
from rayckpt.train.tiers import MEMORY, STORAGE, TierPolicy


class Ranks:
    """A coordinator whose other ranks answer ``others`` (their last save unwritten?) to every all_gather."""

    def __init__(self, others: list) -> None:
        self.others = others
        self.gathered: list = []

    def all_gather(self, mine):
        self.gathered.append(mine)
        return [mine, *self.others]


def bare_checkpointer(monkeypatch, last: dict, others: list, fits: bool = True):
    """A Checkpointer (memory every step, storage every 5th) whose saves only record which tier began."""
    ckpt = object.__new__(checkpointer.Checkpointer)  # no Ray Train context: only save()'s decision is used
    ckpt.policy = TierPolicy(memory_every=1, persist_every=5)
    ckpt.memory_skipped, ckpt.memory_skip_busy = 0, True
    ckpt._last = {tier: (SimpleNamespace(done=lambda done=done: done), 0.0) for tier, done in last.items()}
    began: list = []
    monkeypatch.setattr(
        checkpointer.Checkpointer,
        "_save_to_memory",
        lambda self, *a: began.append(MEMORY) or ("memory handle" if fits else None),
    )
    monkeypatch.setattr(
        checkpointer.Checkpointer, "_save_to_storage", lambda self, *a: began.append(STORAGE) or "storage handle"
    )
    ranks = Ranks(others)
    monkeypatch.setattr(checkpointer, "default_coordinator", lambda: ranks)
    return ckpt, ranks, began


def test_a_memory_save_is_skipped_on_every_rank_while_one_rank_s_last_memory_save_is_unwritten(monkeypatch):
    for mine_done, others, skipped in ((True, [False], False), (True, [True], True), (False, [False], True)):
        ckpt, ranks, began = bare_checkpointer(monkeypatch, {MEMORY: mine_done}, others)
        result = ckpt.save(3, {}, {"loss": 1.0})
        assert ranks.gathered == [not mine_done]  # each rank says whether its own last memory save is unwritten
        assert (ckpt.memory_skipped, began, result) == ((1, [], None) if skipped else (0, [MEMORY], "memory handle"))


def test_a_storage_save_being_written_does_not_hold_up_a_memory_save(monkeypatch):
    ckpt, ranks, began = bare_checkpointer(monkeypatch, {STORAGE: False, MEMORY: True}, [False])
    assert ckpt.save(3, {}, {"loss": 1.0}) == "memory handle"
    assert began == [MEMORY] and ranks.gathered == [False] and ckpt.memory_skipped == 0


def test_a_step_due_for_both_tiers_goes_to_memory_first_then_storage(monkeypatch):
    ckpt, _, began = bare_checkpointer(monkeypatch, {}, [False])
    assert ckpt.save(5, {}, {"loss": 1.0}) == "storage handle"
    assert began == [MEMORY, STORAGE]
    ckpt, _, began = bare_checkpointer(monkeypatch, {MEMORY: False}, [False])  # memory busy: storage still saves
    assert ckpt.save(10, {}, {"loss": 1.0}) == "storage handle"
    assert began == [STORAGE] and ckpt.memory_skipped == 1


def test_a_memory_save_no_budget_holds_goes_to_storage(monkeypatch):
    ckpt, _, began = bare_checkpointer(monkeypatch, {}, [False], fits=False)
    assert ckpt.save(3, {}, {"loss": 1.0}) == "storage handle"
    assert began == [MEMORY, STORAGE]


def test_with_memory_skip_busy_off_a_memory_save_is_never_skipped(monkeypatch):
    ckpt, ranks, began = bare_checkpointer(monkeypatch, {MEMORY: False}, [True])
    ckpt.memory_skip_busy = False
    assert ckpt.save(3, {}, {"loss": 1.0}) == "memory handle"  # _save_to_memory waits for the one before
    assert began == [MEMORY] and ranks.gathered == [] and ckpt.memory_skipped == 0
