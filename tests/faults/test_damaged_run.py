"""One damaged checkpoint in a run: listed as corrupt with the reason; the others stay usable, latest skips it."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from rayckpt.ray.metadata.actor import MetadataActor
from rayckpt.storage import checkpoint_dir
from rayckpt.storage.catalog import latest_committed, scan_run
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.tools import ls
from tests.helpers.checkpoints import manifest_of
from tests.helpers.manifest_faults import assert_loads_bit_exact, run_cli, save_run


def _write(path: str, text: str) -> None:
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write(text)


def _edited(path: str, edit) -> str:
    doc = manifest_of(path)
    edit(doc)
    return json.dumps(doc)


# damage -> (how to do it to a checkpoint directory, what the reason says)
DAMAGE = {
    "entries a list": (lambda p: _write(p, _edited(p, lambda d: d.update(entries=[]))), "entries: expected an object"),
    "dtype a list": (
        lambda p: _write(p, _edited(p, lambda d: d["entries"]["model.w"].update(dtype=[1]))),
        "entries['model.w'].dtype",
    ),
    "truncated JSON": (lambda p: _write(p, _edited(p, lambda d: None)[:100]), "not valid JSON"),
    "nested JSON": (lambda p: _write(p, "[" * 50_000 + "]" * 50_000), "nested too deeply"),
    "symlinked manifest": (
        lambda p: (os.rename(f"{p}/manifest.json", f"{p}.json"), os.symlink(f"{p}.json", f"{p}/manifest.json")),
        "symbolic link",
    ),
    "future version": (lambda p: _write(p, _edited(p, lambda d: d.update(version=9))), "format version 9"),
}


@pytest.fixture
def run(tmp_path):
    return save_run(str(tmp_path / "storage" / "myrun"))


def _run_dir(run) -> str:
    return os.path.dirname(run[1][0])


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_middle_checkpoint_is_listed_corrupt_and_skipped(run, damage):
    do, reason = DAMAGE[damage]
    do(run[2][0])

    entries = scan_run(CheckpointDir.resolve(_run_dir(run)), "myrun")
    assert [(e.step, e.status) for e in entries] == [(1, "committed"), (2, "corrupt"), (3, "committed")]
    assert reason in entries[1].error and "manifest.json" in entries[1].error
    assert latest_committed(entries).step == 3

    status, out, err = run_cli("ls", os.path.dirname(_run_dir(run)))
    assert status == 0 and not err
    rows = [line.split()[:3] for line in out.splitlines()[1:]]
    assert rows == [["myrun", "1", "committed"], ["myrun", "2", "corrupt"], ["myrun", "3", "committed"]]
    status, out, _ = run_cli("ls", os.path.dirname(_run_dir(run)), "--json")
    listed = json.loads(out)
    assert status == 0 and listed[1]["status"] == "corrupt" and reason in listed[1]["error"]
    for step in (1, 3):
        assert_loads_bit_exact(*run[step])


@pytest.mark.parametrize("damage", ["entries a list", "symlinked manifest"])
def test_damaged_newest_checkpoint_resumes_from_the_one_before(run, damage):
    """What the Checkpointer's ``latest()`` asks: the MetadataActor's catalog (its class, without Ray)."""
    DAMAGE[damage][0](run[3][0])
    actor = MetadataActor()
    entries = asyncio.run(actor.register_run("myrun", _run_dir(run)))
    assert [e.status for e in entries] == ["committed", "committed", "corrupt"]
    latest = asyncio.run(actor.latest("myrun"))
    assert latest.step == 2 and latest.path == run[2][0]
    assert latest_committed(entries) == latest
    assert_loads_bit_exact(latest.path, run[2][1])


def test_a_directory_the_os_will_not_read_is_listed_corrupt(run, monkeypatch):
    """An ``OSError`` reading one checkpoint (permissions, I/O error) does not break the listing."""
    broken = run[2][0]
    real = checkpoint_dir.CheckpointDir.list_files

    def list_files(self):
        if self.fs_path == broken:
            raise PermissionError(13, "Permission denied", broken)
        return real(self)

    monkeypatch.setattr(checkpoint_dir.CheckpointDir, "list_files", list_files)
    entries = scan_run(CheckpointDir.resolve(_run_dir(run)), "myrun")
    assert [(e.step, e.status) for e in entries] == [(1, "committed"), (2, "corrupt"), (3, "committed")]
    assert "Permission denied" in entries[1].error
    assert latest_committed(entries).step == 3
    listed = ls(os.path.dirname(_run_dir(run)))
    assert [(e.step, e.status) for e in listed] == [(1, "committed"), (2, "corrupt"), (3, "committed")]
