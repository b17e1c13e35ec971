"""A full filesystem mid-save: a clear error, the previous checkpoint intact, nothing left, the next save works.

The filesystem is a real 2 MiB tmpfs when this test may mount one (root), else
the save runs under ``RLIMIT_FSIZE`` (a file over 1 MiB fails with EFBIG), the
nearest thing an unprivileged process has.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import signal
import subprocess
from collections.abc import Iterator

import pytest
import torch

import rayckpt
from rayckpt.errors import SaveFailedError
from rayckpt.storage.checkpoint_dir import CheckpointDir

SMALL = 64 * 1024  # float32 elements: 256 KiB
BIG = 1024 * 1024  # 4 MiB: more than the filesystem holds


def state(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.randn(7, generator=g)}, "step": seed}


@contextlib.contextmanager
def no_room() -> Iterator[None]:
    """Files over 1 MiB fail with EFBIG (and no SIGXFSZ) meanwhile."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


@contextlib.contextmanager
def tmpfs(root: str) -> Iterator[None]:
    """A real 2 MiB tmpfs at ``root`` (skips the test where it cannot be mounted)."""
    os.makedirs(root)
    mount = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", root]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        yield
    finally:
        subprocess.run(["umount", root], capture_output=True, check=False)


@pytest.fixture(params=["tmpfs", "rlimit"])
def small_fs(request, tmp_path) -> Iterator[tuple[str, contextlib.AbstractContextManager]]:
    """(a directory on a nearly full filesystem, the context the failing save runs in)."""
    root = str(tmp_path / "fs")
    if request.param == "rlimit":
        os.makedirs(root)
        yield root, no_room()
        return
    with tmpfs(root):
        yield root, contextlib.nullcontext()


def load_state(path: str, n: int) -> dict:
    target = state(n, seed=99)
    rayckpt.load(target, path)
    return target


def test_a_save_that_runs_out_of_space_fails_cleanly(small_fs):
    root, fault = small_fs
    path = os.path.join(root, "ckpt")
    rayckpt.save(state(SMALL, seed=1), path)
    kept = sorted(os.listdir(path))

    with fault, pytest.raises(SaveFailedError) as info:
        rayckpt.save(state(BIG, seed=2), path)
    msg = str(info.value)
    assert "rank 0" in msg and f"writing shard file {path}/" in msg and ".arrow failed: " in msg
    assert msg.rstrip().endswith(("No space left on device", "File too large")), msg
    assert "pyarrow" not in msg  # one clean line per rank, not pyarrow's traceback
    assert not re.search(r'File "|line \d+, in|Traceback', msg)

    # The previous checkpoint is untouched, bit-exact, and nothing of the failed save is left.
    assert sorted(os.listdir(path)) == kept
    got = load_state(path, SMALL)
    want = state(SMALL, seed=1)
    assert torch.equal(got["model"]["w"], want["model"]["w"]) and got["step"] == 1
    assert rayckpt.verify(path).ok

    # The space the failed save took is free again: the next save fits and commits.
    rayckpt.save(state(SMALL, seed=3), path)
    got = load_state(path, SMALL)
    assert torch.equal(got["model"]["w"], state(SMALL, seed=3)["model"]["w"]) and got["step"] == 3


def test_a_full_disk_at_commit_is_one_line_naming_the_cause_not_a_traceback(tmp_path, monkeypatch):
    # The shard files fit; the manifest, written last, does not (a real disk fills up meanwhile).
    path = str(tmp_path / "ckpt")
    rayckpt.save(state(SMALL, seed=1), path)
    kept = sorted(os.listdir(path))
    write_atomic = CheckpointDir.write_atomic

    def full_at_manifest(self, rel, data, durable=True):
        if rel.startswith("manifest"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path(rel))
        write_atomic(self, rel, data, durable)

    monkeypatch.setattr(CheckpointDir, "write_atomic", full_at_manifest)
    with pytest.raises(SaveFailedError) as info:
        rayckpt.save(state(SMALL, seed=2), path)
    msg = str(info.value)
    assert msg == (
        "save (commit) failed on 1 of 1 rank(s):\n"
        f"  rank 0: OSError: [Errno 28] No space left on device: '{path}/manifest.json'"
    )
    assert not re.search(r'File "|line \d+, in|Traceback', msg)
    monkeypatch.undo()
    assert sorted(os.listdir(path)) == kept  # the failed save's shard files are gone
    assert load_state(path, SMALL)["step"] == 1


def test_a_ray_save_that_runs_out_of_space_fails_cleanly(ray_session, tmp_path):
    # The node's ShardWriter writes the files, in its own process: only a real full filesystem reaches it.
    from rayckpt.ray.rank import async_save

    root = str(tmp_path / "fs")
    with tmpfs(root):
        path = os.path.join(root, "ckpt")
        async_save.save_async(state(SMALL, seed=1), path, run="full-disk", step=1).wait()
        kept = sorted(os.listdir(path))
        handle = async_save.save_async(state(BIG, seed=2), path, run="full-disk", step=2)
        with pytest.raises(SaveFailedError) as info:
            handle.wait()
        msg = str(info.value)
        assert "No space left on device" in msg and f"writing shard file {path}/" in msg, msg
        assert sorted(os.listdir(path)) == kept
        got = load_state(path, SMALL)
        assert torch.equal(got["model"]["w"], state(SMALL, seed=1)["model"]["w"]) and got["step"] == 1
        assert async_save.save_async(state(SMALL, seed=3), path, run="full-disk", step=3).wait().status == "committed"
        assert load_state(path, SMALL)["step"] == 3
