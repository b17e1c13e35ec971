"""The suite's save measurements: stall, durable commit and memory of every save system.

``save_worker`` runs on each of the ``--save-ranks`` gloo ranks (spawned by
``run_ranks``, so it stays a module-level function): it builds the FSDP2 state,
connects to the driver's Ray cluster, warms every code path on a tiny state, then
per repeat saves with every system in ``SAVE_SYSTEMS`` (the order rotating from
repeat to repeat), each timed barrier to barrier by ``harness.measure`` with the
rank's memory sampled; after the raw-disk write it reads the same bytes back cold.
``save_report`` reduces the ranks' records to the figures of the report (max over
ranks, then median and min-max over repeats).
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch

import rayckpt
from benchmarks.common.diskio import RAW_BLOCK, evict, read_raw, resident_fraction, write_raw
from benchmarks.common.harness import connect_ray, import_rayckpt, measure, mem_summary, memcpy_anchor, rotated, summary
from benchmarks.common.workload import build_state, checksums, local_bytes, state_bytes

SAVE_SYSTEMS = ("rayckpt", "rayckpt_ray", "dcp", "dcp_async", "torch_save", "raw")
SAVE_LABELS = {
    "rayckpt": "rayckpt save (sync, in process)",
    "rayckpt_ray": "rayckpt Ray save_async",
    "dcp": "torch DCP save",
    "dcp_async": "torch DCP async_save",
    "torch_save": "torch.save (rank 0, full state)",
    "raw": "raw disk (write + fsync)",
}

#: One save, timed inside ``measure``: ``op(t0, rep)`` returns its figures (stall, commit...).
SaveOp = Callable[[float, int], dict[str, Any]]


# ---------------------------------------------------------------------------
# On the ranks


def save_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One save rank: set up, then every repeat of every save system; its records for ``save_report``."""
    import_rayckpt()
    import ray
    import torch.distributed as dist

    t_setup = time.perf_counter()
    model, optim, app = build_state(world_size, rank, seed=0, shapes=cfg["shapes"])
    total = state_bytes(app)
    sums = checksums(model, optim, compute=rank == 0) if cfg["verify"] else {}
    out: dict[str, Any] = {"rank": rank, "own_bytes": local_bytes(app), "save": {s: [] for s in SAVE_SYSTEMS}}
    out["raw_read"] = []
    if rank == 0:
        out["state_bytes"] = total
        out["checksums"] = sums
    me = {"rank": os.getpid()}

    # Ray: connect to the driver's cluster, start (and warm) the actors.
    t_ray = time.perf_counter()
    pids = connect_actors(cfg["ray_address"], rank, me)
    out["ray_connect_s"] = time.perf_counter() - t_ray
    async_pg = dist.new_group(backend="gloo")  # DCP's docs: async saves get their own gloo group

    paths = cfg["save_paths"]
    run = f"bench-{cfg['size_label']}"
    warm_code_paths(rank, {"app": app}, cfg["size_dir"], run, async_pg)

    # torch.save's full state dict: gathered once, on rank 0 (cpu_offload=True), reported apart.
    full, out["gather"] = gather_full(model, optim, me, cfg["mem_interval"])
    if rank != 0:
        full.clear()
    out["setup_s"] = time.perf_counter() - t_setup

    if rank == 0:
        out.update(memcpy_anchor())

    raw_bytes = -(-total // world_size // RAW_BLOCK) * RAW_BLOCK
    mine = os.path.join(paths["raw"], f"rank{rank}.bin")
    ops = save_ops(rank, {"app": app}, paths, run, async_pg, full, mine, raw_bytes)

    for rep in range(cfg["repeats"]):
        for system in rotated(SAVE_SYSTEMS, rep):
            if rank == 0:
                clear_target(system, paths[system])
            op = functools.partial(ops[system], rep=rep)
            rec = measure(op, pids if system == "rayckpt_ray" else me, cfg["mem_interval"])
            rec["repeat"] = rep
            out["save"][system].append(rec)
            if system == "raw":
                out["raw_read"].append(raw_read(mine, raw_bytes, me, cfg["mem_interval"], rep))
                os.unlink(mine)
    dist.barrier()
    full.clear()
    ray.shutdown()
    return out


def connect_actors(address: str, rank: int, me: dict[str, int]) -> dict[str, int]:
    """Join the Ray cluster and warm the MetadataActor and this node's ShardWriter; the pids whose
    memory the Ray save samples (rank 0 also samples the writer's process)."""
    import ray

    from rayckpt.ray.metadata.actor import get_metadata_actor
    from rayckpt.ray.writer.actor import get_shard_writer

    connect_ray(address)
    ray.get(get_metadata_actor().ping.remote())
    writer = get_shard_writer()
    ray.get(writer.node.remote())
    pids = dict(me)
    if rank == 0:
        try:
            pids["writer"] = ray.get(writer.__ray_call__.remote(lambda self: os.getpid()))
        except Exception:  # noqa: BLE001 - memory of the writer is optional
            pass
    return pids


def warm_code_paths(rank: int, state: dict[str, Any], size_dir: str, run: str, async_pg: Any) -> None:
    """Warm every code path once on a tiny state (imports, actors, the gloo subgroup), and make the
    rank's staging buffer as ``Checkpointer.restore`` does, so the first timed save pays for neither."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from rayckpt.ray.rank import async_save

    warm_dir = os.path.join(size_dir, "warmup")
    tiny = {"warm": {f"r{rank}": torch.full((1024,), float(rank))}}
    rayckpt.save(tiny, os.path.join(warm_dir, "rayckpt"))
    async_save.save_async(tiny, os.path.join(warm_dir, "ray"), run=run + "-warmup").wait()
    async_save.prepare_staging(state)  # what Checkpointer.restore does before training
    dcp.save(tiny, storage_writer=dcp.FileSystemWriter(os.path.join(warm_dir, "dcp")))
    fut = dcp.async_save(
        tiny, storage_writer=dcp.FileSystemWriter(os.path.join(warm_dir, "dcp_async")), process_group=async_pg
    )
    getattr(fut, "upload_completion", fut).result()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(warm_dir, ignore_errors=True)


def gather_full(model: Any, optim: Any, me: dict[str, int], interval: float) -> tuple[dict[str, Any], dict]:
    """The full state dict for torch.save (a collective; every rank gets it) and the gather's record."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full: dict[str, Any] = {}

    def gather(t0: float) -> dict[str, Any]:
        msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        full.update({"model": msd, "optim": osd, "step": 7})
        return {}

    return full, measure(gather, me, interval)


def save_ops(
    rank: int,
    state: dict[str, Any],
    paths: dict[str, str],
    run: str,
    async_pg: Any,
    full: dict[str, Any],
    mine: str,
    raw_bytes: int,
) -> dict[str, SaveOp]:
    """The timed part of each save system; ``t0`` is when ``measure`` started the clock."""
    import torch.distributed.checkpoint as dcp

    from rayckpt.ray.rank import async_save

    blob = memoryview(bytearray(os.urandom(RAW_BLOCK)))

    def op_rayckpt(t0: float, rep: int) -> dict[str, Any]:
        info = rayckpt.save(state, paths["rayckpt"])
        t = time.perf_counter() - t0
        return {"stall": t, "commit": t, "bytes_written": info.bytes_written}

    def op_ray(t0: float, rep: int) -> dict[str, Any]:
        handle = async_save.save_async(state, paths["rayckpt_ray"], run=run, step=rep)
        returned = time.perf_counter() - t0
        entry = handle.wait()
        commit = time.perf_counter() - t0
        return {"stall": handle.stall_seconds, "stall_external": returned, "commit": commit, "status": entry.status}

    def op_dcp(t0: float, rep: int) -> dict[str, Any]:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(paths["dcp"]))
        t = time.perf_counter() - t0
        return {"stall": t, "commit": t}

    def op_dcp_async(t0: float, rep: int) -> dict[str, Any]:
        f = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(paths["dcp_async"]), process_group=async_pg)
        stall = time.perf_counter() - t0
        getattr(f, "upload_completion", f).result()
        return {"stall": stall, "commit": time.perf_counter() - t0}

    def op_torch_save(t0: float, rep: int) -> dict[str, Any]:
        if rank != 0:
            return {"stall": 0.0, "commit": 0.0}
        with open(paths["torch_save"], "wb") as f:
            torch.save(full, f)
            f.flush()
            os.fsync(f.fileno())
        t = time.perf_counter() - t0
        return {"stall": t, "commit": t}

    def op_raw(t0: float, rep: int) -> dict[str, Any]:
        write_raw(mine, raw_bytes, blob, fsync=True)
        t = time.perf_counter() - t0
        return {"stall": t, "commit": t, "bytes": raw_bytes}

    return {
        "rayckpt": op_rayckpt,
        "rayckpt_ray": op_ray,
        "dcp": op_dcp,
        "dcp_async": op_dcp_async,
        "torch_save": op_torch_save,
        "raw": op_raw,
    }


def clear_target(system: str, path: str) -> None:
    """Rank 0, untimed: an empty target for the next save, and no one's dirty pages left to flush."""
    if system == "raw":
        os.makedirs(path, exist_ok=True)
    elif os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)
    os.sync()  # untimed: no one's dirty pages get flushed inside the timed window


def raw_read(mine: str, raw_bytes: int, me: dict[str, int], interval: float, rep: int) -> dict[str, Any]:
    """Read this rank's raw-disk file back with a cold page cache: the disk's read speed for the same bytes."""
    evict([mine])
    resident = resident_fraction([mine])

    def op_read(t0: float) -> dict[str, Any]:
        n = read_raw(mine)
        assert n == raw_bytes, (n, raw_bytes)
        return {}

    rec = measure(op_read, me, interval)
    rec["repeat"] = rep
    rec["resident_before"] = resident
    return rec


# ---------------------------------------------------------------------------
# On the driver


def save_report(saved: list[dict[str, Any]], total: int) -> dict[str, Any]:
    """Per system: stall / commit / wall / persist (max over ranks; median, min-max over repeats) and memory."""
    own = [r["own_bytes"] for r in saved]
    out: dict[str, Any] = {}
    for system in SAVE_SYSTEMS:
        reps = len(saved[0]["save"][system])
        rows = [[r["save"][system][i] for r in saved] for i in range(reps)]
        stall = [max(x["stall"] for x in row) for row in rows]
        commit = [max(x["commit"] for x in row) for row in rows]
        entry: dict[str, Any] = {
            "stall_s": summary(stall, total),
            "commit_s": summary(commit, total),
            "wall_s": summary([max(x["wall"] for x in row) for row in rows], total),
            "persist_s": summary([max(x["commit"] - x["stall"] for x in row) for row in rows], total),
            "mem": mem_summary([r["save"][system] for r in saved], "rank", own),
            "repeats": [repeat_row(row) for row in rows],
        }
        if system == "rayckpt_ray":
            entry["writer_mem"] = mem_summary([saved[0]["save"][system]], "writer", [total])
        out[system] = entry
    raw_rows = [[r["raw_read"][i] for r in saved] for i in range(len(saved[0]["raw_read"]))]
    out["raw_read"] = {
        "wall_s": summary([max(x["wall"] for x in row) for row in raw_rows], total),
        "resident_before": [row[0].get("resident_before") for row in raw_rows],
    }
    g = [r["gather"] for r in saved]
    out["torch_save_gather"] = {
        "wall_s": max(x["wall"] for x in g),
        "rank0_extra_rss": g[0]["mem"]["rank"]["extra_rss"],
    }
    return out


def repeat_row(row: list[dict[str, Any]]) -> dict[str, Any]:
    """One repeat of one system, per rank."""
    return {
        "repeat": row[0]["repeat"],
        "stall_per_rank": [round(x["stall"], 4) for x in row],
        "commit_per_rank": [round(x["commit"], 4) for x in row],
        "write_bytes_per_rank": [x["io"].get("write_bytes") for x in row],
        **(
            {"stall_external_per_rank": [round(x["stall_external"], 4) for x in row]}
            if "stall_external" in row[0]
            else {}
        ),
    }
