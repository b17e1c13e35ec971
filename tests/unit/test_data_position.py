"""The data position: samplers of any worker count, combined into one global position and split again."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
from torch.utils.data import DataLoader, DistributedSampler

from rayckpt.data import DataPosition, RankShare, ResumableSampler, combine, permutation, resume, share_of
from rayckpt.errors import DataPositionError


class Job:
    """``world`` ranks, each a sampler and an open pass over its share; what each consumed, per epoch."""

    def __init__(self, length: int, world: int, saved: DataPosition | None = None, **kw) -> None:
        self.samplers = [ResumableSampler(length, num_replicas=world, rank=r, **kw) for r in range(world)]
        for s in self.samplers:
            if saved is not None:
                s.resume(saved, "ckpt")
        self.passes = [iter(s) for s in self.samplers]
        self.consumed: dict[int, list[int]] = {}
        #: Each rank's (epoch, index) in the order it took them.
        self.by_rank: list[list[tuple[int, int]]] = [[] for _ in range(world)]

    def take(self, per_rank: list[int]) -> None:
        """Rank r takes ``per_rank[r]`` samples; a rank whose share is through starts the next epoch, like a loop."""
        for r, n in enumerate(per_rank):
            for _ in range(n):
                s = self.samplers[r]
                try:
                    i = next(self.passes[r])
                except StopIteration:
                    s.set_epoch(s.epoch + 1)
                    self.passes[r] = iter(s)
                    i = next(self.passes[r])
                self.consumed.setdefault(s.epoch, []).append(i)
                self.by_rank[r].append((s.epoch, i))

    def position(self) -> DataPosition:
        return combine([s.share() for s in self.samplers])


def run_sequence(length, plan, **kw):
    """``plan``: (world, [per-rank takes per step], ...) legs, a checkpoint and a resume between legs."""
    saved = None
    per_epoch: dict[int, list[int]] = {}
    for world, steps in plan:
        job = Job(length, world, saved, **kw)
        for per_rank in steps:
            job.take(per_rank)
        saved = job.position()
        for epoch, ids in job.consumed.items():
            per_epoch.setdefault(epoch, []).extend(ids)
    return per_epoch, saved


def test_4_3_2_4_shuffled_across_an_epoch_consumes_every_sample_once_per_epoch():
    length = 60  # 12 per global step: epoch 0 is 5 steps
    plan = [(4, [[3] * 4] * 2), (3, [[4] * 3] * 2), (2, [[6] * 2] * 3), (4, [[3] * 4] * 4)]
    per_epoch, saved = run_sequence(length, plan, seed=7)
    # 11 steps of 12: epochs 0 and 1 through, exactly once each, and 12 samples into epoch 2
    assert sorted(per_epoch[0]) == list(range(length)) and sorted(per_epoch[1]) == list(range(length))
    assert saved.epoch == 2 and saved.consumed == 12 and saved.extras == () and saved.world_size == 4
    # what epoch 2 consumed is the first 12 offsets of its permutation
    assert sorted(per_epoch[2]) == sorted(permutation(saved)[:12].tolist())


def test_uneven_ranks_leave_extras_that_the_next_world_skips():
    length = 50
    # ranks out of step (a rank a batch ahead, a short one): the extras carry what each took beyond the others
    plan = [(4, [[3, 5, 2, 3]]), (3, [[1, 4, 2], [2, 0, 3]]), (2, [[9, 7]]), (5, [[30, 30, 30, 30, 30]])]
    per_epoch, _ = run_sequence(length, plan, seed=1)
    counts = Counter(per_epoch[0])
    assert sorted(counts) == list(range(length)) and set(counts.values()) == {1}
    assert len(per_epoch[1]) == len(set(per_epoch[1]))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_tails_that_do_not_split_evenly(shuffle, drop_last):
    length = 23
    plan = [(4, [[2] * 4]), (3, [[2] * 3]), (2, [[1, 1]] * 20)]
    per_epoch, _ = run_sequence(length, plan, shuffle=shuffle, drop_last=drop_last)
    counts = Counter(per_epoch[0])
    assert set(counts.values()) == {1}
    if drop_last:  # only the last world's uneven tail is left out: fewer than 2 samples
        assert length - 2 < len(counts) <= length
    else:
        assert sorted(counts) == list(range(length))


def test_the_order_without_a_resume_is_distributed_sampler_s():
    for shuffle in (False, True):
        for r in range(3):
            ours = list(ResumableSampler(list(range(30)), num_replicas=3, rank=r, shuffle=shuffle, seed=5))
            theirs = list(DistributedSampler(list(range(30)), num_replicas=3, rank=r, shuffle=shuffle, seed=5))
            assert ours == theirs


def test_a_resume_with_the_same_worker_count_continues_the_same_order():
    length, world = 40, 4
    straight = Job(length, world, seed=3)
    straight.take([13] * world)  # across epoch 0's end (10 each)
    first = Job(length, world, seed=3)
    first.take([4] * world)
    second = Job(length, world, first.position(), seed=3)
    second.take([9] * world)
    for r in range(world):
        assert first.by_rank[r] + second.by_rank[r] == straight.by_rank[r]


def test_a_through_epoch_resumes_at_the_next_one():
    job = Job(12, 3, seed=0)
    job.take([4, 4, 4])
    saved = job.position()
    assert saved.complete and saved.epoch == 0
    s = ResumableSampler(12, num_replicas=2, rank=0, seed=0)
    s.resume(saved, "ckpt")
    assert s.epoch == 1 and len(s) == 6


def test_a_position_of_another_dataset_is_refused_naming_both():
    saved = Job(30, 2, identity="corpus-a").position()
    s = ResumableSampler(30, num_replicas=2, rank=0, identity="corpus-b")
    with pytest.raises(DataPositionError, match=r"'corpus-a' of 30 samples.*'corpus-b' of 30 samples"):
        s.resume(saved, "ckpt")


def test_a_changed_length_is_refused_naming_both_or_restarts_the_epoch_when_asked(caplog):
    job = Job(30, 2, identity="d")
    job.take([5, 5])
    saved = job.position()
    with pytest.raises(DataPositionError, match=r"had 30 samples when ckpt was saved and has 32 now.*restart_on"):
        ResumableSampler(32, num_replicas=2, rank=0, identity="d").resume(saved, "ckpt")
    s = ResumableSampler(32, num_replicas=2, rank=0, identity="d", restart_on_length_change=True)
    with caplog.at_level(logging.WARNING, logger="rayckpt.data"):
        s.resume(saved, "ckpt")
    assert "epoch 0 starts over" in caplog.text
    assert s.epoch == 0 and len(list(s)) == 16


def test_no_saved_position_restarts_the_epoch_with_one_warning(caplog):
    s = ResumableSampler(10, num_replicas=1, rank=0)
    s.set_epoch(2)
    it = iter(s)
    next(it)
    with caplog.at_level(logging.WARNING, logger="rayckpt.data"):
        resume(s, None, "old-ckpt")
    assert len(caplog.records) == 1 and "old-ckpt holds no data position" in caplog.text
    assert "start of epoch 2" in caplog.text and len(list(s)) == 10


def test_ranks_in_different_epochs_are_refused():
    a = ResumableSampler(8, num_replicas=2, rank=0)
    b = ResumableSampler(8, num_replicas=2, rank=1)
    b.set_epoch(1)
    with pytest.raises(DataPositionError, match=r"rank 0 in epoch 0 .* rank 1 in epoch 1"):
        combine([a.share(), b.share()])
    with pytest.raises(DataPositionError, match=r"rank 1's data share says rank 0 of 2"):
        combine([a.share(), a.share()])


def test_bad_positions_are_refused_naming_the_field():
    good = DataPosition(dataset="d", length=10).to_json()
    with pytest.raises(DataPositionError, match="consumed 11 is past the length 10"):
        DataPosition.from_json({**good, "consumed": 11}, "m")
    with pytest.raises(DataPositionError, match="m: data position of 'd': extras must be ascending"):
        DataPosition.from_json({**good, "extras": [5, 3]}, "m")
    with pytest.raises(DataPositionError, match="m: a data position has the fields"):
        DataPosition.from_json({"dataset": "d"}, "m")
    with pytest.raises(DataPositionError, match="epoch must be a whole number"):
        DataPosition.from_json({**good, "epoch": -1}, "m")
    with pytest.raises(DataPositionError, match="not a rank's data share"):
        RankShare.from_json({"rank": 0}, "m")


def test_a_data_loader_counts_what_it_handed_out_and_refuses_worker_prefetch():
    s = ResumableSampler(20, num_replicas=1, rank=0, shuffle=False)
    loader = DataLoader(list(range(20)), batch_size=3, sampler=s)
    it = iter(loader)
    next(it), next(it)
    assert share_of(loader).taken == 6
    with pytest.raises(DataPositionError, match="num_workers=2 prefetches"):
        share_of(DataLoader(list(range(20)), batch_size=3, sampler=s, num_workers=2))
    with pytest.raises(DataPositionError, match="ResumableSampler or a DataLoader over one, got DataLoader with"):
        share_of(DataLoader(list(range(20))))


def test_a_stateful_data_loader_counts_consumed_batches_not_prefetched_ones():
    from torchdata.stateful_dataloader import StatefulDataLoader

    s = ResumableSampler(40, num_replicas=1, rank=0, seed=2)
    loader = StatefulDataLoader(list(range(40)), batch_size=4, sampler=s, num_workers=2, prefetch_factor=4)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(3)]
    assert s.share().taken > 12  # the workers were handed more than the loop consumed
    share = share_of(loader)
    assert share.taken == 12
    rest = ResumableSampler(40, num_replicas=2, rank=0, seed=2)
    rest.resume(combine([share]), "ckpt")
    other = ResumableSampler(40, num_replicas=2, rank=1, seed=2)
    other.resume(combine([share]), "ckpt")
    ids = [i for b in got for i in b] + list(rest) + list(other)
    assert sorted(ids) == list(range(40))
    with pytest.raises(DataPositionError, match="snapshot_every_n_steps=5"):
        share_of(StatefulDataLoader(list(range(40)), batch_size=4, sampler=s, snapshot_every_n_steps=5))


def test_extras_are_what_ranks_took_beyond_the_slowest_and_none_in_step():
    job = Job(1000, 4, seed=0)
    for _ in range(10):
        job.take([3, 3, 3, 3])
    assert job.position().extras == ()
    job.take([0, 2, 1, 2])  # a loop out of step: rank 0 two behind
    assert len(job.position().extras) == 5 and job.position().consumed == 120


def test_ranks_that_give_no_data_beside_ranks_that_do_are_refused():
    from rayckpt.engine.save_layout import data_position

    share = ResumableSampler(8, num_replicas=2, rank=0).share()
    assert data_position([None, None]) is None
    with pytest.raises(DataPositionError, match=r"rank\(s\) \[1\] saved without data="):
        data_position([share, None])
