"""Running a loop on N ranks under Ray Train: a local Ray, a ``TorchTrainer`` of N gloo CPU workers, and
each worker's records gathered to one JSON file (rank 0 writes it)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

#: The local Ray both overlap benchmarks run in: the ranks' CPUs and an object store kept small
#: (saves stage in ``/dev/shm``, not the object store).
OBJECT_STORE_BYTES = 2**30


def init_ray(num_cpus: int, logs: bool = False) -> None:
    """A new local Ray (never a cluster named by ``RAY_ADDRESS``), quiet unless ``logs``."""
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        log_to_driver=logs,
        logging_level=logging.WARNING,
    )


def fit(loop: Callable[[dict[str, Any]], None], config: dict[str, Any], workers: int, out: str, logs: bool) -> None:
    """Run ``loop(config)`` on ``workers`` gloo CPU workers of one ``TorchTrainer`` in a new local Ray."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    init_ray(workers, logs)
    try:
        TorchTrainer(
            loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
            run_config=RunConfig(storage_path=os.path.join(os.path.abspath(out), "storage"), name=f"{time.time_ns()}"),
        ).fit()
    finally:
        ray.shutdown()


def gather_records(records: list[dict[str, Any]], path: str) -> None:
    """Every rank's ``records`` to rank 0, which writes them all to ``path`` (a collective)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump([r for rank in gathered for r in rank], f)


def read_records(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return json.load(f)
