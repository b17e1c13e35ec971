"""Process bodies for the fault tests (a save or an import that can stop at a chosen point), and their checks.

Used by ``tests/faults`` and ``tests/ray/test_shared_location.py``. Each body
runs in its own process (``multiprocessing`` forkserver, see ``start``; or a
Ray task), patches its own copy of rayckpt to pause where the test asks, and
reports its outcome (``<sync_dir>/<name>.result``, JSON). A pause writes
``<name>.ready`` (holding the save id) and waits until the test creates
``<name>.go``: the test decides the interleaving, nothing depends on timing.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from rayckpt.testing.multiproc import start_process

#: Pause points: after writing the claiming lease (before looking at rivals), right
#: before the commit (shard files written, lease held), before an import writes,
#: before an export publishes its finished output.
PAUSES = ("claim", "commit", "import", "publish")
WAIT_S = 60.0


def state_of(value: int, rows: int = 256) -> dict[str, Any]:
    """A state dict that differs in every byte from another value's: two files (float, int64)."""
    return {
        "w": torch.full((rows, 64), float(value)) + torch.arange(64, dtype=torch.float32),
        "b": torch.arange(64, dtype=torch.int64) * value,
        "step": value,
    }


def manifest_of(path: str) -> Any:
    """The committed manifest at ``path``."""
    from rayckpt.storage.checkpoint_dir import CheckpointDir
    from rayckpt.storage.commit import read_manifest

    return read_manifest(CheckpointDir.resolve(path))


def assert_one_whole_checkpoint(path: str, values: tuple[int, ...]) -> int:
    """The checkpoint at ``path`` verifies, holds exactly the state of one of ``values`` (returned),
    and the directory holds its manifest and files and nothing else."""
    import rayckpt
    from rayckpt.format.manifest import MANIFEST_NAME

    report = rayckpt.verify(path)
    assert report.ok, report.problems
    manifest = manifest_of(path)
    assert sorted(os.listdir(path)) == sorted([MANIFEST_NAME, *manifest.table_files] + [f.path for f in manifest.files])
    out = {"w": torch.zeros(256, 64), "b": torch.zeros(64, dtype=torch.int64), "step": -1}
    rayckpt.load(out, path)
    assert out["step"] in values
    want = state_of(out["step"])
    assert torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"])
    return out["step"]


def assert_refused_naming(outcome: dict, path: str, other_save_id: str) -> None:
    assert outcome["type"] == "SaveFailedError", outcome
    assert path in outcome["error"] and other_save_id in outcome["error"], outcome["error"]


def wait_for(path: str, timeout: float = WAIT_S) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


def _pause(sync_dir: str, name: str, save_id: str) -> None:
    with open(os.path.join(sync_dir, f"{name}.ready.tmp"), "w") as f:
        f.write(save_id)
    os.replace(os.path.join(sync_dir, f"{name}.ready.tmp"), os.path.join(sync_dir, f"{name}.ready"))
    wait_for(os.path.join(sync_dir, f"{name}.go"))


def _install_pause(pause: str | None, sync_dir: str, name: str) -> None:
    if pause is None:
        return
    if pause == "claim":
        from rayckpt.storage import lease

        real_write = lease.write_lease

        def write_lease(ckdir, save_id, state=lease.HELD, ttl_s=lease.LEASE_TTL_S):
            written = real_write(ckdir, save_id, state, ttl_s)
            if state == lease.CLAIMING:
                _pause(sync_dir, name, save_id)
            return written

        lease.write_lease = write_lease
    elif pause == "commit":
        from rayckpt.engine import save

        real_commit = save.commit_save

        def commit_save(ckdir, spec, shards):
            _pause(sync_dir, name, spec.save_id)
            return real_commit(ckdir, spec, shards)

        save.commit_save = commit_save
    elif pause == "import":
        from rayckpt.tools.convert import streaming

        real_write_chunks = streaming.write_chunks

        def write_chunks(files, chunks, *args):
            _pause(sync_dir, name, files.save_id)
            return real_write_chunks(files, chunks, *args)

        streaming.write_chunks = write_chunks
    elif pause == "publish":
        from rayckpt.tools.convert import core

        real_publish = core.publish

        def publish(tmp, dst):
            _pause(sync_dir, name, tmp)
            return real_publish(tmp, dst)

        core.publish = publish
    else:
        raise ValueError(f"pause must be one of {PAUSES}, not {pause!r}")


def _report(sync_dir: str, name: str, fn: Any) -> None:
    try:
        outcome = {"ok": True, "save_id": fn()}
    except Exception as exc:  # noqa: BLE001 - the test judges every outcome
        outcome = {"ok": False, "type": type(exc).__name__, "error": str(exc)}
    with open(os.path.join(sync_dir, f"{name}.result"), "w") as f:
        json.dump(outcome, f)


def save_worker(path: str, value: int, sync_dir: str, name: str, pause: str | None = None, delay: float = 0.0) -> None:
    """``rayckpt.save(state_of(value), path)`` in this process."""
    import rayckpt

    _install_pause(pause, sync_dir, name)
    time.sleep(delay)
    _report(sync_dir, name, lambda: rayckpt.save(state_of(value), path).save_id)


def group_save(
    rank: int, world_size: int, path: str, value: int, sync_dir: str, name: str, pause: str | None
) -> dict[str, Any]:
    """One rank of a process group saving ``state_of(value)`` (``run_ranks``); rank 0 pauses."""
    import rayckpt

    if rank == 0:
        _install_pause(pause, sync_dir, name)
    state = state_of(value)
    try:
        return {"ok": True, "save_id": rayckpt.save(state, path).save_id}
    except Exception as exc:  # noqa: BLE001 - the test judges every outcome
        return {"ok": False, "type": type(exc).__name__, "error": str(exc)}


def import_worker(src: str, dst: str, sync_dir: str, name: str, pause: str | None = None) -> None:
    """``rayckpt convert --from torch SRC DST`` in this process."""
    from rayckpt.tools.convert.core import convert

    _install_pause(pause, sync_dir, name)

    def run() -> str:
        convert(src, dst, from_="torch")
        return ""

    _report(sync_dir, name, run)


def export_worker(src: str, dst: str, fmt: str, sync_dir: str, name: str, pause: str | None = None) -> None:
    """``rayckpt convert SRC DST --to FMT`` in this process."""
    from rayckpt.tools.convert.core import convert

    _install_pause(pause, sync_dir, name)
    _report(sync_dir, name, lambda: convert(src, dst, to=fmt).dst)


def start(target: Any, *args: Any) -> multiprocessing.process.BaseProcess:
    """Run ``target(*args)`` in a new process forked from a clean server that preloaded torch and rayckpt
    (cheap to start, and free of the test process's threads); the server ``run_ranks`` forks from too."""
    return start_process(target, *args, preload=("rayckpt.engine.save", "rayckpt.tools.convert.core", __name__))


def result(sync_dir: str, name: str, proc: multiprocessing.process.BaseProcess) -> dict[str, Any]:
    """The outcome ``name`` reported, once its process ended."""
    proc.join(WAIT_S)
    if proc.is_alive():
        proc.kill()
        raise TimeoutError(f"{name} did not finish within {WAIT_S}s")
    with open(os.path.join(sync_dir, f"{name}.result")) as f:
        return json.load(f)


def go(sync_dir: str, name: str) -> None:
    open(os.path.join(sync_dir, f"{name}.go"), "w").close()


def ready(sync_dir: str, name: str) -> str:
    """Wait until ``name`` paused; its save id. Fails at once if it ended without pausing."""
    done = os.path.join(sync_dir, f"{name}.result")
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(os.path.join(sync_dir, f"{name}.ready")):
        if os.path.exists(done) or time.monotonic() > deadline:
            raise AssertionError(f"{name} did not pause: {open(done).read() if os.path.exists(done) else 'timeout'}")
        time.sleep(0.01)
    return wait_for(os.path.join(sync_dir, f"{name}.ready"))


def race_two_claims(
    start_save: Callable[[str, int], multiprocessing.process.BaseProcess], location: str, sync_dir: str
) -> int:
    """Saves "a" (value 1) and "b" (value 2), started by ``start_save(name, value)`` with the pause
    "claim", both write their claiming lease before either looks; let go, exactly one goes on: the
    smaller save id (each sees the other, the larger gives way) commits, the other is refused naming
    it. Returns the winner's value."""
    procs = {name: start_save(name, value) for name, value in (("a", 1), ("b", 2))}
    ids = {name: ready(sync_dir, name) for name in procs}
    for name in procs:
        go(sync_dir, name)
    outcomes = {name: result(sync_dir, name, p) for name, p in procs.items()}
    winner = min(ids, key=ids.get)
    loser = "b" if winner == "a" else "a"
    assert outcomes[winner] == {"ok": True, "save_id": ids[winner]}
    assert_refused_naming(outcomes[loser], location, ids[winner])
    return {"a": 1, "b": 2}[winner]
