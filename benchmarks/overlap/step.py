"""A training loop's step time with a save every step and every 10 steps, rayckpt beside DCP and a bare
copy: the fp32 params and AdamW moments of a stack of square ``nn.Linear`` layers, FSDP2-sharded over
TorchTrainer workers (gloo, CPU; one all-gather a step), as ``AppState(model, opt)``. A step: the save
when one is due, then forward and backward and the AdamW step (what a save costs the training beside it
counts in its own step). Modes: ``none``; ``copy``: each worker's share copied into buffers made
beforehand; ``dcp``: ``async_save`` with a reused pinned ``DefaultStager``, its staging waited for
before the optimizer step, the previous upload before the next save; ``memory``:
``Checkpointer(memory_every=1).save(step, state, persist=False)``; ``memory-sync``: the same with
``overlap=False``. Rounds of every mode, order rotated; step s: the slowest worker's, median and mean
over the steps past each round's first; save call s: median over those steps' saves; waited: seconds
before the optimizer step (DCP's staging, an overlapped copy), per step."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import asdict
from typing import Any

from benchmarks.common import cli, systems
from benchmarks.common.harness import load_sampled, new_report, rotated, write_report
from benchmarks.common.raytrain import fit, gather_records
from benchmarks.common.workload import StackShape, add_model_args, batch, build, stack_shape, train_step
from benchmarks.overlap.report import step_markdown, summarize_step

MODES = ("none", "copy", "dcp", "memory", "memory-sync")


def step_loop(config: dict[str, Any]) -> None:
    """Each TorchTrainer worker: its share of the FSDP2 stack, then every interval's rounds; records to rank 0."""
    import ray.train
    import torch.distributed as dist

    from rayckpt.engine import overlap

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    shape = StackShape(**config["shape"])
    model, optim, app = build(shape, "cpu", world, seed=rank)
    x = batch(shape, config["batch"], seed=rank + 1)
    modes = tuple(config["modes"])
    group = dist.new_group(backend="gloo")  # DCP's upload thread must not share the training's group
    saves = systems.Modes({"app": app}, modes, config["root"], group=group)
    records: list[dict[str, Any]] = []
    step = 0
    for every in config["every"]:
        for rnd in range(config["rounds"]):
            for mode in rotated(modes, rnd):
                dist.barrier()
                for i in range(config["steps"]):
                    step += 1
                    start = time.perf_counter()
                    saved = mode != "none" and i % every == every - 1
                    skipped = saves.save(mode, step) if saved else None
                    called = time.perf_counter()
                    waited = overlap.waited[0]
                    wait = train_step(model, optim, x, saves.before_step) + overlap.waited[0] - waited
                    records.append(
                        {"every": every, "round": rnd, "mode": mode, "i": i, "step": step, "rank": rank}
                        | {"step_s": time.perf_counter() - start, "save_s": called - start, "wait_s": wait}
                        | {"saved": saved, "skipped": skipped}
                    )
                saves.settle()
    gather_records(records, config["result"])
    saves.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(__doc__, "overlap", markdown=True, ray_logs=True)
    add_model_args(p)
    p.add_argument("--every", type=int, nargs="+", default=[1, 10], help="save every N steps (each N its own rounds)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every mode")
    p.add_argument("--steps", type=int, default=20, help="steps per mode per round")
    p.add_argument("--workers", type=int, default=4, help="TorchTrainer workers (the local Ray's CPUs)")
    p.add_argument("--modes", type=cli.listed(MODES), default=",".join(MODES), help=f"of {', '.join(MODES)}")
    p.add_argument("--dir", default=None, help="where DCP's checkpoints go (default: a temporary directory)")
    args = cli.parse(p, argv)
    if any(n < 1 for n in args.every) or args.steps < 2:
        p.error("--every: whole numbers >= 1; --steps: at least 2 (a round's first step of a mode is not counted)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = stack_shape(args.size_gb, args.layers)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "markdown", "ray_logs", "dir")}
    report = new_report("benchmarks.overlap step", argv, __doc__, config=config, shape=asdict(shape))
    report["state_bytes"] = shape.state_bytes
    root = tempfile.mkdtemp(prefix="rayckpt-bench-overlap-step-", dir=args.dir)
    loop = {"shape": asdict(shape), "root": root} | {
        k: config[k] for k in ("modes", "batch", "every", "rounds", "steps")
    }
    try:
        with load_sampled(report):
            report["records"] = fit(step_loop, loop, args.workers, args.out, args.ray_logs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["summary"] = summarize_step(report["records"])
    return write_report(args, "overlap_step", report, step_markdown(report))
