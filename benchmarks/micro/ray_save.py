"""A/B of the Ray save path: where ``save_async``'s stall and commit go, next to DCP.

Saves only, ``--ranks`` gloo ranks connected to a local Ray cluster, systems
alternated within each repeat: ``shm`` and ``object_store`` (``save_async`` with
that ``staging``), ``dcp`` (``dcp.save``) and ``rayckpt`` (``rayckpt.save`` in
process). For the Ray systems each rank times the parts of its stall (planning
all-gathers, registration, the staging copy) and when its write finished; the
ShardWriter reports its own write time. Figures are the max over ranks. Each rank
makes its staging buffer first (``prepare_staging``, as ``Checkpointer.restore``
does; ``--no-prepare``: the first save makes it).

    .venv/bin/python -m benchmarks.micro ray-save --size-mb 1024 --repeats 5

Writes ``--out`` (JSON) and prints one line per repeat and system.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from typing import Any

import ray

from benchmarks.common.harness import connect_ray
from benchmarks.common.workload import build_state, layer_shapes
from rayckpt.testing.multiproc import run_ranks

SYSTEMS = ("shm", "object_store", "dcp", "rayckpt")
#: What the stall is made of, timed where ``async_save`` looks each one up: (owner, name, label).
#: Owners: "module" (``rayckpt.ray.rank.async_save``) or "saver" (its ``AsyncSaver`` class).
STALL_PARTS = (
    ("module", "collect_state", "plan"),
    ("module", "get_metadata_actor", "actor lookups"),
    ("saver", "stage_share", "copy"),
    ("module", "get_shard_writer", "actor lookups"),
)


def timed(fn: Any, label: str, parts: dict[str, float]) -> Any:
    """``fn``, adding the seconds each call takes to ``parts[label]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[label] = parts.get(label, 0.0) + time.perf_counter() - t

    return wrapper


def worker(rank: int, world_size: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import rayckpt
    from rayckpt.ray.rank import async_save

    _, _, app = build_state(world_size, rank, seed=0, shapes=cfg["shapes"])
    connect_ray(cfg["address"])
    parts: dict[str, float] = {}
    for owner_name, name, label in STALL_PARTS:
        owner = async_save if owner_name == "module" else async_save.AsyncSaver
        setattr(owner, name, timed(getattr(owner, name), label, parts))
    async_save.save_async({"warm": torch.ones(1024)}, os.path.join(cfg["dir"], "warmup"), run="warmup").wait()
    state, records = {"app": app}, []
    if cfg["prepare"]:
        async_save.prepare_staging(state)  # what Checkpointer.restore does
    for rep in range(cfg["repeats"]):
        for system in cfg["systems"]:
            path = os.path.join(cfg["dir"], system)
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
                os.sync()
            dist.barrier()
            t0 = time.perf_counter()
            rec: dict[str, Any] = {"repeat": rep, "system": system}
            if system in ("shm", "object_store"):
                parts.clear()
                handle = async_save.save_async(state, path, run="bench-ray-save", step=rep, staging=system)
                rec["stall"] = time.perf_counter() - t0
                rec.update(parts)
                rec["writer"] = ray.get(handle._copy.write_ref)["seconds"]
                rec["written"] = time.perf_counter() - t0
                handle.wait()
            elif system == "dcp":
                dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
            else:
                rayckpt.save(state, path)
            rec["commit"] = time.perf_counter() - t0
            dist.barrier()
            records.append(rec)
    ray.shutdown()
    return records


def merge(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (repeat, system): each figure's max over ranks."""
    rows = []
    for recs in zip(*per_rank):
        row: dict[str, Any] = {"repeat": recs[0]["repeat"], "system": recs[0]["system"]}
        row.update({k: max(r[k] for r in recs) for k in recs[0] if k not in row})
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument(
        "--no-prepare", action="store_true", help="no prepare_staging first: the first save makes the buffer"
    )
    parser.add_argument("--dir", default="bench_out/ray_save")
    parser.add_argument("--out", default="bench_out/bench_ray_save.json")
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",")]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="rayckpt-bench")
    cfg = {
        "shapes": layer_shapes(args.size_mb),
        "address": ray.get_runtime_context().gcs_address,
        "dir": args.dir,
        "repeats": args.repeats,
        "systems": systems,
        "prepare": not args.no_prepare,
    }
    try:
        per_rank = run_ranks(worker, args.ranks, cfg)
    finally:
        ray.shutdown()
        shutil.rmtree(args.dir, ignore_errors=True)
    rows = merge(per_rank)
    for row in rows:
        figures = " ".join(f"{k} {v:.3f}" for k, v in row.items() if k not in ("repeat", "system"))
        print(f"repeat {row['repeat']} {row['system']:>12}: {figures}")
    medians = {}
    for s in systems:
        mine = [r for r in rows if r["system"] == s]
        medians[s] = {k: statistics.median(r[k] for r in mine) for k in mine[0] if k not in ("repeat", "system")}
    print("medians over repeats:", json.dumps(medians))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"size_mb": args.size_mb, "ranks": args.ranks, "rows": rows, "medians": medians}, f, indent=1)
    return 0
