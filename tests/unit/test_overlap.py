"""The Ray-free half of saves beside training: version checks, guarded optimizers, the overlap modes."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from rayckpt.engine import overlap
from rayckpt.engine.state import flatten


def test_a_tensor_changed_in_place_is_named_and_an_untouched_one_passes():
    w, b = torch.zeros(4), torch.ones(2)
    versions = overlap.Versions(["w", "b"], [(w,), (b,)])
    w.add_(1.0)
    assert "key 'w' was changed in place" in versions.changed(0)
    assert "version counter went from 0 to 1" in versions.changed(0)
    assert versions.changed(1) is None


def test_a_view_shares_the_counter_of_the_tensor_it_views():
    w = torch.zeros(4, 4)
    versions = overlap.Versions(["w"], [(w[1:3].detach(),)])
    w[0].fill_(1.0)  # any in-place change to the tensor counts, even outside the view's rows
    assert versions.changed(0) is not None


def test_a_dtensor_changed_in_place_is_seen_though_its_local_shard_counter_does_not_move():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        dt = distribute_tensor(torch.zeros(8, 2), mesh, [Shard(0)])
        leaf = flatten({"p": dt}).tensors["p"]
        piece = leaf.pieces[0].local
        versions = overlap.Versions(["p"], [(leaf.source, piece)])
        local_before = piece._version
        with torch.no_grad():
            dt.mul_(2.0)
        assert piece._version == local_before  # why the DTensor's own counter is checked too
        assert "key 'p' was changed in place" in versions.changed(0)
    finally:
        dist.destroy_process_group()


def test_guard_optimizer_installs_one_hook_and_names_what_it_refuses():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    assert not overlap.is_guarded(opt)
    overlap.guard_optimizer(opt)
    overlap.guard_optimizer(opt)
    assert overlap.is_guarded(opt) and len(opt._optimizer_step_pre_hooks) == 1
    with pytest.raises(TypeError, match="guard_optimizer: expected a torch.optim.Optimizer, got Linear"):
        overlap.guard_optimizer(torch.nn.Linear(2, 2))


def test_guarded_storages_are_the_parameters_and_the_optimizer_state():
    p = torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.ones(5)
    opt.step()
    overlap.guard_optimizer(opt)
    storages = overlap.guarded_storages()
    assert overlap.storage_of(p[1:]) in storages  # a view of a parameter
    assert overlap.storage_of(opt.state[p]["exp_avg"]) in storages
    assert overlap.storage_of(torch.zeros(5)) not in storages


class Copy:
    """A copy in flight the test ends by hand."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def wait_copied(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


def test_a_guarded_step_waits_for_every_copy_in_flight_and_counts_the_wait():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    overlap.guard_optimizer(opt)
    copy = Copy()
    overlap.track(copy)
    p.grad = torch.ones(3)
    stepped = threading.Event()
    stepper = threading.Thread(target=lambda: (opt.step(), stepped.set()))
    waited = overlap.waited[0]
    stepper.start()
    assert not stepped.wait(0.3) and torch.equal(p.detach(), torch.zeros(3))  # held before it changes p
    overlap.untrack(copy)
    copy.done.set()
    stepper.join(30)
    assert stepped.is_set() and torch.equal(p.detach(), -torch.ones(3)) and overlap.waited[0] > waited


@pytest.mark.parametrize("bad", ["yes", 1, None, "ALL"])
def test_unknown_overlap_modes_are_refused(bad):
    with pytest.raises(ValueError, match=r"overlap=.*: expected True, False or 'all'"):
        overlap.overlap_mode(bad)
