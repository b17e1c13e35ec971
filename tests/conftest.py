"""Shared fixtures: one local Ray session for all in-process Ray tests."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray Train's controller polls its workers this often (default 2 s): how soon it sees a report, a worker
# die, the end of a run. Every TorchTrainer of the suite ends up to one interval late, and the Ray jobs the
# tests start (`ray start --head`, the cluster jobs) inherit this process's environment.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the recovery tier's cluster job (about 3 minutes, mostly waiting for Ray processes to start) as
    soon as the tests are collected: it runs beside the tiers before it, and its tests read what it left."""
    from tests.helpers.cluster_jobs import early_wanted, start_early

    if session.config.option.collectonly or not early_wanted(session.items, "tests/recovery/test_recovery.py"):
        return
    from tests.helpers import recovery_job

    out = session.config._tmp_path_factory.mktemp("recovery")
    start_early("recovery", "tests.helpers.recovery_job", out, env=recovery_job.ENV)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A job started early whose tests never ran (deselected by ``-x`` or an interrupt) is stopped."""
    from tests.helpers.cluster_jobs import stop_early

    stop_early()


@pytest.fixture(scope="session")
def ray_session():
    import ray

    # address="local": always a Ray of this session's own, never a cluster someone else started on this machine
    ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="rayckpt-tests")
    yield
    ray.shutdown()
