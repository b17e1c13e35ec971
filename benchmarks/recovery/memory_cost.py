"""What checkpointing to memory every step costs a training loop, against its anchors, in one run: the
suite's FSDP2 state on TorchTrainer workers; a step is an in-place update of every local shard, one
all-reduce and a sleep standing in for forward and backward. Rounds of every mode (``none``; ``copy``:
a bare copy of each worker's share into buffers made beforehand, the least an in-memory checkpoint
costs; ``memory``: ``Checkpointer(memory_every=1).save(step, state, persist=False)``), order rotated;
seconds: the slowest worker's, medians over the steps past each round's first. Then (one-node) a
restore of one step into the same workers from each tier, barrier to barrier, rounds rotated: the
nodes' memory, the local disk with the page cache warm and evicted, and S3 (``--s3``)."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from benchmarks.common import cli
from benchmarks.common.harness import document, grouped, load_sampled, new_report, rotated, summary, table, write_report
from benchmarks.common.raytrain import append_event, new_ray, read_events, trainer
from benchmarks.common.workload import layer_shapes

MODES = ("none", "copy", "memory")
SCENARIOS = ("one-node", "two-nodes")


def cost_loop(config: dict[str, Any]) -> None:
    """Each worker: build the state, then ``rounds`` rounds of every mode, ``steps`` steps each."""
    import ray
    import ray.train
    import torch
    import torch.distributed as dist

    from benchmarks.common.systems import Modes
    from benchmarks.common.workload import build_state
    from benchmarks.recovery.loop import one_step

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cuda = config["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(ray.train.torch.get_device())
    shapes = [tuple(s) for s in config["shapes"]]
    model, optim, app = build_state(world, rank, seed=0, shapes=shapes, device=config["device"])
    state = {"app": app}
    saves = Modes(
        state, ("copy", "memory"), os.path.dirname(config["events"]), cuda=cuda, local_is_shared=config["shared"]
    )
    step = 0
    for rnd in range(config["rounds"]):
        for mode in rotated(MODES, rnd):
            dist.barrier()
            for i in range(config["steps"]):
                step += 1
                t0 = time.perf_counter()
                one_step(model, optim, step, config["step_sleep_s"])
                t1 = time.perf_counter()
                skipped = saves.save(mode, step)
                t2 = time.perf_counter()
                append_event(
                    config["events"], "step", rank=rank, round=rnd, mode=mode, i=i, step=step,
                    step_s=t2 - t0, save_s=t2 - t1, skipped=skipped, share=saves.copy.nbytes,
                )  # fmt: skip
            saves.settle()  # the memory saves' background work ends inside their own mode
    if config["restore_rounds"]:
        restores(config, saves.memory["memory"], state, step + 1, rank)
    if rank == 0:
        from rayckpt.ray.actors import writers

        writes = [ray.get(h.debug_stats.remote())["writes"] for h in writers(fresh=True).values()]
        append_event(config["events"], "writes", writes=[w for ws in writes for w in ws if "@memory" in w["run"]])
    saves.close()


def restores(config: dict[str, Any], ckpt: Any, state: dict[str, Any], step: int, rank: int) -> None:
    """Load one step into the same workers from each tier, rounds rotated, barrier to barrier: from the
    nodes' memory, from local disk with the page cache warm and evicted, and from S3 (``--s3``); with
    ``config["restore_from"]``, from those of them only."""
    import torch.distributed as dist

    from benchmarks.common.diskio import evict, files_under
    from rayckpt.ray import load, save_async

    ckpt.save(step, state, persist=True)  # due for both: to memory, then to storage
    ckpt.wait()
    disk = (ckpt.path(step), ckpt.filesystem)
    sources = {"memory": (ckpt.memory.path(step), ckpt.memory.filesystem), "disk, warm": disk, "disk, cold": disk}
    if config["s3_uri"]:
        save_async(state, config["s3_uri"], run="memory-cost-s3", step=step).wait()
        sources["s3"] = (config["s3_uri"], None)
    if config.get("restore_from"):  # only these, in this order
        sources = {name: sources[name] for name in config["restore_from"]}
    for rnd in range(config["restore_rounds"]):
        for name in rotated(list(sources), rnd):
            path, fs = sources[name]
            if name == "disk, cold" and rank == 0:
                evict(files_under(path))
            dist.barrier()
            t0 = time.perf_counter()
            info = load(state, path, filesystem=fs)
            dist.barrier()
            append_event(
                config["events"], "restore", rank=rank, round=rnd, source=name, load_s=time.perf_counter() - t0,
                bytes_read=info.bytes_read,
            )  # fmt: skip


def run_scenario(args: argparse.Namespace, scenario: str) -> dict[str, Any]:
    events = os.path.join(args.out, f"{scenario}.jsonl")
    if os.path.exists(events):
        os.remove(events)
    one_node, gpu, s3 = scenario == "one-node", args.device == "cuda", args.s3_endpoint
    nodes = 1 if one_node else 2
    with new_ray(args.workers, nodes=nodes, object_store_mb=args.object_store_mb, logs=args.ray_logs) as (res, _):
        config = {"events": events, "shapes": layer_shapes(args.size_mb), "device": args.device}
        config |= {k: getattr(args, k) for k in ("rounds", "steps", "step_sleep_s")}
        config |= {"shared": not one_node or None, "restore_rounds": args.restore_rounds if one_node else 0}
        config["s3_uri"] = s3.uri(f"memory-cost/{time.time_ns()}") if s3 is not None and one_node else None
        resources = {**res, "GPU": 1} if gpu else res
        storage = os.path.join(args.out, "storage")
        trainer(cost_loop, config, args.workers, storage, resources=resources).fit()
    return summarize(events)


def summarize(events: str) -> dict[str, Any]:
    """Per mode: the slowest worker's step and save time, medians over the steps past each round's first."""
    lines = read_events(events)
    steps = [e for e in lines if e["kind"] == "step"]
    by_step = grouped(steps, "step")
    out: dict[str, Any] = {}
    for mode in MODES:
        rows = [rs for rs in by_step.values() if rs[0]["mode"] == mode and rs[0]["i"] > 0]
        out[mode] = {k: statistics.median(max(r[k] for r in rs) for rs in rows) for k in ("step_s", "save_s")}
        out[mode]["steps"] = len(rows)
    memory = [rs for rs in by_step.values() if rs[0]["mode"] == "memory"]
    out["memory"] |= {"skipped": sum(rs[0]["skipped"] for rs in memory), "saves": len(memory)}
    writes = next((e["writes"] for e in lines if e["kind"] == "writes"), [])
    per_save: dict[str, int] = {}
    for w in writes:
        per_save[w["save_id"]] = per_save.get(w["save_id"], 0) + w["bytes"]
    out["shard_bytes_per_memory_save"] = statistics.median(per_save.values()) if per_save else None
    out["nodes_written"] = len({w["node"] for w in writes})
    out["share_bytes"] = [e["share"] for e in steps if e["step"] == 1]
    out["restore_s"] = restore_rounds(lines)
    return out


def restore_rounds(lines: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per tier, each round's restore seconds (the slowest rank's; barrier to barrier, every rank's the same)."""
    out: dict[str, list[float]] = {}
    for (source, _), recs in sorted(grouped([e for e in lines if e["kind"] == "restore"], "source", "round").items()):
        out.setdefault(source, []).append(max(e["load_s"] for e in recs))
    return out


def markdown(report: dict[str, Any]) -> str:
    rows, parts = [], []
    for sc, r in report["scenarios"].items():
        none, copy, per_save = r["none"]["step_s"], r["copy"]["step_s"], r["shard_bytes_per_memory_save"]
        for mode in MODES:
            m, memory = r[mode], mode == "memory"
            rows.append(
                {"scenario": sc, "mode": mode, "step s": m["step_s"], "x none": m["step_s"] / none}
                | {"x copy": m["step_s"] / copy, "save call s": m["save_s"]}
                | {"memory saves skipped": f"{m['skipped']} of {m['saves']}" if memory else None}
                | {"shard MB per memory save (each copied to a peer across nodes)": per_save / 1e6 if memory else None}
            )
        if r.get("restore_s"):
            memory = statistics.median(r["restore_s"]["memory"])
            restores = [
                {"from": k, "load s": summary(v), "x memory": statistics.median(v) / memory}
                for k, v in r["restore_s"].items()
            ]
            parts += [f"Restore of one step ({sc}), seconds: median (min-max) over the rounds:", table(restores)]
    return document("The cost of a memory checkpoint every step", report, table(rows), *parts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(__doc__, "memory_cost", markdown=True, ray_logs=True)
    p.add_argument("--size-mb", type=float, default=1024, help="state size (params + AdamW moments)")
    p.add_argument("--workers", type=int, default=4, help="training workers (split over two nodes in two-nodes)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every mode")
    p.add_argument("--steps", type=int, default=6, help="steps per mode per round")
    p.add_argument("--step-sleep-s", type=float, default=0.5, help="sleep per step standing in for forward+backward")
    p.add_argument("--scenarios", type=cli.listed(SCENARIOS), default=",".join(SCENARIOS))
    p.add_argument("--object-store-mb", type=int, default=1536, help="object store per Ray node")
    p.add_argument("--restore-rounds", type=int, default=3, help="rounds of restores by tier (one-node; 0: none)")
    p.add_argument("--s3", action="store_true", help="also restore from S3 (a local moto server, as the tests')")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per worker, one-node")
    args = cli.parse(p, argv)
    if args.device == "cuda" and args.scenarios != ["one-node"]:
        p.error("--device cuda: only --scenarios one-node (one machine's GPUs)")
    if "two-nodes" in args.scenarios and (args.workers < 2 or args.workers % 2):
        p.error(f"--workers {args.workers}: expected an even number >= 2 (two-nodes puts half on each node)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shapes = layer_shapes(args.size_mb)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "markdown", "ray_logs")}
    report = new_report("benchmarks.recovery memory-cost", argv, __doc__, config=config, scenarios={})
    report["state_bytes"] = 12 * sum(rows * cols + rows for rows, cols in shapes)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here (the default --device cpu runs the CPU path)")
        report["machine"]["device"] = torch.cuda.get_device_name()
    args.s3_endpoint, server = None, None
    if args.s3:
        from rayckpt.testing.s3_server import S3_ENV, start_moto_server

        os.environ.update(S3_ENV)  # the local Ray's workers inherit them
        server = start_moto_server(os.path.join(args.out, "moto.log"), "bench")
        args.s3_endpoint = server.endpoint
    try:
        with load_sampled(report):
            for sc in args.scenarios:
                report["scenarios"][sc] = run_scenario(args, sc)
    finally:
        if server is not None:
            server.stop()
    return write_report(args, "memory_cost", report, markdown(report))
