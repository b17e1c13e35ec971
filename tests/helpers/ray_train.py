"""Small TorchTrainer runs on a real local Ray (``ray_workers.toy_train_loop`` unless told), and what they left."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from rayckpt.ray.memory.fs import memory_filesystem
from rayckpt.ray.metadata.actor import get_metadata_actor
from rayckpt.train.callback import RayckptCallback
from tests.helpers import ray_workers


def fit(
    storage,
    out,
    workers,
    steps,
    save_at,
    name="toy",
    filesystem=None,
    max_failures=0,
    loop: Callable[[dict[str, Any]], None] = ray_workers.toy_train_loop,
    num_to_keep: int | None = 2,
    datasets: dict[str, Any] | None = None,
    **extra,
) -> Any:
    """Train ``steps`` steps on ``workers`` gloo workers, saving at the steps in ``save_at``, Ray Train
    restarting the group after up to ``max_failures`` failures and keeping ``num_to_keep`` checkpoints
    (None: all); the ``Result``. ``loop`` is the train loop (``toy_train_loop`` unless named); ``datasets``:
    Ray Data datasets for ``ray.train.get_dataset_shard``."""
    trainer = TorchTrainer(
        loop,
        train_loop_config={"steps": steps, "save_at": save_at, "out": str(out), **extra},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo"),
        datasets=datasets,
        run_config=RunConfig(
            name=name,
            storage_path=str(storage),
            storage_filesystem=filesystem,
            callbacks=[RayckptCallback()],
            checkpoint_config=CheckpointConfig(num_to_keep=num_to_keep),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    return trainer.fit()


def memory_steps(run: str) -> list[int]:
    """The steps of ``run``'s committed memory checkpoints, from the MetadataActor's catalog."""
    fs = memory_filesystem()
    entries = ray.get(get_metadata_actor().register_run.remote(f"{run}@memory", f"mem/{run}", fs))
    return [e.step for e in entries if e.status == "committed"]
