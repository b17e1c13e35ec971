"""Shared fixtures: one local Ray session for all in-process Ray tests; a local S3 endpoint (the S3 tier and
the e2e tier's jobs on S3).

The S3 endpoint is ``moto_server`` as its own process on a free loopback port.
Everything the tests do goes over HTTP through ``pyarrow.fs.S3FileSystem``, as
against AWS or MinIO; nothing in boto or pyarrow is mocked. The server is
started by ``rayckpt.testing.s3_server`` (shared with ``python -m benchmarks.suite --storage s3``).
Dummy credentials and region go into the standard AWS variables for the whole
session (restored afterwards), so child processes (gloo ranks, CLI subprocesses, Ray heads)
inherit them and the user's own AWS configuration is never read.
"""

from __future__ import annotations

import os
import uuid

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray Train's controller polls its workers this often (default 2 s): how soon it sees a report, a worker
# die, the end of a run. Every TorchTrainer of the suite ends up to one interval late, and the Ray jobs the
# tests start (`ray start --head`, the cluster jobs) inherit this process's environment.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# Ray Train's preemption watcher (default on) is an actor per TorchTrainer run, polling for nodes being
# drained: one more process importing Ray Train (1.3-1.5 s of imports each, measured with -X importtime).
# No test drains a node. Off, a run starts one process fewer; the suite's time moved within its noise.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

#: The S3 tests' bucket.
BUCKET = "rayckpt-tests"


@pytest.fixture(scope="session")
def ray_session():
    import ray

    # address="local": always a Ray of this session's own, never a cluster someone else started on this machine
    ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="rayckpt-tests")
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def s3_env():
    """The dummy AWS variables, set for the session and restored afterwards."""
    from rayckpt.testing.s3_server import S3_ENV

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
    from rayckpt.testing.s3_server import start_moto_server

    server = start_moto_server(str(tmp_path_factory.mktemp("moto") / "server.log"), BUCKET, env=s3_env)
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture
def s3_prefix(s3_server) -> str:
    """A fresh key prefix in the bucket for one test."""
    return f"t-{uuid.uuid4().hex[:8]}"
