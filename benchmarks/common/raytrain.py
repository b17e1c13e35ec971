"""The Ray Train set-up the benchmarks share: a new Ray (one local node, or a head and two worker
nodes), one ``TorchTrainer`` on it, and the events and records its workers write."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: The custom resource that keeps training workers on the worker nodes of a two-node cluster.
SLOT = "bench_slot"


@contextmanager
def new_ray(workers: int, *, nodes: int = 1, object_store_mb: int = 1024, logs: bool = False) -> Iterator[Any]:
    """A new Ray for ``workers`` training workers, shut down after the block.

    ``nodes`` 1: a local Ray (never a cluster named by ``RAY_ADDRESS``) of ``workers`` CPUs. ``nodes``
    2: a ``ray.cluster_utils.Cluster``, a head without training resources and two worker nodes of
    ``workers // 2`` CPUs, each its own ``RAYCKPT_SHM_DIR``. Yields each worker's resources and the
    cluster (``None`` for a local Ray).
    """
    import ray

    quiet = {"log_to_driver": logs, "logging_level": logging.WARNING}
    store = object_store_mb * 2**20
    if nodes == 1:
        ray.init(address="local", num_cpus=workers, object_store_memory=store, include_dashboard=False, **quiet)
        try:
            yield {"CPU": 1}, None
        finally:
            ray.shutdown()
        return
    from ray.cluster_utils import Cluster

    from rayckpt.ray.shm import SHM_DIR_ENV

    shm = tempfile.mkdtemp(prefix="rayckpt-bench-", dir="/dev/shm")
    head = {"num_cpus": 1, "object_store_memory": store}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for i in range(2):
            os.makedirs(os.path.join(shm, f"node-{i}"))
            env = {SHM_DIR_ENV: os.path.join(shm, f"node-{i}")}
            per_node = workers // 2
            cluster.add_node(num_cpus=per_node, resources={SLOT: per_node}, object_store_memory=store, env_vars=env)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, **quiet)
        yield {"CPU": 1, SLOT: 1}, cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(shm, ignore_errors=True)


def trainer(loop: Callable, config: dict, workers: Any, storage: str, resources: dict | None = None, **run: Any) -> Any:
    """A ``TorchTrainer`` of ``loop(config)`` on ``workers`` (an int, or (min, max) for elastic) workers,
    with ``resources`` each (a ``GPU``: one GPU each, nccl); ``run``: ``RunConfig`` fields."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    gpu = bool(resources and resources.get("GPU"))
    scaling = ScalingConfig(num_workers=workers, use_gpu=gpu, resources_per_worker=resources)
    run = {"name": f"bench-{time.time_ns()}", **run}
    backend = TorchConfig(backend="nccl" if gpu else "gloo")
    return TorchTrainer(
        loop,
        train_loop_config=config,
        scaling_config=scaling,
        torch_config=backend,
        run_config=RunConfig(storage_path=storage, **run),
    )


def fit(loop: Callable[[dict[str, Any]], None], config: dict[str, Any], workers: int, out: str, logs: bool) -> list:
    """Run ``loop(config)`` on ``workers`` gloo CPU workers of one ``TorchTrainer`` in a new local Ray; the
    records its ranks gave ``gather_records(records, config["result"])``."""
    out = os.path.abspath(out)
    config = {**config, "result": os.path.join(out, f"records-{time.time_ns()}.json")}
    with new_ray(workers, logs=logs):
        trainer(loop, config, workers, os.path.join(out, "storage")).fit()
    with open(config["result"]) as f:
        return json.load(f)


def append_event(path: str, kind: str, **data: Any) -> None:
    """One JSON line ``{"t": time.time(), "kind": kind, ...}``, appended with one write (O_APPEND)."""
    line = json.dumps({"t": time.time(), "kind": kind, **data}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_events(path: str) -> list[dict[str, Any]]:
    """The events of one file, in time order."""
    with open(path) as f:
        return sorted((json.loads(line) for line in f if line.strip()), key=lambda e: e["t"])


def gather_records(records: list[dict[str, Any]], path: str) -> None:
    """Every rank's ``records`` to rank 0, which writes them all to ``path`` (a collective)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump([r for rank in gathered for r in rank], f)
