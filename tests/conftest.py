"""Shared fixtures: one local Ray session for all in-process Ray tests."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    # address="local": always a Ray of this session's own, never a cluster someone else started on this machine
    ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="rayckpt-tests")
    yield
    ray.shutdown()
