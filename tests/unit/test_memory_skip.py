"""``Checkpointer.save`` to the memory tier never waits for the save before it: memory saves have their own
lane (a storage save being written does not hold them up), and while the memory save before is not yet
written on some rank, every rank skips the new one. One collective per memory save decides that and the
budget for every rank at once (``MemoryTier.decide``)."""

from __future__ import annotations

from types import SimpleNamespace

from rayckpt.train import checkpointer, tiers
from rayckpt.train.tiers import MEMORY, STORAGE, MemoryTier, TierPolicy

ROOM = 10**9


class Ranks:
    """A coordinator whose other ranks answer ``others`` to every all_gather: (busy, fits, room, need, node)."""

    def __init__(self, others: list) -> None:
        self.others = others
        self.gathered: list = []

    def all_gather(self, mine):
        self.gathered.append(mine)
        return [mine, *self.others]


BUDGET = "of its memory budget left"


def other(busy: bool = False, room: int = ROOM, need: int = 0, node: str = "node-b", bound: str = BUDGET) -> tuple:
    return (busy, room >= need, room, need, node, bound)


def bare_checkpointer(monkeypatch, last: dict, others: list):
    """A Checkpointer (memory every step, storage every 5th) whose saves only record which tier began."""
    ckpt = object.__new__(checkpointer.Checkpointer)  # no Ray Train context: only save()'s decision is used
    ckpt.policy = TierPolicy(memory_every=1, persist_every=5)
    ckpt.memory_skipped, ckpt.memory_skip_busy, ckpt._local_ranks, ckpt.rank, ckpt.run = 0, True, 1, 0, "r"
    ckpt.data = None
    ckpt._last = {tier: (SimpleNamespace(done=lambda done=done: done), 0.0) for tier, done in last.items()}
    rooms: list = []
    ckpt.memory = object.__new__(MemoryTier)  # no Ray: its decision, its warnings, and a node with room
    ckpt.memory.short, here = "", (ROOM, BUDGET, "a")
    ckpt.memory.room_here = lambda rank: rooms.append(rank) or here
    began: list = []
    monkeypatch.setattr(checkpointer.Checkpointer, "_save_to_memory", lambda self, *a: began.append(MEMORY) or "m")
    monkeypatch.setattr(checkpointer.Checkpointer, "_save_to_storage", lambda self, *a: began.append(STORAGE) or "s")
    ranks = Ranks(others)
    monkeypatch.setattr(tiers, "default_coordinator", lambda: ranks)
    return ckpt, ranks, began


def test_a_memory_save_is_skipped_on_every_rank_while_one_rank_s_last_memory_save_is_unwritten(monkeypatch):
    for mine_done, other_busy, skipped in ((True, False, False), (True, True, True), (False, False, True)):
        ckpt, ranks, began = bare_checkpointer(monkeypatch, {MEMORY: mine_done}, [other(busy=other_busy)])
        result = ckpt.save(3, {}, {"loss": 1.0})
        assert [g[0] for g in ranks.gathered] == [not mine_done]  # one collective: each rank's own last save
        assert (ckpt.memory_skipped, began, result) == ((1, [], None) if skipped else (0, [MEMORY], "m"))


def test_a_storage_save_being_written_does_not_hold_up_a_memory_save(monkeypatch):
    ckpt, ranks, began = bare_checkpointer(monkeypatch, {STORAGE: False, MEMORY: True}, [other()])
    assert ckpt.save(3, {}, {"loss": 1.0}) == "m"
    assert began == [MEMORY] and [g[0] for g in ranks.gathered] == [False] and ckpt.memory_skipped == 0


def test_a_step_due_for_both_tiers_goes_to_memory_first_then_storage(monkeypatch):
    ckpt, _, began = bare_checkpointer(monkeypatch, {}, [other()])
    assert ckpt.save(5, {}, {"loss": 1.0}) == "s"
    assert began == [MEMORY, STORAGE]
    ckpt, _, began = bare_checkpointer(monkeypatch, {MEMORY: False}, [other()])  # memory busy: storage still saves
    assert ckpt.save(10, {}, {"loss": 1.0}) == "s"
    assert began == [STORAGE] and ckpt.memory_skipped == 1


def test_a_memory_save_no_budget_holds_goes_to_storage_with_the_short_node_named(monkeypatch, caplog):
    ckpt, ranks, began = bare_checkpointer(monkeypatch, {}, [other(room=5, need=8, node="node-b")])
    with caplog.at_level("WARNING", logger="rayckpt.train.tiers"):
        assert ckpt.save(3, {}, {"loss": 1.0}) == "s"
    assert began == [STORAGE] and len(ranks.gathered) == 1
    assert "step 3 goes to storage, not memory: node node-b has 5 bytes of its memory budget left and needs 8" in (
        caplog.text
    )


def test_the_one_collective_carries_each_rank_s_room_and_need_and_a_rank_short_of_it_is_named():
    ranks = Ranks([other(), other(room=3, need=4, node="node-c")])
    assert MemoryTier.decide(False, (100, BUDGET), 50, "node-a", ranks) == (
        False,
        "node node-c has 3 bytes of its memory budget left and needs 4",
        f"node-c {BUDGET}",
    )
    assert ranks.gathered == [(False, True, 100, 50, "node-a", BUDGET)]
    assert MemoryTier.decide(False, (100, BUDGET), 50, "node-a", Ranks([other()])) == (False, "", "")
    # A busy rank skips the save for all, whatever the room: nothing is measured against a save not made.
    assert MemoryTier.decide(False, (1, BUDGET), 50, "node-a", Ranks([other(busy=True)])) == (True, "", "")


def test_a_node_short_of_room_is_warned_about_once_while_it_lasts_and_again_after_it_had_room(monkeypatch, caplog):
    full = "free in /dev/shm (its free space less Ray's object store)"
    short = [other(room=5, need=8, node="node-b", bound=full)]
    ckpt, ranks, began = bare_checkpointer(monkeypatch, {}, short)
    with caplog.at_level("INFO", logger="rayckpt.train.tiers"):
        for step, others in ((1, short), (2, short), (3, [other(room=6, need=8, node="node-b", bound=full)])):
            ranks.others = others
            assert ckpt.save(step, {}, {"loss": 1.0}) == "s"
        assert ckpt.memory.short == f"node-b {full}"
        ranks.others = [other()]
        assert ckpt.save(4, {}, {"loss": 1.0}) == "m" and ckpt.memory.short == ""
        ranks.others = short
        assert ckpt.save(6, {}, {"loss": 1.0}) == "s"
    assert began == [STORAGE, STORAGE, STORAGE, MEMORY, STORAGE]
    warned = [(r.levelname, r.getMessage()) for r in caplog.records]
    said = f"goes to storage, not memory: node node-b has 5 bytes {full} and needs 8"
    assert [w[1] for w in warned if w[0] == "WARNING"] == [
        f"rayckpt: run r: step {s} {said} (so do the memory saves after it until it has room; said once)"
        for s in (1, 6)
    ], warned
    assert ("INFO", "rayckpt: run r: step 4 goes to memory again: every node has room") in warned


def test_with_memory_skip_busy_off_a_memory_save_waits_for_the_one_before_and_is_never_skipped(monkeypatch):
    ckpt, ranks, began = bare_checkpointer(monkeypatch, {MEMORY: False}, [other()])
    ckpt.memory_skip_busy = False
    waited: list = []

    def wait(self, tier):
        waited.append(tier)
        self._last[MEMORY] = (SimpleNamespace(done=lambda: True), 0.0)  # the save before, now committed

    monkeypatch.setattr(checkpointer.Checkpointer, "_wait", wait)
    assert ckpt.save(3, {}, {"loss": 1.0}) == "m"
    assert waited == [MEMORY] and began == [MEMORY] and ckpt.memory_skipped == 0
    assert [g[0] for g in ranks.gathered] == [False]


def test_a_save_flattens_the_state_once_for_both_tiers(monkeypatch):
    ckpt, _, began = bare_checkpointer(monkeypatch, {}, [other()])
    calls: list = []

    class Counted:
        def state_dict(self):
            calls.append(1)
            return {"x": 1}

        def load_state_dict(self, sd):
            pass

    seen: list = []
    monkeypatch.setattr(checkpointer.Checkpointer, "_save_to_memory", lambda self, s, st, *a: seen.append(st) or "m")
    monkeypatch.setattr(checkpointer.Checkpointer, "_save_to_storage", lambda self, s, st, *a: seen.append(st) or "s")
    assert ckpt.save(5, {"app": Counted()}, {"loss": 1.0}) == "s"
    assert calls == [1] and len(seen) == 2 and seen[0] is seen[1]  # one FlatState, passed to both saves
    assert checkpointer.flatten(seen[0]) is seen[0]


class Counted:
    """A Stateful object whose ``state_dict()`` calls are counted (what a flatten calls)."""

    def __init__(self) -> None:
        self.calls = 0

    def state_dict(self) -> dict:
        import torch

        self.calls += 1
        return {"w": torch.ones(4)}

    def load_state_dict(self, sd: dict) -> None:
        pass


def test_one_checkpointer_save_flattens_its_state_once(monkeypatch):
    """Following ``state`` from ``Checkpointer.save`` to the save's first step (``collect_state``, where the
    planning flattens what is not flat yet): one flatten per save, whether the step goes to memory and
    storage (the Checkpointer flattens it, for both) or to storage alone (the save's first step does)."""
    import sys

    from rayckpt.engine import state as state_module
    from rayckpt.engine.coordinator import LocalCoordinator
    from rayckpt.engine.save import SaveOptions, collect_state
    from rayckpt.engine.save_layout import PlanCache
    from rayckpt.ray.rank.options import RayOptions

    real = state_module.flatten
    flattens: list[int] = []

    def counting(state_dict):
        flattens.append(1)
        return real(state_dict)

    for name, module in list(sys.modules.items()):  # the one flatten function, wherever it is bound
        if name.startswith("rayckpt") and getattr(module, "flatten", None) is real:
            monkeypatch.setattr(module, "flatten", counting)
    started: list[str] = []

    def start_save(state, dest, options, on_ray):  # the save's first step in this process; no Ray
        collect_state(LocalCoordinator(), state, options, plans=PlanCache())
        started.append(on_ray.lane)
        return SimpleNamespace(done=lambda: False)

    monkeypatch.setattr(checkpointer, "start_save", start_save)
    ckpt, _, _ = bare_checkpointer(monkeypatch, {}, [other()])
    # bare_checkpointer stubs the saves: these run
    monkeypatch.setattr(checkpointer.Checkpointer, "_save_to_memory", REAL_SAVES[MEMORY])
    monkeypatch.setattr(checkpointer.Checkpointer, "_save_to_storage", REAL_SAVES[STORAGE])
    ckpt.settings = tiers.SaveSettings(write=SaveOptions(), on_ray=RayOptions(), report=False)
    ckpt.run_root, ckpt.filesystem = "/nowhere/run", None
    ckpt.memory.root, ckpt.memory.run, ckpt.memory.filesystem = "mem/r", "r@memory", None
    app = Counted()
    for step, lanes in ((5, ["memory", "default"]), (3, ["memory"]), (4, ["memory"])):
        flattens.clear()
        started.clear()
        app.calls = 0
        ckpt._last = {}
        ckpt.save(step, {"app": app, "step": step}, {"loss": 1.0})
        assert started == lanes
        assert (len(flattens), app.calls) == (1, 1), step
    ckpt.policy = TierPolicy(memory_every=0, persist_every=1)  # storage alone
    flattens.clear()
    app.calls = 0
    ckpt.save(6, {"app": app}, {"loss": 1.0})
    assert (len(flattens), app.calls) == (1, 1)


REAL_SAVES = {MEMORY: checkpointer.Checkpointer._save_to_memory, STORAGE: checkpointer.Checkpointer._save_to_storage}
