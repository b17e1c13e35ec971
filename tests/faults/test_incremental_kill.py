"""Incremental saves, ``rayckpt.tools.remove`` and the store's collection SIGKILLed at a chosen point.

Each victim is a ``python -c`` child that replaces one function with a wrapper killing its own process at
the point under test (no timing). After the kill every committed checkpoint loads bit-exact and verifies,
and ``rayckpt.tools.gc`` (the dead process's leases are dead at once: same host, pid gone) leaves no store
file that no manifest names.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import rayckpt
import rayckpt.tools
from rayckpt.format.manifest import MANIFEST_NAME
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.lease import read_leases
from rayckpt.storage.names import shard_file_save_id

pytestmark = pytest.mark.slow
#: The shared store's directory beside the checkpoints (docs/FORMAT.md), spelled out: it is the format.
SHARED_DIR = ".rayckpt-shared"
PREFIX = f"../{SHARED_DIR}/"

#: The state of step ``i`` of every chain here, rebuilt the same in the child and the test.
STATE = textwrap.dedent(
    """
    import torch
    def state(i):
        frozen = torch.randn(20_000, generator=torch.Generator().manual_seed(7))
        trained = torch.randn(5_000, generator=torch.Generator().manual_seed(8)) + i
        return {"frozen": frozen, "trained": trained, "step": i}
    """
)
namespace: dict = {}
exec(STATE, namespace)
state = namespace["state"]


def run_killed(script: str, *args: str) -> None:
    """Run ``script`` in a child: it must die of SIGKILL (the wrapper was reached)."""
    r = subprocess.run(
        [sys.executable, "-c", STATE + textwrap.dedent(script), *args], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr)


def store_files(parent: str) -> set[str]:
    d = os.path.join(parent, SHARED_DIR)
    return {n for n in os.listdir(d) if n.endswith(".arrow") and shard_file_save_id(n) is not None}


def committed(parent: str) -> list[str]:
    return sorted(
        os.path.join(parent, n) for n in os.listdir(parent) if os.path.exists(os.path.join(parent, n, MANIFEST_NAME))
    )


def named(path: str) -> set[str]:
    with open(os.path.join(path, MANIFEST_NAME)) as f:
        return {x["path"][len(PREFIX) :] for x in json.load(f)["files"] if x["path"].startswith(PREFIX)}


def check_intact(parent: str, steps: dict[str, int]) -> None:
    """Every checkpoint in ``steps`` (path -> step) is committed, loads bit-exact and verifies."""
    assert sorted(steps) == committed(parent)
    for path, i in steps.items():
        want = state(i)
        got = {"frozen": torch.zeros(20_000), "trained": torch.zeros(5_000), "step": -1}
        rayckpt.load(got, path)
        assert torch.equal(got["frozen"], want["frozen"]) and torch.equal(got["trained"], want["trained"]), path
        assert got["step"] == i
        report = rayckpt.verify(path)
        assert report.ok, report.problems


def no_live_leases(parent: str) -> None:
    for d in [parent, os.path.join(parent, SHARED_DIR)] + [os.path.join(parent, n) for n in os.listdir(parent)]:
        if os.path.isdir(d):
            assert not [x for x in read_leases(CheckpointDir.resolve(d)) if x.is_live()], d


def gc_leaves_no_orphan(parent: str) -> None:
    no_live_leases(parent)  # the killed process's leases are dead at once
    report = rayckpt.tools.gc(parent)
    assert not report.skipped, report.skipped
    assert store_files(parent) == set().union(*(named(p) for p in committed(parent)))


def chain(parent: str, n: int) -> dict[str, int]:
    out = {}
    for i in range(n):
        path = os.path.join(parent, f"c{i}")
        rayckpt.save(state(i), path, incremental=True)
        out[path] = i
    return out


def test_a_save_killed_after_writing_its_store_files_before_its_commit(tmp_path):
    parent = str(tmp_path / "run")
    run_killed(
        """
        import os, signal, sys
        import rayckpt
        from rayckpt.engine import save as save_mod
        parent = sys.argv[1]
        for i in range(2):
            rayckpt.save(state(i), f"{parent}/c{i}", incremental=True)

        def die(*a, **kw):
            os.kill(os.getpid(), signal.SIGKILL)

        save_mod.commit_save = die  # every shard file durable, the manifest not written
        rayckpt.save(state(2), f"{parent}/c2", incremental=True)
        """,
        parent,
    )
    steps = {os.path.join(parent, "c0"): 0, os.path.join(parent, "c1"): 1}
    killed = store_files(parent) - named(os.path.join(parent, "c0")) - named(os.path.join(parent, "c1"))
    assert killed, "the killed save wrote store files before its commit"
    assert not os.path.exists(os.path.join(parent, "c2", MANIFEST_NAME))
    check_intact(parent, steps)
    gc_leaves_no_orphan(parent)
    assert not store_files(parent) & killed
    assert not os.path.exists(os.path.join(parent, "c2")) or not os.listdir(os.path.join(parent, "c2"))
    # the next save in a new process, at the killed save's location, works and shares nothing that is gone
    rayckpt.save(state(2), os.path.join(parent, "c2"), incremental=True)
    check_intact(parent, {**steps, os.path.join(parent, "c2"): 2})


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_remove_killed_after_deleting_the_manifest(tmp_path, victim):
    parent = str(tmp_path / "run")
    steps = chain(parent, 3)
    target = os.path.join(parent, f"c{victim}")
    run_killed(
        """
        import os, signal, sys
        import rayckpt
        import rayckpt.tools
        from rayckpt.storage.checkpoint_dir import CheckpointDir
        target = sys.argv[1]
        real = CheckpointDir.delete

        def delete(self, name, *a, **kw):
            out = real(self, name, *a, **kw)
            if name == "manifest.json":
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        CheckpointDir.delete = delete
        rayckpt.tools.remove(target)
        """,
        target,
    )
    assert os.path.isdir(target) and not os.path.exists(os.path.join(target, MANIFEST_NAME))
    del steps[target]
    check_intact(parent, steps)
    gc_leaves_no_orphan(parent)
    assert not os.path.exists(target)
    check_intact(parent, steps)


def test_sweep_killed_after_listing_before_deleting(tmp_path):
    parent = str(tmp_path / "run")
    steps = chain(parent, 3)
    gone = os.path.join(parent, "c1")
    only_gone = named(gone) - named(os.path.join(parent, "c0")) - named(os.path.join(parent, "c2"))
    assert only_gone  # c1's own file (its trained tensor): no other checkpoint names it
    shutil.rmtree(gone)
    del steps[gone]
    run_killed(
        """
        import os, signal, sys
        from rayckpt.storage import shared
        from rayckpt.storage.checkpoint_dir import CheckpointDir
        parent = sys.argv[1]
        real = CheckpointDir.delete

        def delete(self, name, *a, **kw):
            if self.fs_path.endswith(".rayckpt-shared") and name.endswith(".arrow"):
                os.kill(os.getpid(), signal.SIGKILL)  # listed and marked, nothing deleted yet
            return real(self, name, *a, **kw)

        CheckpointDir.delete = delete
        shared.sweep_store(CheckpointDir.resolve(parent))
        """,
        parent,
    )
    assert only_gone <= store_files(parent)  # the kill came before the first deletion
    store = os.path.join(parent, SHARED_DIR)
    assert any(x.save_id.startswith("sweep-") for x in read_leases(CheckpointDir.resolve(store)))
    check_intact(parent, steps)
    gc_leaves_no_orphan(parent)
    assert not only_gone & store_files(parent)
    assert not read_leases(CheckpointDir.resolve(store)), "the dead sweep's marker was collected"
    check_intact(parent, steps)


def test_a_paused_save_keeps_its_base_through_rmtree_and_gc(tmp_path):
    """Not a kill: a save paused before its commit (its files written) while its base and the base's base are
    deleted and the store collected; the files it shares survive, and it commits a checkpoint that loads."""
    parent, sync = str(tmp_path / "run"), str(tmp_path / "sync")
    os.makedirs(sync)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            STATE
            + textwrap.dedent(
                """
                import os, sys, time
                import rayckpt
                from rayckpt.engine import save as save_mod
                parent, sync = sys.argv[1], sys.argv[2]
                for i in range(2):
                    rayckpt.save(state(i), f"{parent}/c{i}", incremental=True)
                real = save_mod.commit_save

                def paused(*a, **kw):
                    open(f"{sync}/ready", "w").close()
                    while not os.path.exists(f"{sync}/go"):
                        time.sleep(0.02)
                    return real(*a, **kw)

                save_mod.commit_save = paused
                rayckpt.save(state(2), f"{parent}/c2", incremental=True)
                """
            ),
            parent,
            sync,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not os.path.exists(os.path.join(sync, "ready")):
            assert child.poll() is None, child.communicate()
            time.sleep(0.05)
        shutil.rmtree(os.path.join(parent, "c0"))
        shutil.rmtree(os.path.join(parent, "c1"))
        report = rayckpt.tools.gc(parent)
        assert not report.skipped, report.skipped
    finally:
        open(os.path.join(sync, "go"), "w").close()
        out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    c2 = os.path.join(parent, "c2")
    assert len({shard_file_save_id(n) for n in named(c2)}) > 1  # it did share with an earlier save
    check_intact(parent, {c2: 2})
    gc_leaves_no_orphan(parent)
    check_intact(parent, {c2: 2})
