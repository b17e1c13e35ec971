"""``Checkpointer.save`` to the memory tier never waits for the save before it: while that save is not yet
written on some rank, every rank skips the memory save (one collective decides it for all)."""

from __future__ import annotations

from types import SimpleNamespace

from rayckpt.train import checkpointer
from rayckpt.train.tiers import TierPolicy


class Ranks:
    """A coordinator whose other ranks answer ``others`` (their last save unwritten?) to every all_gather."""

    def __init__(self, others: list) -> None:
        self.others = others
        self.gathered: list = []

    def all_gather(self, mine):
        self.gathered.append(mine)
        return [mine, *self.others]


def bare_checkpointer(previous_done: bool) -> checkpointer.Checkpointer:
    ckpt = object.__new__(checkpointer.Checkpointer)  # no Ray Train context: only save()'s decision is used
    ckpt.policy = TierPolicy(memory_every=1, persist_every=5)
    ckpt.memory_skipped, ckpt.memory_skip_busy = 0, True
    ckpt._last = (SimpleNamespace(done=lambda: previous_done), 0.0)
    ckpt.run, ckpt.run_root, ckpt.filesystem, ckpt.block_size = "r", "/ckpts/r", None, None
    ckpt.commit_timeout_s, ckpt.local_is_shared, ckpt.staging = 60.0, None, None
    return ckpt


def test_a_memory_save_is_skipped_on_every_rank_while_one_rank_s_last_save_is_unwritten(monkeypatch):
    started = []
    monkeypatch.setattr(checkpointer.Checkpointer, "wait", lambda self: started.append("wait"))
    monkeypatch.setattr(
        checkpointer.Checkpointer, "_save_to_memory", lambda self, *a: started.append("memory") or "handle"
    )
    for mine_done, others, skipped in ((True, [False], False), (True, [True], True), (False, [False], True)):
        ckpt, ranks = bare_checkpointer(mine_done), Ranks(others)
        monkeypatch.setattr(checkpointer, "default_coordinator", lambda ranks=ranks: ranks)
        started.clear()
        ckpt.save(3, {}, {"loss": 1.0})
        assert ranks.gathered == [not mine_done]  # each rank says whether its own last save is unwritten
        assert (ckpt.memory_skipped, started) == ((1, []) if skipped else (0, ["wait", "memory"]))


def test_a_storage_save_still_waits_for_the_one_before(monkeypatch):
    waited = []
    monkeypatch.setattr(checkpointer.Checkpointer, "wait", lambda self: waited.append(True))
    monkeypatch.setattr(checkpointer, "default_coordinator", lambda: Ranks([False]))

    def no_save(*args, **kwargs):
        raise RuntimeError("stop here: the decision is what is tested")

    monkeypatch.setattr(checkpointer, "save_async", no_save)
    ckpt = bare_checkpointer(previous_done=False)
    try:
        ckpt.save(5, {}, {"loss": 1.0})  # step 5: storage
    except RuntimeError:
        pass
    assert waited == [True] and ckpt.memory_skipped == 0


def test_with_memory_skip_busy_off_a_memory_save_waits_for_the_one_before(monkeypatch):
    started = []
    monkeypatch.setattr(checkpointer.Checkpointer, "wait", lambda self: started.append("wait"))
    monkeypatch.setattr(
        checkpointer.Checkpointer, "_save_to_memory", lambda self, *a: started.append("memory") or "handle"
    )
    ranks = Ranks([True])
    monkeypatch.setattr(checkpointer, "default_coordinator", lambda: ranks)
    ckpt = bare_checkpointer(previous_done=False)
    ckpt.memory_skip_busy = False
    assert ckpt.save(3, {}, {"loss": 1.0}) == "handle"
    assert started == ["wait", "memory"] and ranks.gathered == [] and ckpt.memory_skipped == 0
