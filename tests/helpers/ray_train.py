"""A small TorchTrainer run of ``ray_workers.toy_train_loop`` (tests on a real local Ray)."""

from __future__ import annotations

from typing import Any

from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from rayckpt.train.callback import RayckptCallback
from tests.helpers import ray_workers


def fit(storage, out, workers, steps, save_at, name="toy", filesystem=None, max_failures=0, **extra) -> Any:
    """Train ``steps`` steps on ``workers`` gloo workers, saving at the steps in ``save_at``, Ray Train
    restarting the group after up to ``max_failures`` failures; the ``Result``."""
    trainer = TorchTrainer(
        ray_workers.toy_train_loop,
        train_loop_config={"steps": steps, "save_at": save_at, "out": str(out), **extra},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(
            name=name,
            storage_path=str(storage),
            storage_filesystem=filesystem,
            callbacks=[RayckptCallback()],
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    return trainer.fit()
