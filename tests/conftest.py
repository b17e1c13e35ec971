"""Shared fixtures: one local Ray session for all in-process Ray tests."""

from __future__ import annotations

import os

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


@pytest.fixture(scope="session")
def ray_session():
    import ray

    # address="local": always a Ray of this session's own, never a cluster someone else started on this machine
    ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="rayckpt-tests")
    yield
    ray.shutdown()
