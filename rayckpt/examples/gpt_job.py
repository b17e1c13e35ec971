"""The main job: a small GPT trained with FSDP2 on a Ray ``TorchTrainer``, checkpointed by rayckpt.

``python jobs/train.py`` starts a local Ray; under ``ray job submit`` the same
script joins the cluster (``ray.init()`` picks up ``RAY_ADDRESS``). ``--resume``
continues the run's latest committed checkpoint with any ``--num-workers``: the
global batch of a step is fixed and split evenly across workers, so a resumed
run follows the same trajectory as one that never stopped.

The loop itself (``train``) needs only a process group, so tests run it on plain
gloo processes with a stand-in checkpointer; ``train_loop_per_worker`` is the Ray
Train wrapper around it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..engine.app_state import AppState
from ..storage.checkpoint_dir import CheckpointDir
from .gpt import GPT, GPTConfig, shard_model, synthetic_batch

#: The fraction of the steps spent warming the learning rate up, and the floor of the cosine decay.
WARMUP_FRACTION = 0.1
MIN_LR_RATIO = 0.1


class CheckpointerLike(Protocol):
    """What the loop needs of ``rayckpt.train.Checkpointer`` (tests pass a stand-in)."""

    def restore(self, state: dict[str, Any]) -> int | None: ...

    def save(self, step: int, state: dict[str, Any], metrics: dict[str, Any]) -> Any: ...

    def wait(self) -> None: ...


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    defaults = GPTConfig()
    p = argparse.ArgumentParser(description="Train a small GPT with FSDP2 on Ray Train, checkpointed by rayckpt.")
    p.add_argument("--num-workers", type=int, default=4, help="Ray Train workers (ranks)")
    p.add_argument("--steps", type=int, default=20, help="total steps to reach (a resumed run continues to it)")
    p.add_argument("--checkpoint-every", type=int, default=5, help="save every K steps and at the last step")
    p.add_argument("--storage-path", default="./checkpoints", help="run storage: a directory or a URI (s3://...)")
    p.add_argument("--run-name", default="gpt-demo")
    p.add_argument(
        "--resume", action="store_true", help="continue the run's latest committed checkpoint, with any worker count"
    )
    p.add_argument("--gpus", action="store_true", help="one GPU per worker with nccl (default: CPU with gloo)")
    p.add_argument(
        "--cpus-per-worker",
        type=float,
        default=None,
        help="CPUs each worker reserves (default: 1 for CPU training, less when the cluster has fewer CPUs than "
        "workers; none with --gpus)",
    )
    p.add_argument("--d-model", type=int, default=defaults.d_model)
    p.add_argument("--n-layers", type=int, default=defaults.n_layers)
    p.add_argument("--n-heads", type=int, default=defaults.n_heads)
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    p.add_argument("--d-ff", type=int, default=None, help="MLP width (default: 4 * d-model)")
    p.add_argument(
        "--global-batch", type=int, default=12, help="samples per step over all workers; a multiple of --num-workers"
    )
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (linear warmup, cosine decay)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for flag in ("num_workers", "steps", "checkpoint_every", "global_batch"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.global_batch % args.num_workers:
        p.error(
            f"--global-batch {args.global_batch} is not divisible by --num-workers {args.num_workers}: "
            "every worker needs the same number of samples"
        )
    if "://" not in args.storage_path:
        args.storage_path = os.path.abspath(args.storage_path)
    return args


def train_config(args: argparse.Namespace) -> dict[str, Any]:
    """The plain dict ``train_loop_per_worker`` gets (Ray ships it to every worker)."""
    return {
        "model": {
            "vocab_size": args.vocab_size,
            "seq_len": args.seq_len,
            "d_model": args.d_model,
            "n_layers": args.n_layers,
            "n_heads": args.n_heads,
            "d_ff": args.d_ff or 4 * args.d_model,
        },
        "steps": args.steps,
        "checkpoint_every": args.checkpoint_every,
        "global_batch": args.global_batch,
        "lr": args.lr,
        "seed": args.seed,
        "resume": args.resume,
        "gpus": args.gpus,
    }


def worker_resources(args: argparse.Namespace, cluster_cpus: float) -> dict[str, float] | None:
    """``ScalingConfig.resources_per_worker``: ``None`` keeps Ray's default (1 CPU, or 1 GPU with ``--gpus``).

    CPU training with more workers than the cluster has CPUs (4 workers on a
    2-core laptop) shares the CPUs instead of waiting forever for more.
    """
    if args.cpus_per_worker is not None:
        return {"CPU": args.cpus_per_worker}
    if not args.gpus and 0 < cluster_cpus < args.num_workers:
        return {"CPU": cluster_cpus / args.num_workers}
    return None


def warmup_cosine(total_steps: int) -> Callable[[int], float]:
    """LR factor for ``LambdaLR``: linear warmup, then cosine decay to ``MIN_LR_RATIO``.

    A plain function, not a callable object, so the scheduler's state dict does not
    carry it: a resumed run with a new ``--steps`` gets the schedule for the new total.
    """
    warmup = max(1, round(WARMUP_FRACTION * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train(
    config: dict[str, Any],
    rank: int,
    world_size: int,
    checkpointer: CheckpointerLike,
    device: torch.device | None = None,
) -> list[dict[str, float]]:
    """Run on every rank of an initialized process group: build, shard, restore, train, save.

    Trains from the restored step (0 on a fresh run) to ``config["steps"]``. Returns
    the history ``[{"step", "loss", "seconds"}]`` of the steps run here; ``loss`` is the
    global batch's mean, the same on every rank.
    """
    from torch.distributed.device_mesh import init_device_mesh

    device = device or torch.device("cpu")
    cfg = GPTConfig(**config["model"])
    total, every, seed = config["steps"], config["checkpoint_every"], config["seed"]

    torch.manual_seed(seed)  # the same initial weights on every rank, whatever the world size
    model = shard_model(GPT(cfg).to(device), init_device_mesh(device.type, (world_size,)))
    optim = torch.optim.AdamW(model.parameters(), lr=config["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    lr_factor = warmup_cosine(total)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_factor)
    app = AppState(model, optim, scheduler=sched, step=0)
    state = {"app": app}

    resumed_from = checkpointer.restore(state) if config["resume"] else None
    start = resumed_from or 0
    if resumed_from is not None:
        # The restored LR follows the saved run's schedule; a new --steps changes it from here on.
        for group, base_lr in zip(optim.param_groups, sched.base_lrs):
            group["lr"] = base_lr * lr_factor(sched.last_epoch)
    if rank == 0:
        where = f"resumed from step {resumed_from}" if resumed_from is not None else "fresh start"
        log(f"GPT with {model_size(model):,} parameters on {world_size} rank(s), {where}")

    history: list[dict[str, float]] = []
    pending: list[float] = []
    for step in range(start, total):
        began = time.perf_counter()
        torch.manual_seed(seed + step)
        inputs, targets = synthetic_batch(step, config["global_batch"], cfg.seq_len, cfg.vocab_size, rank, world_size)
        loss = model.loss(inputs.to(device), targets.to(device))
        loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        global_loss = mean_across_ranks(loss.detach(), world_size)
        done = step + 1
        history.append({"step": done, "loss": global_loss, "seconds": time.perf_counter() - began})
        pending.append(global_loss)
        if rank == 0:
            log(f"step {done}/{total} loss {global_loss:.4f} ({history[-1]['seconds']:.2f}s)")
        if done % every == 0 or done == total:
            app.extras["step"] = done
            metrics: dict[str, Any] = {"loss": global_loss, "step": done, "losses": pending}
            if resumed_from is not None:
                metrics["resumed_from"] = resumed_from
            checkpointer.save(done, state, metrics=metrics)
            pending = []
    checkpointer.wait()
    return history


def train_loop_per_worker(config: dict[str, Any]) -> list[dict[str, float]]:
    """What ``TorchTrainer`` runs on each worker: ``train`` with rayckpt's Ray Train checkpointer."""
    import ray.train
    import ray.train.torch

    from ..train.checkpointer import Checkpointer

    context = ray.train.get_context()
    device = torch.device("cpu")
    if config["gpus"]:
        device = ray.train.torch.get_device()
        torch.cuda.set_device(device)
    # A Ray-driven restart after a worker failure restores even without --resume.
    resume = config["resume"] or ray.train.get_checkpoint() is not None
    return train(
        {**config, "resume": resume}, context.get_world_rank(), context.get_world_size(), Checkpointer(), device
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Fit the ``TorchTrainer`` (on the cluster in ``RAY_ADDRESS``, else a local Ray); return the summary.

    A fresh run refuses a run directory that already holds checkpoints, which Ray
    would silently pick up: pass ``--resume`` or a new ``--run-name``.
    """
    import ray
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from ..train.callback import RayckptCallback

    run_dir = CheckpointDir.resolve(args.storage_path).child(args.run_name)
    if not args.resume and (run_dir.list_files() or run_dir.list_dirs()):
        raise FileExistsError(
            f"run {args.run_name!r} already exists at {run_dir.location}: pass --resume to continue it, "
            "or choose another --run-name"
        )
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init()
    try:
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config=train_config(args),
            scaling_config=ScalingConfig(
                num_workers=args.num_workers,
                use_gpu=args.gpus,
                resources_per_worker=worker_resources(args, ray.cluster_resources().get("CPU", 0)),
            ),
            torch_config=TorchConfig(backend="nccl" if args.gpus else "gloo"),
            run_config=RunConfig(
                name=args.run_name,
                storage_path=args.storage_path,
                callbacks=[RayckptCallback()],
                checkpoint_config=CheckpointConfig(num_to_keep=3),
            ),
        )
        result = trainer.fit()
    finally:
        # Stop forwarding worker logs before the caller prints the summary.
        if started_ray:
            ray.shutdown()
    metrics = result.metrics or {}
    return {
        "run": args.run_name,
        "final_step": metrics.get("step"),
        "final_loss": metrics.get("loss"),
        "last_checkpoint": result.checkpoint.path if result.checkpoint is not None else None,
        "num_workers": args.num_workers,
        "resumed_from": metrics.get("resumed_from"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, train, print the summary as one JSON object on the last line of stdout."""
    try:
        summary = run(parse_args(argv))
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary), flush=True)
    return 0


def mean_across_ranks(value: torch.Tensor, world_size: int) -> float:
    """The mean of a scalar over ranks (gloo has no AVG reduce op)."""
    if world_size > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= world_size
    return value.item()


def model_size(model: torch.nn.Module) -> int:
    """Global parameter count of a possibly sharded model (DTensor ``numel`` is the global size)."""
    return sum(p.numel() for p in model.parameters())


def log(message: str) -> None:
    # stderr, since stdout's last line is the job's JSON summary; written directly because
    # Ray Train's patched ``print`` would log the line twice.
    sys.stderr.write(f"[rayckpt.train_job] {message}\n")
    sys.stderr.flush()
