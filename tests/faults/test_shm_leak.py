"""No staging buffer outlives its job: not after a TorchTrainer run and ``ray.shutdown()``,
not after a worker raised, not after its process was SIGKILLed; named leftovers are swept."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from rayckpt.ray.rank.staging import StagingBuffer
from rayckpt.ray.shm import PREFIX, SHM_DIR, StagedRegion
from rayckpt.ray.writer.regions import StaleSweeper, open_region

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def holders(names: set[str]) -> list[str]:
    """Processes (``pid:where``) that still hold one of the unlinked files ``names`` open or mapped."""
    gone = {f"{n} (deleted)" for n in names}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in gone:
                        found.append(f"{pid}:fd")
                except OSError:
                    pass
            with open(f"/proc/{pid}/maps") as maps:
                found += [f"{pid}:map" for line in maps if any(n in line for n in names)]
        except OSError:  # gone meanwhile, or another user's
            pass
    return found


def files_of(pids: set[int]) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if any(n.startswith(f"{PREFIX}{pid}-") for pid in pids)]


@pytest.mark.slow
def test_nothing_staged_outlives_a_torchtrainer_run_and_ray_shutdown(tmp_path):
    storage, out = tmp_path / "storage", tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT, RAY_AUTH_MODE="disabled")
    job = subprocess.run(
        [sys.executable, "-m", "tests.helpers.shm_job", str(storage), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    summary = json.loads(job.stdout.strip().splitlines()[-1])
    assert "injected failure after a save" in summary["failed"]
    seen = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert {(s["run"], s["rank"]) for s in seen} >= {("ends", 0), ("ends", 1), ("fails", 0), ("fails", 1)}
    for s in seen:  # while the run lived: a buffer held by the worker, with no name to leak
        assert s["held"] and not s["named"], s
    pids = {s["pid"] for s in seen}
    assert files_of(pids) == []
    assert holders({s["name"] for s in seen}) == []


def stage_and_die(directory: str, conn) -> None:
    buffer = StagingBuffer(directory)
    region = buffer.stage([torch.arange(1000, dtype=torch.float32)], "n")
    conn.send((buffer.name, region.path))
    conn.recv()  # the parent has looked
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_rank_killed_with_sigkill_leaves_no_staging_file(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=stage_and_die, args=(str(tmp_path), child))
    p.start()
    name, path = parent.recv()
    with open_region(StagedRegion(path, "n", ((0, 64),))) as views:  # as the node's writer reads it
        assert bytes(views[0]) == torch.arange(16, dtype=torch.float32).numpy().tobytes()
    assert os.listdir(tmp_path) == []
    parent.send("done")
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    assert os.listdir(tmp_path) == [] and holders({name}) == []


def test_the_sweeper_removes_named_files_of_dead_processes_periodically(tmp_path):
    dead = multiprocessing.get_context("spawn").Process(target=int)
    dead.start()
    dead.join()
    at_start = tmp_path / f"{PREFIX}{dead.pid}-000000000000"
    at_start.write_bytes(b"x")
    sweeper = StaleSweeper(str(tmp_path), interval_s=0.05)
    try:
        assert sweeper.removed == [at_start.name]  # swept when it starts
        later = tmp_path / f"{PREFIX}{dead.pid}-111111111111"  # left after it started (an older rayckpt)
        mine = tmp_path / f"{PREFIX}{os.getpid()}-222222222222"
        other = tmp_path / "not-ours"
        for f in (later, mine, other):
            f.write_bytes(b"x")
        deadline = time.monotonic() + 30
        while later.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not later.exists() and sweeper.removed == [at_start.name, later.name]
        assert mine.exists() and other.exists()  # a live process's file, and a file not ours, stay
    finally:
        sweeper.stop()
