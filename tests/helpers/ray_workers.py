"""Train-loop functions the Ray tests hand to TorchTrainer (importable by workers)."""

from __future__ import annotations

import os
import time
from typing import Any

import ray
import ray.train
import torch
from torch.utils.data import DataLoader

from rayckpt.data import ResumableSampler
from rayckpt.engine.app_state import AppState
from rayckpt.examples.corpus import Batches
from rayckpt.ray.metadata.actor import DEFAULT_COMMIT_TIMEOUT_S, get_metadata_actor
from rayckpt.ray.rank import async_save
from rayckpt.testing.toy import build_fsdp, full_state, train_steps
from rayckpt.train.checkpointer import Checkpointer
from tests.helpers.recovery_faults import Faults, faults_done

#: The toy loop's data: sample ids 0..DATA_LEN-1, GLOBAL_BATCH of them per step over all ranks.
DATA_LEN = 24
GLOBAL_BATCH = 12


def next_failure(config: dict[str, Any]) -> str:
    """The first of ``config["fail_modes"]`` no attempt has used yet (each leaves ``failed-<mode>`` in the out
    directory): a run restarted after a failure meets the next one."""
    for mode in config["fail_modes"]:
        marker = os.path.join(config["out"], f"failed-{mode}")
        if not os.path.exists(marker):
            open(marker, "w").close()
            return mode
    raise AssertionError(f"every failure of {config['fail_modes']} was used, and the run failed again")


def inject_failure(mode: str) -> None:
    """Make this rank's next save fail after it registered, while the others write: ``kill`` ends the
    process, ``raise`` raises a full disk's error."""

    def fail(*args):
        if mode == "kill":
            os._exit(1)
        raise OSError(28, "No space left on device (injected)")

    async_save.AsyncSaver.stage_share = fail


def probe_local_save(location: str, rank: int, out: str) -> None:
    """Every rank saves a small state to the node-local ``location`` (a collective); rank 0 writes what the
    save raised to ``out/refused.txt`` (empty if nothing): across nodes it must be refused."""
    try:
        async_save.save_async({"x": torch.zeros(4)}, location, run="local-probe").wait()
        refused = ""
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        refused = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        with open(os.path.join(out, "refused.txt"), "w") as f:
            f.write(refused)


def after_fault(config: dict[str, Any]) -> str:
    """``-after-<phase>`` naming the fault an attempt restarted after; empty without one."""
    done = faults_done(config)
    return f"-after-{done[-1]['phase']}" if done else ""


def toy_train_loop(config: dict[str, Any]) -> None:
    """Restore (if any), train to ``config['steps']`` saving at ``config['save_at']``, dump state.

    Rank 0 dumps ``restored-<world>.pt`` (the restored step and state; ``restored-<world>-after-<phase>.pt``
    after a fault of ``die``) and ``final-<world>.pt``; with ``dump_saves``, ``state-<step>.pt`` at each
    save too; with ``freeze_blocks``, only the head trains. ``die`` and ``hold`` inject the faults of
    tests/recovery (``recovery_faults.Faults``);
    ``probe_local`` first saves to that node-local location (``probe_local_save``); rank 1's save of
    ``fail_step`` fails as ``fail_modes`` says, one mode per attempt (``next_failure``).
    """
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model, optim = build_fsdp(world, seed=config.get("seed", 0))
    if config.get("freeze_blocks"):  # only the head trains: the blocks' bytes never change
        model.blocks.requires_grad_(False)
    app = AppState(model, optim, step=0)
    state = {"app": app}
    timeout = config.get("commit_timeout_s", DEFAULT_COMMIT_TIMEOUT_S)
    memory_every = config.get("memory_every", 0)  # memory saves at every other step, storage at save_at
    # a real loader of sample ids, through the job's sampler: every save carries the data position
    data_len = config.get("data_len", DATA_LEN)
    sampler = ResumableSampler(data_len, num_replicas=world, rank=rank, seed=config.get("seed", 0), identity="toy")
    per_rank = GLOBAL_BATCH // world if GLOBAL_BATCH % world == 0 else 1
    loader = DataLoader([(i, i) for i in range(data_len)], batch_size=per_rank, sampler=sampler)
    ckpt = Checkpointer(
        data=loader,
        local_is_shared=config.get("local_is_shared"),
        commit_timeout_s=timeout,
        memory_every=memory_every,
        memory_skip_busy=False,  # every memory save happens: the tests know which steps are held
        incremental=config.get("incremental", True),
    )
    restored = ckpt.restore(state)
    step = app.extras["step"] if restored is not None else 0
    out = config["out"]
    if restored is not None:
        dump = full_state(app)
        if rank == 0:
            torch.save(
                {
                    "step": restored,
                    "state": dump,
                    "load": ckpt.last_load,
                    "staging_bytes": ckpt.staging_bytes,
                    "restored_from": ckpt.restored_from,
                    "fallbacks": ckpt.fallbacks,
                    "time": time.time(),
                },
                os.path.join(out, f"restored-{world}{after_fault(config)}.pt"),
            )
    with open(os.path.join(out, f"node-{world}-{rank}.txt"), "w") as f:
        f.write(ray.get_runtime_context().get_node_id())
    if config.get("probe_local"):
        probe_local_save(config["probe_local"], rank, out)
    faults = Faults(config, ckpt.run, rank, world)
    batches = Batches(loader, out, rank, world)  # each step's ids in out/samples-*.jsonl
    while step < config["steps"]:
        faults.before_step(step + 1)
        batches.next(step + 1)
        train_steps(model, optim, 1, rank + 100 * step)
        step += 1
        app.extras["step"] = step
        if step in config["save_at"] or memory_every:
            if step == config.get("fail_step") and rank == 1:
                inject_failure(next_failure(config))
            persist = (step in config["save_at"]) if memory_every else None
            with faults.saving(step):
                handle = ckpt.save(step, state, {"loss": float(step)}, persist=persist)
            if config.get("dump_saves"):
                dump = full_state(app)
                if rank == 0:
                    torch.save({"step": step, "state": dump}, os.path.join(out, f"state-{step}.pt"))
            faults.after_save(step, ckpt)
            if rank == 0 and step == config.get("kill_actor_at"):
                handle.wait()
                ray.kill(get_metadata_actor(), no_restart=True)
    ckpt.wait()
    dump = full_state(app)
    if rank == 0:
        torch.save({"step": step, "state": dump}, os.path.join(out, f"final-{world}.pt"))


def ray_data_loop(config: dict[str, Any]) -> None:
    """Restore, read this worker's shard of the Ray Data dataset ``train``, save the next step."""
    ckpt = Checkpointer()
    state = {"seen": torch.zeros(1)}
    step = ckpt.restore(state) or 0
    rows = sum(1 for _ in ray.train.get_dataset_shard("train").iter_rows())
    state["seen"] += rows
    ckpt.save(step + 1, state, {"rows": rows})
    ckpt.wait()
