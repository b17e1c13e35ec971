"""What the suite's gloo ranks run, on a local disk or an S3 endpoint alike, and how their records reduce."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import torch

from benchmarks.common import systems
from benchmarks.common.diskio import RAW_BLOCK, evict, read_raw, warm_up, write_raw
from benchmarks.common.harness import connect_ray, import_rayckpt, measure, mem_summary, rotated, summary
from benchmarks.common.systems import Where
from benchmarks.common.workload import build_state, checksums, state_bytes, verify_loaded, zero_state

#: Per storage: the save systems and the load systems.
SAVES = {
    "local": ("rayckpt", "rayckpt_ray", "dcp", "dcp_async", "dcp_rayckpt", "torch_save", "raw"),
    "s3": ("rayckpt", "rayckpt_ray", "dcp", "dcp_rayckpt"),
}
LOADS = {
    "local": ("rayckpt", "dcp", "dcp_rayckpt", "torch_load", "rayckpt_warm", "dcp_warm", "dcp_rayckpt_warm"),
    "s3": ("rayckpt", "dcp", "dcp_rayckpt", "dcp_nocache"),
}
#: The checkpoint each load system reads: its saving system's (a ``_warm`` one's: its cold one's).
SOURCE = {"dcp_nocache": "dcp", "torch_load": "torch_save"}


def counted(op: Any, rank: int, where: Where, pids: dict[str, int], interval: float) -> dict[str, Any]:
    """``measure`` of ``op``; on an endpoint, with the server's request counts around it (read by rank 0:
    the others wait in ``measure``'s first barrier until it has)."""
    from testbed.s3_counter import counts_delta, read_counts

    s3 = where.endpoint is not None and rank == 0
    before = read_counts(where.endpoint.host_port) if s3 else {}
    rec = measure(op, pids, interval)
    if s3:
        rec["server"] = counts_delta(before, read_counts(where.endpoint.host_port))
    return rec


def save_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One save rank: every repeat of every save system; its records for ``save_report``."""
    import_rayckpt()
    import ray
    import torch.distributed as dist

    where: Where = cfg["where"]
    rels: dict[str, str] = cfg["rels"]
    model, optim, app = build_state(world_size, rank, seed=0, shapes=cfg["shapes"])
    state = {"app": app}
    names = SAVES[cfg["storage"]]
    out: dict[str, Any] = {"rank": rank, "own_bytes": state_bytes(app, local=True), "save": {s: [] for s in names}}
    out["raw_read"] = []
    sums = checksums(model, optim, compute=rank == 0) if cfg["verify"] else {}
    if rank == 0:
        out.update(state_bytes=state_bytes(app), checksums=sums)
    me = {"rank": os.getpid()}
    pids = connect_actors(cfg["ray_address"], rank, me)
    options = {"dcp_async": {"group": dist.new_group(backend="gloo") if "dcp_async" in names else None}}

    tiny = {"warm": {f"r{rank}": torch.full((1024,), float(rank))}}
    for system in (s for s in names if s in systems.SAVES):  # untimed: each system's first call
        options["rayckpt_ray"] = {"run": cfg["run"] + "-warmup", "step": 0}
        systems.save(system, tiny, where, f"{rels['warmup']}/{system}", **options.get(system, {}))
    systems.prepare_staging(state)
    dist.barrier()
    if rank == 0:
        where.delete(rels["warmup"])

    full: dict[str, Any] = {}
    if "torch_save" in names:  # gathered once, reported apart
        out["gather"] = measure(lambda t0: full.update(systems.full_state(model, optim), step=7), me)
        if rank != 0:
            full.clear()
    raw_bytes = -(-state_bytes(app) // world_size // RAW_BLOCK) * RAW_BLOCK
    mine = os.path.join(where.uri(rels.get("raw", "raw")), f"rank{rank}.bin")
    if "raw" in names:
        os.makedirs(os.path.dirname(mine), exist_ok=True)
    blob = memoryview(bytearray(os.urandom(RAW_BLOCK)))

    def op(system: str, t0: float, rep: int) -> dict[str, Any]:
        if system in systems.SAVES:
            options["rayckpt_ray"] = {"run": cfg["run"], "step": rep}
            done = systems.save(system, state, where, rels[system], **options.get(system, {}))
            if system == "rayckpt_ray":  # the handle's own stall; the call's return as seen from outside
                done |= {"stall": done["info"].stall_seconds, "stall_external": done["stall"]}
            return {k: v for k, v in done.items() if k != "info"}
        if system == "torch_save" and rank == 0:
            systems.torch_save(full, where.uri(rels[system]))
        elif system == "raw":
            write_raw(mine, raw_bytes, blob, fsync=True)
        t = time.perf_counter() - t0
        return {"stall": t, "commit": t}

    for rep in range(cfg["repeats"]):
        for system in rotated(names, rep):
            if rank == 0 and system != "raw":
                where.delete(rels[system])  # untimed: an empty target
            if where.endpoint is None:
                os.sync()  # untimed: no one's dirty pages get flushed inside the timed window
            who = pids if system == "rayckpt_ray" else me
            rec = counted(functools.partial(op, system, rep=rep), rank, where, who, cfg["mem_interval"])
            out["save"][system].append({**rec, "repeat": rep})
            if system == "raw":
                evict([mine])
                rec = measure(lambda t0: {"bytes": read_raw(mine)}, me, cfg["mem_interval"])
                out["raw_read"].append({**rec, "repeat": rep})
                os.unlink(mine)
    dist.barrier()
    full.clear()
    systems.release_staging()
    ray.shutdown()
    return out


def connect_actors(address: str, rank: int, me: dict[str, int]) -> dict[str, int]:
    """Join the Ray cluster and warm the MetadataActor and this node's ShardWriter; the pids whose memory
    the Ray save samples (rank 0 also the writer's)."""
    import ray

    from rayckpt.ray import get_metadata_actor, get_shard_writer

    connect_ray(address)
    ray.get(get_metadata_actor().ping.remote())
    writer = get_shard_writer()
    ray.get(writer.node.remote())
    pids = dict(me)
    if rank == 0:
        try:
            pids["writer"] = ray.get(writer.__ray_call__.remote(lambda self: os.getpid()))
        except Exception:  # noqa: BLE001 - the writer's memory is optional
            pass
    return pids


def load_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One load rank of an N->M reshard: every repeat of every load system in ``cfg["sources"]``."""
    import_rayckpt()
    import torch.distributed as dist

    where: Where = cfg["where"]
    sources: dict[str, str] = cfg["sources"]
    t_setup = time.perf_counter()
    model, optim, app = build_state(world_size, rank, seed=100, shapes=cfg["shapes"])
    state = {"app": app}
    names = [s for s in LOADS[cfg["storage"]] if SOURCE.get(s, s.removesuffix("_warm")) in sources]
    out: dict[str, Any] = {"rank": rank, "own_bytes": state_bytes(app, local=True), "load": {s: [] for s in names}}
    out.update(verified={}, setup_s=time.perf_counter() - t_setup)
    every_file = [f for rel in sources.values() for f in where.files(rel)]
    me = {"rank": os.getpid()}

    def op(system: str, t0: float) -> dict[str, Any]:
        rel = sources[SOURCE.get(system, system.removesuffix("_warm"))]
        if system == "torch_load":
            read_s, rest = systems.torch_load(model, optim, where.uri(rel))
            app.extras["step"] = rest["step"]
            return {"read_s": read_s}
        info = systems.load(system, state, where, rel)
        keys = ("bytes_needed", "bytes_read", "bytes_fetched", "requests", "num_reads")
        return {k: getattr(info, k) for k in keys if hasattr(info, k)}

    for rep in range(cfg["repeats"]):
        for system in rotated(names, rep):
            if rep == 0 and cfg["verify"]:
                zero_state(model, optim, app)
            if rank == 0 and every_file:
                evict(every_file)
                if system.endswith("_warm"):
                    warm_up(where.files(sources[SOURCE.get(system, system.removesuffix("_warm"))]))
            rec = counted(functools.partial(op, system), rank, where, me, cfg["mem_interval"])
            out["load"][system].append({**rec, "repeat": rep})
            if rep == 0 and cfg["verify"]:
                out["verified"][system] = verify_loaded(system, model, optim, app, cfg["checksums"])

    resave = cfg.get("resave")
    if resave:  # the checkpoints of this world size, for later M->K loads
        if rank == 0:
            for rel in resave.values():
                where.delete(rel)
        dist.barrier()
        for system, rel in resave.items():
            systems.save(system, state, where, rel)
    dist.barrier()
    return out


def server_summary(recs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The server's counts of each repeat (rank 0's records): object GETs and their bytes, all requests,
    PUTs and their bytes; the kinds of the first repeat in full."""
    if "server" not in recs[0]:
        return None
    fields = {"get_requests": ("GET_object", "requests"), "get_bytes": ("GET_object", "bytes_out")}
    fields |= {"put_requests": ("PUT", "requests"), "put_bytes": ("PUT", "bytes_in")}
    out = {name: [r["server"].get(kind, {}).get(f, 0) for r in recs] for name, (kind, f) in fields.items()}
    out["all_requests"] = [sum(c["requests"] for c in r["server"].values()) for r in recs]
    return out | {"by_kind_first_repeat": recs[0]["server"]}


def rows_of(ranks: list[dict[str, Any]], kind: str, system: str) -> list[list[dict[str, Any]]]:
    """Per repeat, every rank's record of ``system``."""
    return [[r[kind][system][i] for r in ranks] for i in range(len(ranks[0][kind][system]))]


def save_report(saved: list[dict[str, Any]], total: int) -> dict[str, Any]:
    """Per system: stall / commit / persist (max over ranks; median, min-max over repeats), memory, server."""
    own = [r["own_bytes"] for r in saved]
    out: dict[str, Any] = {}
    for system in saved[0]["save"]:
        rows = rows_of(saved, "save", system)
        out[system] = {f"{k}_s": summary([max(x[k] for x in row) for row in rows], total) for k in ("stall", "commit")}
        out[system]["persist_s"] = summary([max(x["commit"] - x["stall"] for x in row) for row in rows], total)
        out[system] |= {"mem": mem_summary([r["save"][system] for r in saved], "rank", own)}
        out[system] |= {"server": server_summary(saved[0]["save"][system])}
    out["rayckpt_ray"]["writer_mem"] = mem_summary([saved[0]["save"]["rayckpt_ray"]], "writer", [total])
    if saved[0]["raw_read"]:
        reads = [[r["raw_read"][i] for r in saved] for i in range(len(saved[0]["raw_read"]))]
        out["raw_read"] = {"wall_s": summary([max(x["wall"] for x in row) for row in reads], total)}
    if "gather" in saved[0]:
        g = [r["gather"] for r in saved]
        out["torch_save_gather"] = {
            "wall_s": max(x["wall"] for x in g),
            "rank0_extra_rss": g[0]["mem"]["rank"]["extra_rss"],
        }
    return out


def load_report(loaded: list[dict[str, Any]], total: int) -> dict[str, Any]:
    """Per system: load time (max over ranks; median, min-max over repeats), bytes read against the bytes
    needed (read amplification: on S3 the server's GET bytes), memory."""
    own = [r["own_bytes"] for r in loaded]
    needed = [r["load"]["rayckpt"][0]["bytes_needed"] for r in loaded]
    out: dict[str, Any] = {"ranks": len(loaded), "own_bytes_per_rank": own, "bytes_needed_per_rank": needed}
    for system in loaded[0]["load"]:
        rows = rows_of(loaded, "load", system)
        server = server_summary(loaded[0]["load"][system])
        if server:
            read = [float(b) for b in server["get_bytes"]]
        elif "bytes_read" in rows[0][0]:  # rayckpt's LoadInfo
            read = [float(sum(x["bytes_read"] for x in row)) for row in rows]
        else:
            read = [float(sum(x["io"].get("rchar", 0) for x in row)) for row in rows]
        out[system] = {
            "wall_s": summary([max(x["wall"] for x in row) for row in rows], total),
            "mem": mem_summary([r["load"][system] for r in loaded], "rank", own),
            "verified_tensors": loaded[0]["verified"].get(system),
            "bytes_read": read,
            "read_amplification": [b / max(sum(needed), 1) for b in read],
            "server": server,
        }
        if "requests" in rows[0][0]:
            fetched = ("requests", "bytes_fetched")
            out[system]["loadinfo"] = {k: [sum(x[k] for x in row) for row in rows] for k in fetched}
        if system == "torch_load":
            out[system]["read_only_s"] = summary([max(x["read_s"] for x in row) for row in rows], total)
    return out
