"""The object-storage measurements: saves and N->M reshard loads on S3, rayckpt against torch DCP's fsspec I/O.

What the gloo ranks of ``suite.s3`` run (spawned by ``run_ranks``, so module-level
functions), and how their records reduce. The same pieces as the local suite
(``workload``'s FSDP2 state and checksums, ``harness.measure``, the rotation of
systems from repeat to repeat); what differs is the storage: rayckpt gets an
``s3://`` URI (pyarrow's ``S3FileSystem``), DCP an ``FsspecWriter`` /
``FsspecReader`` on the same bucket through ``s3fs`` (a fresh ``s3fs`` instance
per operation: no listing cache carried over, as in a new process). Around each
timed operation rank 0 reads the server's request counters (``s3_counter``), so
GETs and bytes are counted by the server, the same way for both systems.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch

import rayckpt
from benchmarks.common.harness import import_rayckpt, measure, mem_summary, rotated, summary
from benchmarks.common.workload import build_state, checksums, local_bytes, state_bytes, verify_loaded, zero_state
from benchmarks.suite.s3_counter import counts_delta, read_counts
from benchmarks.suite.save import connect_actors
from rayckpt.testing.s3_server import S3Endpoint

S3_SAVE_SYSTEMS = ("rayckpt", "rayckpt_ray", "dcp")
S3_LOAD_SYSTEMS = ("rayckpt", "dcp", "dcp_nocache")
S3_LABELS = {
    "rayckpt": "rayckpt (pyarrow S3FileSystem)",
    "rayckpt_ray": "rayckpt Ray save_async",
    "dcp": "torch DCP (FsspecWriter/FsspecReader, s3fs)",
    "dcp_nocache": "torch DCP, s3fs without read-ahead",
}


def dcp_storage(endpoint: S3Endpoint) -> dict[str, Any]:
    """``s3fs`` options for DCP's fsspec reader and writer: the endpoint, and a fresh instance each time."""
    return {"endpoint_url": f"http://{endpoint.host_port}", "skip_instance_cache": True}


def dcp_url(endpoint: S3Endpoint, rel: str) -> str:
    return f"s3://{endpoint.fs_path(rel)}"


def counted(op: Callable[[float], dict], rank: int, endpoint: S3Endpoint, interval: float) -> dict[str, Any]:
    """``harness.measure`` of ``op``, with the server's request counts around it (read by rank 0: the
    others wait in ``measure``'s first barrier until it has, and it reads again after the last one)."""
    before = read_counts(endpoint.host_port) if rank == 0 else {}
    rec = measure(op, {"rank": os.getpid()}, interval)
    if rank == 0:
        rec["server"] = counts_delta(before, read_counts(endpoint.host_port))
    return rec


# ---------------------------------------------------------------------------
# Saves, on --save-ranks ranks


def s3_save_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One save rank: every repeat of every system in ``S3_SAVE_SYSTEMS``; the last repeat's rayckpt and
    DCP checkpoints stay (the loads read them)."""
    import_rayckpt()
    import ray
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from rayckpt.ray.rank import async_save

    endpoint: S3Endpoint = cfg["endpoint"]
    rels: dict[str, str] = cfg["rels"]
    model, optim, app = build_state(world_size, rank, seed=0, shapes=cfg["shapes"])
    state = {"app": app}
    out: dict[str, Any] = {"rank": rank, "own_bytes": local_bytes(app), "save": {s: [] for s in S3_SAVE_SYSTEMS}}
    sums = checksums(model, optim, compute=rank == 0) if cfg["verify"] else {}
    if rank == 0:
        out["state_bytes"] = state_bytes(app)
        out["checksums"] = sums
    connect_actors(cfg["ray_address"], rank, {"rank": os.getpid()})
    run = f"bench-s3-{cfg['size_label']}"

    # Warm every code path on a tiny state (imports, actors, clients), and make the staging buffer.
    tiny = {"warm": {f"r{rank}": torch.full((1024,), float(rank))}}
    rayckpt.save(tiny, endpoint.uri(f"{rels['warmup']}/rayckpt"))
    async_save.save_async(tiny, endpoint.uri(f"{rels['warmup']}/ray"), run=run + "-warmup").wait()
    async_save.prepare_staging(state)
    dcp.save(tiny, storage_writer=FsspecWriter(dcp_url(endpoint, f"{rels['warmup']}/dcp"), **dcp_storage(endpoint)))
    dist.barrier()
    if rank == 0:
        endpoint.delete(rels["warmup"])

    def op_rayckpt(t0: float, rep: int) -> dict[str, Any]:
        info = rayckpt.save(state, endpoint.uri(rels["rayckpt"]))
        t = time.perf_counter() - t0
        return {"stall": t, "commit": t, "bytes_written": info.bytes_written}

    def op_ray(t0: float, rep: int) -> dict[str, Any]:
        handle = async_save.save_async(state, endpoint.uri(rels["rayckpt_ray"]), run=run, step=rep)
        entry = handle.wait()
        return {"stall": handle.stall_seconds, "commit": time.perf_counter() - t0, "status": entry.status}

    def op_dcp(t0: float, rep: int) -> dict[str, Any]:
        dcp.save(state, storage_writer=FsspecWriter(dcp_url(endpoint, rels["dcp"]), **dcp_storage(endpoint)))
        t = time.perf_counter() - t0
        return {"stall": t, "commit": t}

    ops = {"rayckpt": op_rayckpt, "rayckpt_ray": op_ray, "dcp": op_dcp}
    for rep in range(cfg["repeats"]):
        for system in rotated(S3_SAVE_SYSTEMS, rep):
            if rank == 0:
                endpoint.delete(rels[system])  # untimed: an empty target
            rec = counted(functools.partial(ops[system], rep=rep), rank, endpoint, cfg["mem_interval"])
            rec["repeat"] = rep
            out["save"][system].append(rec)
    dist.barrier()
    if rank == 0:
        endpoint.delete(rels["rayckpt_ray"])  # measured; not loaded
    ray.shutdown()
    return out


# ---------------------------------------------------------------------------
# Loads, on the M ranks of one reshard


def s3_load_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One load rank of an N->M reshard: every repeat of rayckpt and DCP loads from S3 (DCP also with s3fs's
    read-ahead off; the first load of each into a zeroed state, verified bit-exact); then, if asked, the
    M-rank checkpoints for a later M->K."""
    import_rayckpt()
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    endpoint: S3Endpoint = cfg["endpoint"]
    sources: dict[str, str] = cfg["sources"]
    t_setup = time.perf_counter()
    model, optim, app = build_state(world_size, rank, seed=100, shapes=cfg["shapes"])
    state = {"app": app}
    out: dict[str, Any] = {
        "rank": rank,
        "own_bytes": local_bytes(app),
        "load": {s: [] for s in S3_LOAD_SYSTEMS},
        "verified": {},
        "setup_s": time.perf_counter() - t_setup,
    }

    def op_rayckpt(t0: float) -> dict[str, Any]:
        info = rayckpt.load(state, endpoint.uri(sources["rayckpt"]))
        return {
            "bytes_needed": info.bytes_needed,
            "bytes_read": info.bytes_read,
            "bytes_fetched": info.bytes_fetched,
            "requests": info.requests,
        }

    def op_dcp(t0: float, **options: Any) -> dict[str, Any]:
        reader = FsspecReader(dcp_url(endpoint, sources["dcp"]), **dcp_storage(endpoint), **options)
        dcp.load(state, storage_reader=reader)
        return {}

    # s3fs's default read-ahead cache fetches a block (50 MiB) past each read; "none" fetches what is read.
    nocache = functools.partial(op_dcp, default_cache_type="none")
    ops = {"rayckpt": op_rayckpt, "dcp": op_dcp, "dcp_nocache": nocache}
    for rep in range(cfg["repeats"]):
        for system in rotated(S3_LOAD_SYSTEMS, rep):
            if rep == 0 and cfg["verify"]:
                zero_state(model, optim, app)
            rec = counted(ops[system], rank, endpoint, cfg["mem_interval"])
            rec["repeat"] = rep
            out["load"][system].append(rec)
            if rep == 0 and cfg["verify"]:
                out["verified"][system] = verify_loaded(system, model, optim, app, cfg["checksums"])

    resave = cfg.get("resave")
    if resave:
        if rank == 0:
            for rel in resave.values():
                endpoint.delete(rel)
        dist.barrier()
        rayckpt.save(state, endpoint.uri(resave["rayckpt"]))
        dcp.save(state, storage_writer=FsspecWriter(dcp_url(endpoint, resave["dcp"]), **dcp_storage(endpoint)))
    dist.barrier()
    return out


# ---------------------------------------------------------------------------
# On the driver


def server_summary(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The server's counts of each repeat (rank 0's records): object GETs, their bytes, every request,
    PUTs and their bytes; plus the kinds of the first repeat in full."""

    def total(rec: dict[str, Any], kind: str, field: str) -> int:
        return rec["server"].get(kind, {}).get(field, 0)

    return {
        "get_requests": [total(r, "GET_object", "requests") for r in recs],
        "get_bytes": [total(r, "GET_object", "bytes_out") for r in recs],
        "all_requests": [sum(c["requests"] for c in r["server"].values()) for r in recs],
        "put_requests": [total(r, "PUT", "requests") for r in recs],
        "put_bytes": [total(r, "PUT", "bytes_in") for r in recs],
        "by_kind_first_repeat": recs[0]["server"],
    }


def s3_save_report(saved: list[dict[str, Any]], total: int) -> dict[str, Any]:
    """Per system: stall and commit (max over ranks; median, min-max over repeats), memory, server counts."""
    own = [r["own_bytes"] for r in saved]
    out: dict[str, Any] = {}
    for system in S3_SAVE_SYSTEMS:
        reps = len(saved[0]["save"][system])
        rows = [[r["save"][system][i] for r in saved] for i in range(reps)]
        out[system] = {
            "stall_s": summary([max(x["stall"] for x in row) for row in rows], total),
            "commit_s": summary([max(x["commit"] for x in row) for row in rows], total),
            "mem": mem_summary([r["save"][system] for r in saved], "rank", own),
            "server": server_summary(saved[0]["save"][system]),
            "commit_per_rank": [[round(x["commit"], 3) for x in row] for row in rows],
        }
    return out


def s3_load_report(loaded: list[dict[str, Any]], total: int) -> dict[str, Any]:
    """Per system: load time, server-counted GETs and bytes against the bytes needed, and for rayckpt its own
    ``LoadInfo`` figures (requests, bytes fetched) next to the server's."""
    own = [r["own_bytes"] for r in loaded]
    needed = [r["load"]["rayckpt"][0]["bytes_needed"] for r in loaded]
    out: dict[str, Any] = {"ranks": len(loaded), "own_bytes_per_rank": own, "bytes_needed_per_rank": needed}
    for system in S3_LOAD_SYSTEMS:
        recs0 = loaded[0]["load"][system]
        rows = [[r["load"][system][i] for r in loaded] for i in range(len(recs0))]
        server = server_summary(recs0)
        entry: dict[str, Any] = {
            "wall_s": summary([max(x["wall"] for x in row) for row in rows], total),
            "mem": mem_summary([r["load"][system] for r in loaded], "rank", own),
            "verified_tensors": loaded[0]["verified"].get(system),
            "server": server,
            "read_amplification": [b / max(sum(needed), 1) for b in server["get_bytes"]],
        }
        if system == "rayckpt":
            entry["loadinfo"] = {
                "requests": [sum(x["requests"] for x in row) for row in rows],
                "bytes_fetched": [sum(x["bytes_fetched"] for x in row) for row in rows],
                "bytes_read": [sum(x["bytes_read"] for x in row) for row in rows],
                "requests_per_rank_first": [x["requests"] for x in rows[0]],
                "bytes_fetched_per_rank_first": [x["bytes_fetched"] for x in rows[0]],
            }
        out[system] = entry
    return out
