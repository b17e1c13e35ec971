"""``rayckpt rm``, URIs a user can paste back from ``rayckpt ls``, and what ``--help`` shows.

A save really in flight refusing ``rm`` is in ``tests/faults/test_rm.py``.
"""

from __future__ import annotations

import argparse
import io
import json
import os

import pyarrow.fs as pafs
import pytest
import torch

import rayckpt
from rayckpt import tools
from rayckpt.cli import commands as cli
from rayckpt.format.manifest import MANIFEST_NAME
from rayckpt.storage import lease
from rayckpt.storage.catalog import scan_run
from rayckpt.storage.checkpoint_dir import CheckpointDir, join_location, parent_location
from rayckpt.storage.commit import new_save_id
from rayckpt.tools import removal
from rayckpt.tools.opening import resolve_checkpoint


def saved(path) -> str:
    rayckpt.save({"w": torch.arange(6.0), "step": 3}, str(path), metadata={"step": 3})
    return str(path)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(capsys, *argv: str) -> tuple[int, str, list[str]]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err.splitlines()


# ---------------------------------------------------------------------------
# rm


def test_rm_yes_removes_the_checkpoint_directory(tmp_path, capsys):
    ckpt = saved(tmp_path / "run" / "rayckpt-step-00000003")
    files = sorted(os.listdir(ckpt))
    save_id = rayckpt.inspect(ckpt).save_id
    status, out, err = run(capsys, "rm", ckpt, "--yes")
    assert status == 0 and err == []
    assert out.startswith(f"removed {ckpt}: save {save_id}, {len(files)} files (")
    assert not os.path.exists(ckpt) and os.path.isdir(tmp_path / "run")  # only the checkpoint goes


def test_rm_asks_on_a_terminal_and_removes_only_on_yes(tmp_path, capsys, monkeypatch):
    ckpt = saved(tmp_path / "c")
    monkeypatch.setattr("sys.stdin", Terminal("n\n"))
    status, out, err = run(capsys, "rm", ckpt)
    assert status == 1 and out == ""
    assert err[0].startswith(f"remove checkpoint {ckpt} (save ") and err[0].endswith("? [y/N] rayckpt: nothing removed")
    assert rayckpt.verify(ckpt).ok
    monkeypatch.setattr("sys.stdin", Terminal("y\n"))
    status, out, _ = run(capsys, "rm", ckpt, "--json")
    report = json.loads(out)
    assert status == 0 and report["path"] == ckpt and report["files"][0] == MANIFEST_NAME and not report["dry_run"]
    assert list(report) == ["path", "save_id", "dry_run", "files", "bytes", "store"]
    assert not os.path.exists(ckpt)


def test_rm_without_a_terminal_needs_yes(tmp_path, capsys, monkeypatch):
    ckpt = saved(tmp_path / "c")
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))  # piped input is not a confirmation
    status, out, err = run(capsys, "rm", ckpt)
    assert status == 2 and out == ""
    assert err == [f"rayckpt: error: not removing {ckpt}: no terminal to confirm on; pass --yes to remove it"]
    assert rayckpt.verify(ckpt).ok


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda p: p.mkdir(), "is not a rayckpt checkpoint (no manifest.json)"),
        (lambda p: (p / "rayckpt-step-00000001").mkdir(parents=True), "is not a rayckpt checkpoint (no manifest.json)"),
        (lambda p: p.with_name("nope"), "nope: no such file or directory"),
    ],
    ids=["empty directory", "run directory", "missing"],
)
def test_rm_refuses_what_is_not_a_checkpoint(tmp_path, capsys, make, fragment):
    target = tmp_path / "x"
    target = make(target) or target
    status, out, err = run(capsys, "rm", str(target), "--yes")
    assert status == 2 and out == "" and len(err) == 1 and fragment in err[0], err


def test_rm_refuses_a_checkpoint_that_holds_directories(tmp_path, capsys):
    ckpt = saved(tmp_path / "c")
    os.mkdir(os.path.join(ckpt, "notes"))
    status, _, err = run(capsys, "rm", ckpt, "--yes")
    assert status == 2 and err == [
        f"rayckpt: error: {ckpt} holds directories ('notes'), which a rayckpt checkpoint never does: nothing "
        "removed; `rayckpt rm` takes one checkpoint directory"
    ]
    assert rayckpt.verify(ckpt).ok


def test_rm_refuses_a_live_lease_and_ignores_a_dead_one(tmp_path, capsys):
    ckpt = saved(tmp_path / "c")
    ckdir = CheckpointDir.resolve(ckpt)
    dead = new_save_id()
    lease.write_lease(ckdir, dead, ttl_s=-1)
    live = "20991231T000000-0a0b0c0d"
    lease.write_lease(ckdir, live)  # this process runs: the lease is live
    status, _, err = run(capsys, "rm", ckpt, "--yes")
    assert status == 1 and len(err) == 1
    assert err[0].startswith(f"rayckpt: error: {ckpt}: a save is writing this checkpoint: save {live} (held by pid ")
    assert "nothing removed" in err[0] and rayckpt.verify(ckpt).ok
    lease.release_lease(ckdir, live)
    report = tools.remove(ckpt)
    assert f"{lease.LEASE_PREFIX}{dead}" in report.files and not os.path.exists(ckpt)


def test_rm_refuses_a_save_that_claims_the_checkpoint_during_the_check(tmp_path, monkeypatch):
    ckpt = saved(tmp_path / "c")
    ckdir = CheckpointDir.resolve(ckpt)
    rival = new_save_id()
    read_id = removal.committed_save_id

    def a_save_starts_now(d):  # called between the lease check and the claim
        lease.write_lease(ckdir, rival)
        return read_id(d)

    monkeypatch.setattr(removal, "committed_save_id", a_save_starts_now)
    with pytest.raises(tools.SaveInFlightError, match=f"a save is writing this checkpoint: save {rival}"):
        tools.remove(ckpt)
    assert rayckpt.verify(ckpt).ok and f"{lease.LEASE_PREFIX}{rival}" in os.listdir(ckpt)


def test_rm_dry_run_and_a_damaged_manifest(tmp_path):
    ckpt = saved(tmp_path / "c")
    with open(os.path.join(ckpt, MANIFEST_NAME), "w") as f:
        f.write("{oops")
    report = tools.remove(os.path.join(ckpt, MANIFEST_NAME), dry_run=True)  # the manifest's path works too
    assert report.dry_run and report.path == ckpt and report.save_id == "(unreadable manifest)"
    assert report.files[0] == MANIFEST_NAME and sorted(report.files) == sorted(os.listdir(ckpt))
    assert report.bytes == sum(os.path.getsize(os.path.join(ckpt, n)) for n in report.files)
    tools.remove(ckpt)  # a damaged checkpoint is removed like any other
    assert not os.path.exists(ckpt)


# ---------------------------------------------------------------------------
# URIs with a query string


QUERY = "?endpoint_override=h:9000&scheme=http"


@pytest.mark.parametrize(
    "location, rel, joined",
    [
        (f"s3://b/run{QUERY}", "rayckpt-step-1", f"s3://b/run/rayckpt-step-1{QUERY}"),
        (f"s3://b/run/{QUERY}", "x/manifest.json", f"s3://b/run/x/manifest.json{QUERY}"),
        ("s3://b/run", "step-1", "s3://b/run/step-1"),
        ("/data/what?/run", "step-1", "/data/what?/run/step-1"),  # a local path's "?" is a file name character
    ],
)
def test_join_location_keeps_the_query_string_at_the_end(location, rel, joined):
    assert join_location(location, rel) == joined


def test_parent_location_keeps_the_query_string_at_the_end():
    assert parent_location(f"s3://b/run/ck/manifest.json{QUERY}") == f"s3://b/run/ck{QUERY}"
    assert parent_location("/data/run/ck/") == "/data/run"


def test_listing_a_run_at_a_uri_with_a_query_gives_uris_to_paste_back(tmp_path):
    # A local directory standing in for the bucket: the listing code only joins locations.
    saved(tmp_path / "run" / "rayckpt-step-00000003")
    run_dir = CheckpointDir(pafs.LocalFileSystem(), str(tmp_path / "run"), f"s3://b/run{QUERY}")
    (entry,) = scan_run(run_dir, "run")
    assert entry.path == f"s3://b/run/rayckpt-step-00000003{QUERY}" and entry.status == "committed"
    manifest = CheckpointDir(
        pafs.LocalFileSystem(),
        str(tmp_path / "run" / "rayckpt-step-00000003" / MANIFEST_NAME),
        f"s3://b/run/rayckpt-step-00000003/manifest.json{QUERY}",
    )
    assert resolve_checkpoint(manifest).location == f"s3://b/run/rayckpt-step-00000003{QUERY}"


# ---------------------------------------------------------------------------
# --help


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = cli._parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"": parser, **sub.choices}


def test_every_argument_has_help_and_every_command_a_description():
    missing = []
    for name, parser in commands().items():
        assert parser.description, name
        for action in parser._actions:
            if action.help != argparse.SUPPRESS and not action.help:
                missing.append(f"{name or 'rayckpt'} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing


def test_help_shows_the_defaults_worth_showing():
    text = {name: parser.format_help() for name, parser in commands().items()}
    assert "(default: 5GB)" in text["convert"]
    for name, help_text in text.items():
        assert "(default: None)" not in help_text and "(default: False)" not in help_text, name
        assert "(default: )" not in help_text, name
    assert "Remove a committed checkpoint directory" in text["rm"] and "--yes, -y" in text["rm"]


def test_error_messages_name_files_by_uris_a_user_can_paste_back(tmp_path):
    # A shard file that cannot be written, in a checkpoint a user named by a URI with a query string.
    import pyarrow.fs as pafs

    from rayckpt.engine.writer import ShareSpec, write_chunks
    from rayckpt.format.boxes import Box
    from rayckpt.format.shard_file import ChunkData
    from rayckpt.storage.checkpoint_dir import CheckpointDir
    from rayckpt.storage.commit import WrittenFiles

    ckdir = CheckpointDir(pafs.LocalFileSystem(), str(tmp_path / "ck"), "s3://b/run/ck?endpoint_override=h:9000")
    (tmp_path / "ck" / "sid-r00000-float.arrow").mkdir(parents=True)  # a directory where the file goes
    with pytest.raises(rayckpt.SaveFailedError) as info:
        chunk = ChunkData("w", "float32", Box((0,), (2,)), b"\0" * 8)
        write_chunks(WrittenFiles(ckdir, "sid"), [chunk], ShareSpec(rank=0, block_size=64))
    assert "writing shard file s3://b/run/ck/sid-r00000-float.arrow?endpoint_override=h:9000 failed" in str(info.value)
