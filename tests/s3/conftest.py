"""A real S3 endpoint for the S3 tier: ``moto_server`` as its own process on a free loopback port.

Everything the tests do goes over HTTP through ``pyarrow.fs.S3FileSystem``, as
against AWS or MinIO; nothing in boto or pyarrow is mocked. Dummy credentials
and region go into the standard AWS variables for the whole session (restored
afterwards), so child processes (gloo ranks, CLI subprocesses) inherit them and
the user's own AWS configuration is never read.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass

import pyarrow.fs as pafs
import pytest

BUCKET = "rayckpt-tests"
#: The environment every S3 test (and every process it starts) runs with.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata probe (it can hang off EC2)
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
START_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class S3Endpoint:
    """The running server and its bucket."""

    host_port: str
    bucket: str
    #: The server's request log (one line per HTTP request: method and path).
    log_path: str

    def uri(self, rel: str) -> str:
        """``s3://<bucket>/<rel>`` with the endpoint in the query string (what a user types)."""
        return f"s3://{self.bucket}/{rel.strip('/')}?endpoint_override={self.host_port}&scheme=http"

    def filesystem(self) -> pafs.S3FileSystem:
        """A ``pyarrow.fs`` object for the same endpoint, credentials and region in it (it pickles with them:
        processes that lack the AWS variables, such as Ray workers started earlier, can use it)."""
        return pafs.S3FileSystem(
            endpoint_override=self.host_port,
            scheme="http",
            access_key=S3_ENV["AWS_ACCESS_KEY_ID"],
            secret_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
            region=S3_ENV["AWS_REGION"],
        )

    def fs_path(self, rel: str) -> str:
        """``<bucket>/<rel>``: the path on ``filesystem()``."""
        return f"{self.bucket}/{rel.strip('/')}"

    def listing(self, rel: str) -> list[str]:
        """The names of the objects directly under ``rel`` (no "directories"), sorted."""
        infos = self.filesystem().get_file_info(pafs.FileSelector(self.fs_path(rel), allow_not_found=True))
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)

    def exists(self, rel: str) -> bool:
        """Whether any object is at or under ``rel``."""
        return self.filesystem().get_file_info(self.fs_path(rel)).type != pafs.FileType.NotFound


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_serving(proc: subprocess.Popen, url: str, log_path: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            with open(log_path) as f:
                raise RuntimeError(f"moto_server exited with code {proc.returncode} before serving:\n{f.read()}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not answer on {url} within {START_TIMEOUT_S}s") from None
            time.sleep(0.1)


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
    log_path = str(tmp_path_factory.mktemp("moto") / "server.log")
    port = _free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **s3_env},
        )
    try:
        _wait_until_serving(proc, f"http://127.0.0.1:{port}/moto-api/", log_path)
        endpoint = S3Endpoint(f"127.0.0.1:{port}", BUCKET, log_path)
        fs = pafs.S3FileSystem(
            endpoint_override=endpoint.host_port, scheme="http", region="us-east-1", allow_bucket_creation=True
        )
        fs.create_dir(BUCKET)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3_prefix(s3_server) -> str:
    """A fresh key prefix in the bucket for one test."""
    return f"t-{uuid.uuid4().hex[:8]}"
