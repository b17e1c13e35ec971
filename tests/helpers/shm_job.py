"""Two small TorchTrainer runs in a Ray session of their own, then ``ray.shutdown()``.

Run as ``python -m tests.helpers.shm_job STORAGE OUT`` by tests/faults/test_shm_leak.py:
one run ends normally, one fails (a worker raises after a save), side by side. Every worker writes
what it knows of its staging buffer to OUT; the last stdout line is a JSON summary.
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
import ray.train
from ray.train import CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from rayckpt.engine.app_state import AppState
from rayckpt.ray.rank import async_save
from rayckpt.testing.toy import build_fsdp, train_steps
from rayckpt.train.callback import RayckptCallback
from rayckpt.train.checkpointer import Checkpointer


def train_loop(config: dict[str, Any]) -> None:
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model, optim = build_fsdp(world, seed=0)
    app = AppState(model, optim, step=0)
    state = {"app": app}
    ckpt = Checkpointer()
    ckpt.restore(state)
    for step in (1, 2):
        train_steps(model, optim, 1, rank + 100 * step)
        app.extras["step"] = step
        ckpt.save(step, state, {"loss": float(step)})
        buffer = async_save.saver().buffer
        seen = {
            "run": config["run"],
            "rank": rank,
            "step": step,
            "pid": os.getpid(),
            "name": buffer.name,
            "named": os.path.exists(buffer.name),  # the file has a name in /dev/shm
            "held": os.path.exists(buffer.path),  # and this process holds it
        }
        with open(os.path.join(config["out"], f"{config['run']}-{rank}-{step}.json"), "w") as f:
            json.dump(seen, f)
        if step == config.get("fail_at") and rank == 1:
            raise RuntimeError("injected failure after a save")
    ckpt.wait()


def fit(storage: str, out: str, run: str, **extra: Any) -> None:
    TorchTrainer(
        train_loop,
        train_loop_config={"out": out, "run": run, **extra},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(
            name=run,
            storage_path=storage,
            callbacks=[RayckptCallback()],
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    ).fit()


def main(storage: str, out: str) -> None:
    # address="local": a Ray of its own, never the cluster another process on this machine last started
    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="rayckpt-shm-job")
    with ThreadPoolExecutor(2) as pool:  # the two runs side by side, 2 workers each
        ends = pool.submit(fit, storage, out, "ends")
        fails = pool.submit(fit, storage, out, "fails", fail_at=1)
        ends.result()
        try:
            fails.result()
            failed = None
        except Exception as exc:  # noqa: BLE001 - the failing run is meant to fail
            failed = f"{type(exc).__name__}: {exc}"
    ray.shutdown()
    print(json.dumps({"failed": failed}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
