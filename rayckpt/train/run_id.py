"""Which ``TorchTrainer.fit()`` a worker group belongs to: the key the ``Checkpointer`` counts restarts by."""

from __future__ import annotations

import ray


def attempt_key(run: str) -> str:
    """What identifies one ``TorchTrainer.fit()`` across its restarts: Ray Train's run id (each ``fit`` has
    its own), else the Ray job and the run's name."""
    try:  # Ray Train has no public run id: its internal context is the one place that has it (a test guards it)
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().train_run_context.run_id
    except Exception:  # noqa: BLE001 - an internal API: any change in it falls back to the job's id
        return f"{ray.get_runtime_context().get_job_id()}/{run}"
