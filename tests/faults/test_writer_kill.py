"""The node's ShardWriter SIGKILLed while it writes a save: a clear error, the previous checkpoint intact,
nothing of the killed save left once the next save commits, and that next save works."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch

import rayckpt
from rayckpt.errors import SaveFailedError
from rayckpt.ray.rank import async_save
from rayckpt.ray.writer.actor import get_shard_writer

ROWS = 4096  # x 4096 float32: 64 MiB, long enough to write that a kill lands mid-write


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(ROWS, 4096, generator=g), "step": seed}


def writer_pid() -> int:
    return ray.get(get_shard_writer().__ray_call__.remote(lambda self: os.getpid()))


def test_a_writer_killed_mid_save_fails_that_save_only(ray_session, tmp_path):
    path = str(tmp_path / "ckpt")
    assert async_save.save_async(state(1), path, run="writer-kill", step=1).wait().status == "committed"
    first = sorted(os.listdir(path))

    pid = writer_pid()
    handle = async_save.save_async(state(2), path, run="writer-kill", step=2)
    time.sleep(0.05)  # the writer has the request: kill it while it writes
    os.kill(pid, signal.SIGKILL)
    try:
        entry = handle.wait()
    except SaveFailedError as exc:
        msg = str(exc)
        assert "step 2" in msg and "ShardWriter" in msg, msg
        # Never a mix: the committed checkpoint is still step 1's, bit-exact.
        target = {"w": torch.zeros(ROWS, 4096), "step": 0}
        rayckpt.load(target, path)
        assert target["step"] == 1 and torch.equal(target["w"], state(1)["w"])
        assert rayckpt.verify(path).ok
    else:  # the write won the race: then it is whole
        pytest.skip(f"the writer finished before the kill (status {entry.status}); nothing to check")

    # A new writer serves the next save, which commits; only its files remain.
    assert writer_pid() != pid
    handle = async_save.save_async(state(3), path, run="writer-kill", step=3)
    assert handle.wait().status == "committed"
    target = {"w": torch.zeros(ROWS, 4096), "step": 0}
    rayckpt.load(target, path)
    assert target["step"] == 3 and torch.equal(target["w"], state(3)["w"])
    names = sorted(os.listdir(path))
    assert all(n == "manifest.json" or n.startswith(handle.save_id) for n in names), (first, names)
