"""The main job: a small GPT trained with FSDP2 on a Ray ``TorchTrainer``, checkpointed by rayckpt.

``python jobs/train.py`` joins the Ray cluster ``--address`` names (default: Ray's
own resolution: ``RAY_ADDRESS``, else the cluster last started on this machine
with ``ray start``, else a new local Ray; ``rayckpt.ray.joining`` finds a dead
address out in seconds). ``--resume`` continues the run's latest
committed checkpoint with any ``--num-workers``: the global batch of a step is
fixed and split evenly across workers, and the LR schedule's horizon is stored in
the checkpoint, so a resumed run follows the same trajectory as one that never
stopped. Flags, the run to resume and the cluster's resources are checked
(``job_checks``) before anything starts.

The loop itself (``train``) needs only a process group, so tests run it on plain
gloo processes with a stand-in checkpointer; ``train_loop_per_worker`` is the Ray
Train wrapper around it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..engine.app_state import AppState
from .corpus import Batches, corpus_loader
from .gpt import GPT, GPTConfig, per_rank_batch, shard_model, synthetic_batch
from .job_checks import (
    JobConfigError,
    check_resources,
    check_resume,
    check_shared_storage,
    check_storage,
    worker_resources,
)
from .job_flags import parse_args, workers_asked

__all__ = [
    "main",
    "parse_args",
    "restart_line",
    "run",
    "train",
    "train_config",
    "warmup_cosine",
    "worker_resources",
    "workers_asked",
]

#: The fraction of the steps spent warming the learning rate up, and the floor of the cosine decay.
WARMUP_FRACTION = 0.1
MIN_LR_RATIO = 0.1


class CheckpointerLike(Protocol):
    """What the loop needs of ``rayckpt.train.Checkpointer`` (tests pass a stand-in)."""

    #: The user metadata of the checkpoint the last ``restore`` loaded (``{}`` when none).
    restored_metadata: dict[str, Any]

    def restore(self, state: dict[str, Any], data: Any = None) -> int | None: ...

    def save(
        self,
        step: int,
        state: dict[str, Any],
        metrics: dict[str, Any],
        metadata: dict[str, Any] | None = None,
        data: Any = None,
    ) -> Any: ...

    def wait(self) -> None: ...


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
        "schedule_steps": args.schedule_steps,
        "checkpoint_every": args.checkpoint_every,
        "memory_every": args.memory_every,
        "full_every": args.full_every,
        "global_batch": args.global_batch,
        "lr": args.lr,
        "seed": args.seed,
        "resume": args.resume,
        "gpus": args.gpus,
        "data": args.data,
        "epoch_samples": args.epoch_samples,
        "sample_log": args.sample_log,
    }


def warmup_cosine(total_steps: int) -> Callable[[int], float]:
    """LR factor for ``LambdaLR``: linear warmup, then cosine decay to ``MIN_LR_RATIO``.

    A plain function, not a callable object, so the scheduler's state dict does not
    carry it: the horizon is stored in the checkpoint's user metadata instead (``train``).
    Past ``total_steps`` the factor stays at ``MIN_LR_RATIO``.
    """
    warmup = max(1, round(WARMUP_FRACTION * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def run_hparams(config: dict[str, Any], schedule_steps: int) -> dict[str, Any]:
    """What a checkpoint stores of the run (user metadata ``"hparams"``): the schedule and the run's shape."""
    return {
        "schedule_steps": schedule_steps,
        "warmup_steps": max(1, round(WARMUP_FRACTION * schedule_steps)),
        "lr": config["lr"],
        "global_batch": config["global_batch"],
        "seed": config["seed"],
        "model": dict(config["model"]),
    }


def train(
    config: dict[str, Any],
    rank: int,
    world_size: int,
    checkpointer: CheckpointerLike,
    device: torch.device | None = None,
) -> list[dict[str, float]]:
    """Run on every rank of an initialized process group: build, shard, restore, train, save.

    Trains from the restored step (0 on a fresh run) to ``config["steps"]``. Each save
    stores the run's hyperparameters (``run_hparams``) in the checkpoint's user
    metadata under ``"hparams"``; a resumed run keeps the stored LR schedule horizon
    unless ``config["schedule_steps"]`` is set. Returns the history ``[{"step",
    "loss", "lr", "seconds"}]`` of the steps run here (``lr``: the LR that step
    used); ``loss`` is the global batch's mean, the same on every rank.
    """

    device = device or torch.device("cpu")
    cfg = GPTConfig(**config["model"])
    total, every, seed = config["steps"], config["checkpoint_every"], config["seed"]
    in_memory = config.get("memory_every") or 0  # under Ray only: the Checkpointer has a memory tier then

    horizon = config.get("schedule_steps") or total
    model, optim, sched = build_model(config, cfg, world_size, device, horizon)
    app = AppState(model, optim, scheduler=sched, step=0)
    state = {"app": app}

    per_rank = per_rank_batch(config["global_batch"], world_size)  # refused before any step runs
    data = corpus_loader(config, cfg, rank, world_size, per_rank) if config.get("data") == "corpus" else None
    resumed_from = checkpointer.restore(state, data=data) if config["resume"] else None
    start = resumed_from or 0
    stored = checkpointer.restored_metadata.get("hparams") or {} if resumed_from is not None else {}
    if resumed_from is not None:
        horizon = resume_schedule(sched, config.get("schedule_steps") or stored.get("schedule_steps") or total)
    requested = run_hparams(config, horizon)
    # The peak LR in effect: a resumed scheduler keeps the run's base LR whatever --lr says.
    hparams = {**requested, "lr": sched.base_lrs[0]}
    restarts = getattr(checkpointer, "restarts", None) or 0
    if rank == 0:
        log_start(checkpointer, resumed_from, f"{model_size(model):,}", world_size, horizon)
        changed = {k: (stored[k], v) for k, v in requested.items() if k in stored and stored[k] != v}
        if changed:
            log(
                f"flags differ from the checkpoint's hyperparameters (stored, asked): {changed}; the LR stays "
                "the stored one, the schedule follows --schedule-steps if given"
            )

    history: list[dict[str, float]] = []
    pending: list[float] = []
    synthetic = lambda n: synthetic_batch(n - 1, config["global_batch"], cfg, rank, world_size)  # noqa: E731
    batches = Batches(data, config.get("sample_log"), rank, world_size, synthetic)
    for step in range(start, total):
        began = time.perf_counter()
        lr = optim.param_groups[0]["lr"]
        torch.manual_seed(seed + step)
        inputs, targets = batches.next(step + 1)
        loss = model.loss(inputs.to(device), targets.to(device))
        loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        global_loss = mean_across_ranks(loss.detach(), world_size)
        done = step + 1
        history.append({"step": done, "loss": global_loss, "lr": lr, "seconds": time.perf_counter() - began})
        pending.append(global_loss)
        if rank == 0:
            log(f"step {done}/{total} loss {global_loss:.4f} ({history[-1]['seconds']:.2f}s)")
        if done % every == 0 or done == total or (in_memory and done % in_memory == 0):
            app.extras["step"] = done
            metrics: dict[str, Any] = {
                "loss": global_loss,
                "step": done,
                "world_size": world_size,
                "restarts": restarts,
                "epoch": data.sampler.epoch if data is not None else None,
            }
            persist = done % every == 0 or done == total
            if persist:
                metrics["losses"] = pending
                if resumed_from is not None:
                    metrics["resumed_from"] = resumed_from
                    metrics["restored_tier"] = getattr(checkpointer, "restored_from", {}).get("tier", "storage")
                pending = []
            if persist:
                checkpointer.save(done, state, metrics=metrics, metadata={"hparams": hparams}, data=data)
            else:  # a memory-only save: under Ray only, where the Checkpointer has a memory tier
                checkpointer.save(done, state, metrics=metrics, metadata={"hparams": hparams}, persist=False, data=data)
    if in_memory:
        checkpointer.release_memory()  # the last step is in storage: the run's memory checkpoints are done with
    checkpointer.wait()
    return history


def build_model(
    config: dict[str, Any], cfg: GPTConfig, world_size: int, device: torch.device, horizon: int
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The FSDP2-sharded GPT, its AdamW and its LR schedule over ``horizon`` steps."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(config["seed"])  # the same initial weights on every rank, whatever the world size
    model = shard_model(GPT(cfg).to(device), init_device_mesh(device.type, (world_size,)))
    optim = torch.optim.AdamW(model.parameters(), lr=config["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    return model, optim, torch.optim.lr_scheduler.LambdaLR(optim, warmup_cosine(horizon))


def resume_schedule(sched: torch.optim.lr_scheduler.LambdaLR, horizon: int) -> int:
    """A resumed run's LR schedule over ``horizon`` steps, the LR set for the restored step; returns ``horizon``.

    The schedule belongs to the run: the stored horizon is kept unless ``--schedule-steps``
    is given (a checkpoint that stores no horizon: this launch's ``--steps``).
    """
    sched.lr_lambdas = [warmup_cosine(horizon)]
    for group, base_lr in zip(sched.optimizer.param_groups, sched.base_lrs):
        group["lr"] = base_lr * sched.lr_lambdas[0](sched.last_epoch)
    return horizon


def log_start(
    checkpointer: CheckpointerLike, resumed_from: int | None, params: str, world_size: int, horizon: int
) -> None:
    """Rank 0's first lines: the model, where it starts, the LR schedule; after a restart, from where."""
    where = f"resumed from step {resumed_from}" if resumed_from is not None else "fresh start"
    log(f"GPT with {params} parameters on {world_size} rank(s), {where}, {horizon}-step LR schedule")
    restarts = getattr(checkpointer, "restarts", None) or 0
    if restarts:
        tier = {"tier": getattr(checkpointer, "restored_from", {}).get("tier")} if resumed_from is not None else {}
        log(restart_line(restarts, resumed_from, world_size, {**checkpointer.restored_metadata, **tier}))


def restart_line(restarts: int, step: int | None, world_size: int, restored: dict[str, Any]) -> str:
    """Rank 0's line after Ray Train restarted (or resized) the workers: from which step, with how many."""
    saved_by = (restored.get("metrics") or {}).get("world_size")
    by = f" (saved by {saved_by})" if saved_by else ""
    where = f"resumed from step {step}{by}" if step is not None else "no committed checkpoint yet: from step 0"
    tier = f", from {restored['tier']}" if restored.get("tier") else ""
    return f"restart {restarts}: {where} with {world_size} worker(s){tier}"


def train_loop_per_worker(config: dict[str, Any]) -> list[dict[str, float]]:
    """What ``TorchTrainer`` runs on each worker: ``train`` with rayckpt's Ray Train checkpointer.

    Every worker group restores the run's newest committed checkpoint if there is
    one, with or without ``--resume``: ``check_resume`` made sure a fresh run's
    directory was empty when the job began, so a checkpoint there is this job's,
    and the group is a restart after a failure or an elastic resize.
    """
    import ray.train
    import ray.train.torch

    from ..train.checkpointer import Checkpointer

    quiet_ray_train_logs()
    context = ray.train.get_context()
    device = torch.device("cpu")
    if config["gpus"]:
        device = ray.train.torch.get_device()
        torch.cuda.set_device(device)
    full_every = config.get("full_every") or 0
    checkpointer = Checkpointer(
        memory_every=config.get("memory_every") or 0, incremental=full_every != 1, full_every=full_every
    )
    return train({**config, "resume": True}, context.get_world_rank(), context.get_world_size(), checkpointer, device)


def quiet_ray_train_logs() -> None:
    """Drop Ray Train's per-rank ``Reporting training result ... TrainingReport(...)`` INFO line of every save.

    It is logged by the worker-side train context (a logger named after its file)
    once per rank per ``ray.train.report``; the job logs its own line per commit.
    """
    from ray.train.v2._internal.execution import context

    context.logger.setLevel(logging.WARNING)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check the request, fit the ``TorchTrainer`` on the cluster ``--address`` names; return the summary.

    Before any Ray work, ``check_storage`` refuses an object-store URI that cannot
    be used (a bad URI, an endpoint that does not answer, a missing bucket) and
    ``check_resume`` refuses a fresh run over an existing run directory and a
    ``--resume`` of a run with no committed checkpoint; after joining the cluster,
    ``check_shared_storage`` refuses a local path on nodes of several machines and
    ``check_resources`` workers it can never hold. All raise
    ``JobConfigError``. ``--storage-path`` goes to Ray Train as given: it resolves a
    URI, query string and all, with ``pyarrow.fs.FileSystem.from_uri``, as rayckpt does.
    """
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from ..ray.joining import ClusterUnreachableError, cluster_address
    from ..ray.rank.save_handle import local_is_shared_by_env
    from ..train.callback import RayckptCallback

    check_storage(args.storage_path)
    resume = check_resume(args.storage_path, args.run_name, resume=args.resume, resume_if_exists=args.resume_if_exists)
    started_ray = not ray.is_initialized()
    if started_ray:
        try:  # a dead cluster's address is found out in seconds, not retried for minutes by ray.init
            address = cluster_address(args.address)
        except ClusterUnreachableError as exc:
            raise JobConfigError(str(exc)) from exc
        ray.init(address=address)
    try:
        nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]
        check_shared_storage(args.storage_path, nodes, local_is_shared_by_env())
        cluster = ray.cluster_resources()
        if args.skip_resource_check:
            per_worker = worker_resources(args, cluster.get("CPU", 0.0))
        else:
            per_worker = check_resources(args, cluster)
        quiet_ray_train_logs()
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={**train_config(args), "resume": resume},
            scaling_config=ScalingConfig(
                num_workers=workers_asked(args), use_gpu=args.gpus, resources_per_worker=per_worker
            ),
            torch_config=TorchConfig(backend="nccl" if args.gpus else "gloo"),
            run_config=RunConfig(
                name=args.run_name,
                storage_path=args.storage_path,
                callbacks=[RayckptCallback()],
                checkpoint_config=CheckpointConfig(num_to_keep=args.keep),
                failure_config=FailureConfig(max_failures=args.max_failures),
            ),
        )
        result = trainer.fit()
        if args.timeline:
            draw_timeline(args.run_name, args.timeline)
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
        "num_workers": metrics.get("world_size", args.num_workers),
        "resumed_from": metrics.get("resumed_from"),
        "restarts": metrics.get("restarts", 0),
        "restored_tier": metrics.get("restored_tier"),
    }


def draw_timeline(run: str, path: str) -> None:
    """``--timeline``: the run's checkpoint timeline into ``path``; a failure to draw is one line, not the job's."""
    from ..observe.timeline import PlotUnavailableError, draw
    from ..ray.status.reader import timeline

    try:
        log(f"timeline of {draw(timeline(run), path)} saves written to {path}")
    except (PlotUnavailableError, ValueError, OSError) as exc:
        log(f"no timeline drawn: {exc}")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, train, print the summary as one JSON object on the last line of stdout.

    A ``JobConfigError`` (the run to resume, a cluster that does not answer, the
    cluster's resources) is one ``error:`` line on stderr and exit status 2, like a bad flag.
    """
    try:
        summary = run(parse_args(argv))
    except JobConfigError as exc:
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
