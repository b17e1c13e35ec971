"""The time a save call blocks training, rayckpt's overlapped save beside a bare copy and DCP, in one run.
The fp32 params and AdamW moments of a stack of square ``nn.Linear`` layers, as ``AppState(model, opt)``
(``--plain``: as plain tensors no optimizer owns, which every mode copies before it returns);
``one-process``: one process holds all of it; ``four-ranks``: TorchTrainer workers (gloo) each hold an FSDP2
share. Each save: the call timed, one training step (forward, backward, AdamW step; an overlapped copy runs
beside forward and backward, the optimizer step waits for what is left of it), then the save waited for
(DCP: its upload; rayckpt: its commit) and removed. Modes: ``copy``: the local tensors copied into buffers
made beforehand; ``dcp``: ``async_save`` with one reused pinned ``DefaultStager``; ``dcp-async-staging``:
with ``StagingOptions(True, True, True, True)``, its staging waited for before the optimizer step;
``rayckpt-sync``: ``save_async(overlap=False)``; ``rayckpt``: ``save_async``, the optimizer's tensors
copied beside the next step; ``rayckpt-data``: the same with a data position (``data=`` a sampler);
``rayckpt-all``: ``save_async(overlap="all")``; rayckpt after ``prepare_staging``. Rounds after warm-up
rounds, modes rotated; seconds: the slowest rank's per round (and the median rank's), median over rounds."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import asdict
from typing import Any

import torch

from benchmarks.common import cli, systems
from benchmarks.common.harness import load_sampled, new_report, rotated, write_report
from benchmarks.common.raytrain import fit, gather_records, new_ray
from benchmarks.common.workload import StackShape, add_model_args, batch, build, stack_shape, train_step
from benchmarks.overlap.report import stall_markdown, stall_targets, summarize_stall

SCENARIOS = ("one-process", "four-ranks")
ALL_MODES = ("copy", "dcp", "dcp-async-staging", "rayckpt-sync", "rayckpt", "rayckpt-data", "rayckpt-all")
CPU_MODES = ("copy", "dcp", "rayckpt-sync", "rayckpt", "rayckpt-data")
CUDA_MODES = ("copy", "dcp", "dcp-async-staging", "rayckpt-sync", "rayckpt", "rayckpt-data")


def run_rounds(saves: systems.Modes, model: Any, optim: Any, x: torch.Tensor, args: dict[str, Any]) -> list[dict]:
    """``args["warmup"]`` rounds, then ``args["rounds"]`` counted ones, of every mode (see the module)."""
    import torch.distributed as dist

    from rayckpt.engine import overlap

    ranks = dist.is_initialized()
    records: list[dict[str, Any]] = []
    step = 0
    for rnd in range(-args["warmup"], args["rounds"]):
        for mode in rotated(args["modes"], rnd):
            if mode in saves.failed:
                continue
            step += 1
            if ranks:
                dist.barrier()
            if saves.cuda:
                torch.cuda.synchronize()
            waited = overlap.waited[0]
            start = time.perf_counter()
            try:
                saves.save(mode, step)
                stall = time.perf_counter() - start
                staged_wait = train_step(model, optim, x, saves.before_step)
                opt_wait = overlap.waited[0] - waited
                done = saves.finish()
            except Exception as exc:
                if not mode.startswith("dcp") or ranks:  # a stager this torch cannot run is a result, not a crash
                    raise
                saves.failed[mode] = f"{type(exc).__name__}: {exc}"[:400]
                continue
            total = time.perf_counter() - start
            if ranks:
                dist.barrier()
            if rnd >= 0:
                records.append(
                    {"round": rnd, "mode": mode, "rank": saves.rank, "stall_s": stall, "staged_wait_s": staged_wait}
                    | {"opt_wait_s": opt_wait, "total_s": total, "late_bytes": done.get("late_bytes", 0)}
                    | {"copy_s": done.get("copy_s"), "ckpt_bytes": done.get("ckpt_bytes", 0)}
                )
    return records


def one_process(args: argparse.Namespace, modes: tuple[str, ...], root: str) -> tuple[list[dict], dict[str, str]]:
    """The whole state in this process (on ``--device``), in a new local Ray."""
    if args.device.startswith("cuda"):
        torch.cuda.set_device(0)
    shape = stack_shape(args.size_gb, args.layers)
    model, optim, app = build(shape, args.device)
    state = {"app": app}
    if args.plain:  # copies, which no optimizer owns (its own tensors would be copied beside the next step)
        state = {f"t{i}": t.clone() for i, t in enumerate(systems.local_tensors(state))}
    with new_ray(args.workers, logs=args.ray_logs):
        saves = systems.Modes(state, modes, root, cuda=args.device == "cuda", run=f"overlap-stall-{time.time_ns()}")
        try:
            records = run_rounds(saves, model, optim, batch(shape, args.batch, args.device), vars(args))
        finally:
            saves.close()
        return records, saves.failed


def ranks_loop(config: dict[str, Any]) -> None:
    """Each TorchTrainer worker: its share of the FSDP2 stack, then every round; records to rank 0's file."""
    import ray.train
    import torch.distributed as dist

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    shape = StackShape(**config["shape"])
    model, optim, app = build(shape, "cpu", world, seed=rank)
    group = dist.new_group(backend="gloo")  # DCP's upload thread must not share the training's group
    saves = systems.Modes({"app": app}, tuple(config["modes"]), config["root"], run=config["run"], group=group)
    try:
        records = run_rounds(saves, model, optim, batch(shape, config["batch"], seed=rank + 1), config)
    finally:
        saves.close()
    gather_records(records, config["result"])


def four_ranks(args: argparse.Namespace, modes: tuple[str, ...], root: str) -> list[dict]:
    config = {"shape": asdict(stack_shape(args.size_gb, args.layers)), "run": f"overlap-stall-ranks-{time.time_ns()}"}
    config |= {"modes": [m for m in modes if m != "dcp-async-staging"], "root": root}
    config |= {k: getattr(args, k) for k in ("batch", "rounds", "warmup")}
    return fit(ranks_loop, config, args.workers, args.out, args.ray_logs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(__doc__, "overlap", markdown=True, ray_logs=True)
    add_model_args(p)
    p.add_argument("--rounds", type=int, default=5, help="counted rounds of every mode")
    p.add_argument("--warmup", type=int, default=1, help="rounds of every mode first, not counted")
    p.add_argument("--workers", type=int, default=4, help="ranks of four-ranks (and the local Ray's CPUs)")
    p.add_argument("--scenarios", type=cli.listed(SCENARIOS), default=",".join(SCENARIOS))
    modes = f"default: {', '.join(CPU_MODES)}; on cuda {', '.join(CUDA_MODES)}"
    p.add_argument("--modes", type=cli.listed(ALL_MODES), default=None, help=f"of {', '.join(ALL_MODES)} ({modes})")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where one-process's state lives")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--plain", action="store_true", help="one-process (only) saves plain tensors, no AppState")
    args = cli.parse(p, argv)
    if args.device == "cuda" and "four-ranks" in args.scenarios:
        p.error("--device cuda: only --scenarios one-process (four-ranks runs on gloo CPU workers)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (the default --device cpu runs the CPU path)")
    args.modes = tuple(args.modes or (CUDA_MODES if args.device == "cuda" else CPU_MODES))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = stack_shape(args.size_gb, args.layers)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "markdown", "ray_logs", "dir")}
    report = new_report("benchmarks.overlap stall", argv, __doc__, config=config, shape=asdict(shape))
    report |= {"state_bytes": shape.state_bytes, "records": {}, "errors": {}}
    report["machine"]["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    root = tempfile.mkdtemp(prefix="rayckpt-bench-overlap-", dir=args.dir)
    try:
        with load_sampled(report):
            for sc in args.scenarios:
                if sc == "one-process":
                    report["records"][sc], report["errors"][sc] = one_process(args, args.modes, root)
                else:
                    report["records"][sc] = four_ranks(args, args.modes, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["summary"] = {sc: summarize_stall(recs, report["errors"].get(sc)) for sc, recs in report["records"].items()}
    report["targets"] = stall_targets(report["summary"], plain=args.plain)
    return write_report(args, "overlap_stall", report, stall_markdown(report))
