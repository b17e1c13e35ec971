"""Credentials in an ``s3://KEY:SECRET@bucket/...`` URI, on a real S3 endpoint: the location works for
saves and loads, in this process and through the Ray actors, and is shown with the secret redacted in
messages, ``--json`` output and MetadataActor events. (moto does not check the secret: that the
location as given reaches storage is tests/unit/test_redaction.py's fake, which does.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import rayckpt
from rayckpt.examples.job_checks import JobConfigError, check_storage
from rayckpt.redaction import redact
from rayckpt.testing.s3_server import S3_ENV

pytestmark = pytest.mark.slow

SECRET = "uri-s3cr3t-value"


def credentialed(s3_server, rel: str) -> str:
    """``s3_server.uri(rel)`` with the access key and a secret in the user info."""
    return s3_server.uri(rel).replace("s3://", f"s3://{S3_ENV['AWS_ACCESS_KEY_ID']}:{SECRET}@", 1)


def rayckpt_cmd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rayckpt", *args], capture_output=True, text=True, timeout=120)


def test_a_credentialed_s3_location_saves_loads_and_is_shown_redacted(s3_server, s3_prefix):
    storage = credentialed(s3_server, f"{s3_prefix}/runs")
    ckpt = credentialed(s3_server, f"{s3_prefix}/runs/r/rayckpt-step-00000001")
    state = {"w": torch.arange(8.0), "step": 1}
    assert rayckpt.save(state, ckpt).path == redact(ckpt)
    target = {"w": torch.zeros(8), "step": 0}
    rayckpt.load(target, ckpt)
    assert torch.equal(target["w"], state["w"]) and target["step"] == 1
    assert s3_server.exists(f"{s3_prefix}/runs/r/rayckpt-step-00000001/manifest.json")

    listed = rayckpt_cmd("ls", storage, "--json")
    assert listed.returncode == 0, listed.stderr
    assert [e["path"] for e in json.loads(listed.stdout)] == [redact(ckpt)]
    verified = rayckpt_cmd("verify", ckpt)
    assert verified.returncode == 0 and verified.stdout.startswith(f"ok: {redact(ckpt)}: "), verified.stdout
    missing = rayckpt_cmd("inspect", credentialed(s3_server, f"{s3_prefix}/none"))
    assert missing.returncode == 2
    assert missing.stderr.startswith(f"rayckpt: error: {redact(credentialed(s3_server, f'{s3_prefix}/none'))}")
    for out in (listed, verified, missing):
        assert SECRET not in out.stdout + out.stderr


def test_the_jobs_storage_check_names_a_credentialed_uri_redacted(s3_server):
    missing = credentialed(s3_server, "runs").replace(s3_server.bucket, "no-such-bucket", 1)
    with pytest.raises(JobConfigError) as info:
        check_storage(missing)
    assert str(info.value).startswith(f"--storage-path {redact(missing)}: bucket 'no-such-bucket' does not exist")
    assert SECRET not in str(info.value)


def test_ray_actors_open_a_credentialed_location_and_its_events_show_it_redacted(ray_session, s3_server, s3_prefix):
    import ray

    from rayckpt.ray.metadata.actor import get_metadata_actor
    from rayckpt.ray.rank import async_save
    from rayckpt.ray.rank.loading import load as ray_load

    ckpt = credentialed(s3_server, f"{s3_prefix}/ray/rayckpt-step-00000002")
    entry = async_save.save_async({"w": torch.ones(16), "step": 2}, ckpt, run="creds", step=2).wait()
    assert entry.status == "committed" and entry.path == ckpt  # a handle: it reopens the checkpoint
    target = {"w": torch.zeros(16), "step": 0}
    ray_load(target, entry.path, run="creds")
    assert torch.equal(target["w"], torch.ones(16)) and target["step"] == 2
    events = ray.get(get_metadata_actor().events.remote("creds"))
    assert [e["location"] for e in events if e["kind"] == "committed"] == [redact(ckpt)]
    assert SECRET not in json.dumps(events)
