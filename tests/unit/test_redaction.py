"""Credentials in a location are never shown: messages, reports, ``--json`` and events show ``***``.

The end-to-end half runs on the local disk: ``pyarrow.fs.FileSystem.from_uri`` is
wrapped so that ``s3://AKIA:<secret>@bucket/...`` opens ``<tmp>/bucket/...`` and
refuses any other credentials, so a save that works proves the real location
reached storage. tests/s3/test_s3_credentials.py does the same against a real S3
endpoint.
"""

from __future__ import annotations

import json
import pickle
import urllib.parse

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch

import rayckpt
from rayckpt import tools
from rayckpt.cli.commands import main
from rayckpt.errors import CheckpointNotFoundError, RayckptError, describe_error
from rayckpt.redaction import redact, redact_fields, redact_text
from rayckpt.storage.checkpoint_dir import CheckpointDir

SECRET = "s3cr3t-Value"
KEY = "AKIAEXAMPLE"


@pytest.mark.parametrize(
    "location, shown",
    [
        ("/data/ckpt", "/data/ckpt"),
        ("/data/user:pw@host/ckpt", "/data/user:pw@host/ckpt"),  # a local path: a file name, not a URI
        ("s3://bucket/run", "s3://bucket/run"),
        ("s3://bucket/run@v1", "s3://bucket/run@v1"),
        (f"s3://{KEY}:{SECRET}@bucket", f"s3://{KEY}:***@bucket"),
        (
            f"s3://{KEY}:{SECRET}@bucket/run?endpoint_override=h:9000&scheme=http",
            f"s3://{KEY}:***@bucket/run?endpoint_override=h:9000&scheme=http",
        ),
        (f"s3://{KEY}:se%2Fcr%40et@bucket/run@v1", f"s3://{KEY}:***@bucket/run@v1"),  # percent-encoded
        (f"s3://{KEY}:se/cr@et@bucket/run", f"s3://{KEY}:***@bucket/run"),  # raw "/" and "@" in the secret
        ("s3://TOKEN@bucket/run", "s3://***@bucket/run"),  # user info without ":": all of it
        (
            "s3://bucket/run?access_key=AK&secret_key=SK&session_token=T&region=us-east-1",
            "s3://bucket/run?access_key=AK&secret_key=***&session_token=***&region=us-east-1",
        ),
        ("gs://bucket/run?scheme=http#part", "gs://bucket/run?scheme=http#part"),
    ],
)
def test_redact_hides_the_secret_and_keeps_the_rest(location, shown):
    assert redact(location) == shown
    assert redact(shown) == shown


def test_redact_text_redacts_every_uri_in_a_message():
    uri = f"s3://{KEY}:{SECRET}@b/x?secret_key={SECRET}"
    text = f"cannot open {uri!r}: refused (tried s3://{KEY}:{SECRET}@b/y, /local/path)"
    assert redact_text(text) == (
        f"cannot open 's3://{KEY}:***@b/x?secret_key=***': refused (tried s3://{KEY}:***@b/y, /local/path)"
    )
    assert redact_fields({"location": uri, "step": 5}) == {"location": f"s3://{KEY}:***@b/x?secret_key=***", "step": 5}


def test_rayckpt_errors_and_error_descriptions_carry_no_secret():
    uri = f"s3://{KEY}:{SECRET}@bucket/run"
    err = CheckpointNotFoundError(f"no manifest.json in {uri}: not a committed checkpoint")
    assert str(err) == f"no manifest.json in s3://{KEY}:***@bucket/run: not a committed checkpoint"
    assert str(pickle.loads(pickle.dumps(err))) == str(err)  # crosses actors redacted
    assert SECRET not in describe_error(OSError(f"PUT {uri} failed"))


def test_resolving_a_bad_uri_names_it_redacted():
    with pytest.raises(RayckptError) as info:
        CheckpointDir.resolve(f"s3://{KEY}:{SECRET}@bucket/run?bogus=1")
    msg = str(info.value)
    assert msg.startswith(f"cannot open checkpoint location 's3://{KEY}:***@bucket/run?bogus=1': ")
    assert SECRET not in msg


class _LocalS3:
    """``pyarrow.fs`` as ``checkpoint_dir`` sees it, but ``s3://`` URIs open the local disk under ``root``."""

    def __init__(self, root) -> None:
        self.FileSystem = type("FileSystem", (), {"from_uri": staticmethod(self.from_uri)})
        self.root = root

    def __getattr__(self, name):
        return getattr(pafs, name)

    def from_uri(self, uri):
        parts = urllib.parse.urlsplit(uri)
        if parts.scheme != "s3":
            return pafs.FileSystem.from_uri(uri)
        if (parts.username, parts.password) != (KEY, SECRET):  # only the real credentials open it
            raise pa.ArrowInvalid("access denied: wrong credentials")
        return pafs.LocalFileSystem(), f"{self.root}/{parts.hostname}{parts.path}"


@pytest.fixture
def fake_s3(tmp_path, monkeypatch):
    """``s3://AKIA:<SECRET>@bucket/<path>`` opens ``<tmp_path>/bucket/<path>`` on the local disk."""
    from rayckpt.storage import checkpoint_dir

    monkeypatch.setattr(checkpoint_dir, "pafs", _LocalS3(tmp_path))
    (tmp_path / "bucket").mkdir()
    return lambda rel: f"s3://{KEY}:{SECRET}@bucket/{rel}?endpoint_override=127.0.0.1:9000"


def test_checkpoint_dir_shows_the_redacted_location_and_opens_the_given_one(fake_s3):
    ckdir = CheckpointDir.resolve(fake_s3("runs"))
    assert ckdir.uri == fake_s3("runs")
    assert ckdir.location == f"s3://{KEY}:***@bucket/runs?endpoint_override=127.0.0.1:9000"
    child = ckdir.child("a")
    assert child.uri == fake_s3("runs/a") and child.location == redact(fake_s3("runs/a"))
    assert child.parent().uri == fake_s3("runs")


def json_out(capsys, *argv: str) -> str:
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    json.loads(out)
    return out


def test_a_credentialed_location_works_and_is_shown_redacted_everywhere(fake_s3, capsys):
    state = {"w": torch.arange(6.0), "step": 3}
    ckpt = fake_s3("runs/r/rayckpt-step-00000003")
    shown = redact(ckpt)
    assert rayckpt.save(state, ckpt).path == shown  # what save and load return is shown, not a handle
    target = {"w": torch.zeros(6), "step": 0}
    assert rayckpt.load(target, ckpt).path == shown
    assert torch.equal(target["w"], state["w"]) and target["step"] == 3
    assert rayckpt.read_manifest(ckpt).world_size == 1
    assert rayckpt.verify(ckpt).path == shown and rayckpt.inspect(ckpt).path == shown
    # A catalog entry is a handle: its path reopens the checkpoint, so it keeps the credentials ...
    (entry,) = tools.ls(fake_s3("runs"))
    assert entry.path == ckpt and rayckpt.read_manifest(entry.path).world_size == 1
    # ... and the command shows it redacted, as text and as JSON.
    outputs = [json_out(capsys, "ls", fake_s3("runs"))]
    assert main(["ls", fake_s3("runs")]) == 0
    outputs.append(capsys.readouterr().out)
    for argv in (["inspect", ckpt], ["verify", ckpt], ["plan", ckpt, "-n", "2"], ["gc", fake_s3("runs")]):
        outputs.append(json_out(capsys, *argv))
        assert main(argv) == 0
        outputs.append(capsys.readouterr().out)
    outputs.append(json_out(capsys, "rm", ckpt, "--yes"))
    for out in outputs:
        assert SECRET not in out
    assert f"s3://{KEY}:***@bucket/runs/r/rayckpt-step-00000003" in outputs[0]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["inspect", "{missing}"], "rayckpt: error: s3://AKIAEXAMPLE:***@bucket/none?endpoint_override="),
        (["verify", "{missing}"], "s3://AKIAEXAMPLE:***@bucket/none?"),
        (["ls", "{missing}"], "s3://AKIAEXAMPLE:***@bucket/none?endpoint_override=127.0.0.1:9000: no such directory"),
        (["inspect", "s3://AKIAEXAMPLE:wrong-s3cr3t-Value@bucket/x"], "cannot open checkpoint location"),
    ],
)
def test_command_errors_on_a_credentialed_location_are_one_line_without_the_secret(fake_s3, capsys, argv, fragment):
    argv = [a.format(missing=fake_s3("none")) for a in argv]
    assert main(argv) != 0
    captured = capsys.readouterr()
    assert fragment in captured.err and SECRET not in captured.err + captured.out
    assert captured.err.count("\n") == 1


def test_api_errors_on_a_credentialed_location_name_it_redacted(fake_s3):
    ckpt = fake_s3("runs/c")
    with pytest.raises(CheckpointNotFoundError) as info:
        rayckpt.load({"w": torch.zeros(2)}, ckpt)
    assert str(info.value) == f"no manifest.json in {redact(ckpt)}: not a committed checkpoint"
    rayckpt.save({"w": torch.ones(2)}, ckpt)
    with pytest.raises(rayckpt.CheckpointExistsError) as info:
        rayckpt.save({"w": torch.ones(2)}, ckpt, overwrite=False)
    assert str(info.value).startswith(f"{redact(ckpt)} already holds a committed checkpoint and overwrite=False")
    with pytest.raises(rayckpt.IncompatibleStateError) as info:
        rayckpt.load({"w": torch.zeros(3)}, ckpt)
    assert SECRET not in str(info.value)
