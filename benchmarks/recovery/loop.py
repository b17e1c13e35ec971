"""What the recovery benchmark runs inside Ray Train: the workers' loop and the controller's callback."""

from __future__ import annotations

import os
import time
from typing import Any

from benchmarks.common.raytrain import append_event, read_events
from rayckpt.train import RayckptCallback


def prior_entries(path: str, rank: int) -> int:
    """How many times rank ``rank`` entered the loop before in this file: this entry's attempt number."""
    events = read_events(path) if os.path.exists(path) else []
    return sum(1 for e in events if e["kind"] == "enter" and e["rank"] == rank)


def one_step(model: Any, optim: Any, step: int, sleep_s: float) -> float:
    """A stand-in for an optimizer step on the local shards; the all-reduced "loss"."""
    import torch
    import torch.distributed as dist

    from rayckpt.engine.overlap import wait_for_copies

    wait_for_copies()
    with torch.no_grad():
        for p in model.parameters():
            st = optim.state[p]
            p.to_local().mul_(0.999).add_(1e-4 * (step % 7))
            st["exp_avg"].to_local().mul_(0.9).add_(1e-3)
            st["exp_avg_sq"].to_local().mul_(0.999).add_(1e-6)
            st["step"].add_(1.0)
        first = next(iter(model.parameters())).to_local()
        # float() waits for the device: a step on a GPU is timed to its end
        loss = torch.tensor([float(first.reshape(-1)[:1].sum()) if first.numel() else 0.0], device=first.device)
    dist.all_reduce(loss)
    if sleep_s > 0:
        time.sleep(sleep_s)
    return float(loss)


def train_loop(config: dict[str, Any]) -> None:
    """Each worker: build the state, restore, then step and save every ``save_every`` steps."""
    import ray
    import ray.train

    from benchmarks.common.workload import build_state
    from rayckpt.train import Checkpointer

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    events = config["events"]
    attempt = prior_entries(events, rank)
    node = ray.get_runtime_context().get_node_id()
    append_event(events, "enter", rank=rank, world=world, attempt=attempt, pid=os.getpid(), node=node)

    def log(kind: str, **data: Any) -> None:
        append_event(events, kind, rank=rank, world=world, attempt=attempt, **data)

    shapes = [tuple(s) for s in config["shapes"]]
    model, optim, app = build_state(world, rank, seed=0, shapes=shapes)
    state = {"app": app}
    memory_every = config.get("memory_every", 0)  # memory saves between the storage saves
    ckpt = Checkpointer(local_is_shared=config.get("local_is_shared"), memory_every=memory_every)
    log("restore_begin")
    t0 = time.perf_counter()
    restored = ckpt.restore(state)
    restore_s = time.perf_counter() - t0
    source_world, tier, peer = None, None, 0
    if ckpt.last_load is not None:
        import rayckpt

        tier, peer = ckpt.restored_from["tier"], ckpt.restored_from["peer_bytes"]
        fs = ckpt.memory.filesystem if tier == "memory" and ckpt.memory is not None else None
        source_world = rayckpt.read_manifest(ckpt.restored_from["path"], filesystem=fs).world_size
    passed = [f"step {f['step']}: {f['reason']}" for f in ckpt.fallbacks]
    done = {"step": restored, "source_world": source_world, "restore_s": restore_s, "tier": tier}
    log("restore_done", **done, peer_bytes=peer, fallbacks=passed)

    step = restored or 0
    stop_at = config["steps"] if attempt == 0 else step + config["after_steps"]
    while step < stop_at:
        one_step(model, optim, step, config["step_sleep_s"])
        step += 1
        app.extras["step"] = step
        log("step", step=step)
        persist = None if not memory_every else step % config["save_every"] == 0
        if step % config["save_every"] == 0 or (memory_every and step % memory_every == 0):
            t0 = time.perf_counter()
            handle = ckpt.save(step, state, {"loss": float(step)}, persist=persist)
            saved = {"stall_s": time.perf_counter() - t0, "memory": persist is False, "skipped": handle is None}
            log("save", step=step, **saved, memory_skipped=ckpt.memory_skipped)
    ckpt.wait()
    log("done", step=step)


class NoticeCallback(RayckptCallback):
    """``RayckptCallback`` that records when the controller noticed a failure, and when its own part ended."""

    def __init__(self, events: str) -> None:
        self.events = events

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        append_event(self.events, "noticed", ranks=sorted(worker_exceptions))
        super().after_exception(run_context, worker_exceptions)
        append_event(self.events, "callback_done")
