"""A real S3 endpoint for the S3 tier: ``moto_server`` as its own process on a free loopback port.

Everything the tests do goes over HTTP through ``pyarrow.fs.S3FileSystem``, as
against AWS or MinIO; nothing in boto or pyarrow is mocked. The server is
started by ``rayckpt.testing.s3_server`` (shared with ``python -m benchmarks.suite --storage s3``).
Dummy credentials and region go into the standard AWS variables for the whole
session (restored afterwards), so child processes (gloo ranks, CLI subprocesses)
inherit them and the user's own AWS configuration is never read.
"""

from __future__ import annotations

import os
import uuid

import pytest

from rayckpt.testing.s3_server import S3_ENV, start_moto_server

BUCKET = "rayckpt-tests"


@pytest.fixture(scope="session")
def s3_env():
    """The dummy AWS variables, set for the session and restored afterwards."""
    saved = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)
    yield dict(S3_ENV)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def s3_server(s3_env, tmp_path_factory):
    """A ``moto_server`` process serving S3 on 127.0.0.1:<free port> with the test bucket; stopped by pid."""
    server = start_moto_server(str(tmp_path_factory.mktemp("moto") / "server.log"), BUCKET, env=s3_env)
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture
def s3_prefix(s3_server) -> str:
    """A fresh key prefix in the bucket for one test."""
    return f"t-{uuid.uuid4().hex[:8]}"
