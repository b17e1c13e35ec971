"""A local S3 endpoint: ``moto_server`` as its own process on a free loopback port.

For the S3 and e2e test tiers (``tests/conftest.py``) and the object-storage benchmark
(``python -m benchmarks.suite --storage s3``). Everything that talks to it goes over HTTP, as
against AWS or MinIO. ``S3_ENV`` holds the dummy credentials and region the
clients (and every process they start) need; the server runs with them too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow.fs as pafs

#: Dummy credentials and region, and nothing read from the user's own AWS configuration.
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

    def delete(self, rel: str) -> None:
        """Remove every object at or under ``rel`` (nothing there is fine)."""
        fs = self.filesystem()
        if fs.get_file_info(self.fs_path(rel)).type != pafs.FileType.NotFound:
            fs.delete_dir(self.fs_path(rel))


@dataclass(frozen=True, slots=True)
class MotoServer:
    """A started server process and the endpoint it serves; ``stop()`` ends it by its pid."""

    proc: subprocess.Popen
    endpoint: S3Endpoint

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(proc: subprocess.Popen, url: str, log_path: str) -> None:
    """Return once ``url`` answers; raise with the server's log if it exits first or stays silent."""
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


def start_moto_server(
    log_path: str,
    bucket: str,
    module: str = "moto.server",
    env: dict[str, str] | None = None,
    args: Sequence[str] = (),
) -> MotoServer:
    """A local S3 endpoint for tests and benchmarks: start ``python -m <module> -H 127.0.0.1 -p <free port> <args>``.

    Waits until the server answers, then creates ``bucket``. Clients need the dummy
    credentials in ``S3_ENV`` (the server gets them). If starting fails, the server
    is stopped before the error is raised.

    Args:
        log_path: Where the server's output (its request log) goes.
        bucket: The bucket to create.
        module: ``moto.server``, or a module that serves moto's app the same way.
        env: Added to this process's environment for the server (``S3_ENV``
            always is).
        args: Further command-line arguments for the server.

    Returns:
        A ``MotoServer``: ``endpoint``, an ``S3Endpoint`` with ``uri(rel)``,
            ``filesystem()``, ``fs_path(rel)``, ``listing``, ``exists``,
            ``delete``; ``stop()`` ends it by its pid.

    Raises:
        RuntimeError: The server exited before serving, or did not answer within
            ``START_TIMEOUT_S``; the message has its log.
    """
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "-H", "127.0.0.1", "-p", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **S3_ENV, **(env or {})},
        )
    try:
        wait_until_serving(proc, f"http://127.0.0.1:{port}/moto-api/", log_path)
        endpoint = S3Endpoint(f"127.0.0.1:{port}", bucket, log_path)
        fs = pafs.S3FileSystem(
            endpoint_override=endpoint.host_port,
            scheme="http",
            access_key=S3_ENV["AWS_ACCESS_KEY_ID"],
            secret_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
            region=S3_ENV["AWS_REGION"],
            allow_bucket_creation=True,
        )
        fs.create_dir(bucket)
    except BaseException:
        MotoServer(proc, S3Endpoint(f"127.0.0.1:{port}", bucket, log_path)).stop()
        raise
    return MotoServer(proc, endpoint)
