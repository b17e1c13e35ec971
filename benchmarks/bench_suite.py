"""The benchmark suite: rayckpt against torch DCP, torch.save and the raw disk, in one run.

For each state size (FSDP2 state of fp32 params + AdamW moments, built like
``bench_engine``: uneven ``Linear`` layers, ``fully_shard``-ed on a 1-D CPU mesh):

save, ``--save-ranks`` (4) gloo ranks, systems alternated within each repeat (the
order rotates from repeat to repeat):

- ``rayckpt``: ``rayckpt.save`` in process (returns once committed);
- ``rayckpt Ray async``: ``rayckpt.ray.async_save.save_async`` from ranks connected to
  a local Ray cluster the driver starts (``ray.init(num_cpus=8)``; each rank calls
  ``ray.init(address=...)``); stall = ``SaveHandle.stall_seconds``, commit = from
  the barrier before ``save_async`` until ``handle.wait()`` returns (staging as
  configured: ``RAYCKPT_STAGING``, default the reusable /dev/shm buffer);
- ``torch DCP``: ``dcp.save`` with ``FileSystemWriter`` defaults;
- ``torch DCP async``: ``dcp.async_save`` (thread executor, ``FileSystemWriter``
  as its stager, a separate gloo group); stall = until it returns, commit = until
  the future's ``result()``;
- ``torch.save``: the full state dict, gathered once per size before the repeats
  on rank 0 (``get_state_dict(..., full_state_dict=True, cpu_offload=True)``; the
  gather is reported apart), then ``torch.save`` + fsync on rank 0 (timed);
- ``raw disk``: every rank writes its share of the same bytes sequentially, then
  fsync; then reads it back with a cold page cache.

load, for each reshard N->M (default 4->3, 4->2, 2->4, 4->1): M fresh ranks load
rayckpt (in process, ``rayckpt.load``) and DCP (``dcp.load``) checkpoints saved by
N ranks, alternated, the page cache evicted (fsync + fadvise DONTNEED) before each
load; on 4->1 also ``torch.load`` of the torch.save file plus
``set_state_dict`` on the single rank. The checkpoints of 2 ranks are saved by the
4->2 ranks after their loads. The first load of each system is verified against
checksums of the saved state (every full param and moment, bit-exact).

Figures: stall and commit (max over ranks; the median and min-max over repeats),
load time, read amplification (rayckpt: LoadInfo bytes_read / bytes_needed; DCP:
bytes read through read() (``rchar``) / the same bytes_needed), peak extra memory
per rank (its RSS sampled every 5 ms from /proc/self/status in a thread; peak minus
the RSS just before the operation; also anonymous + shared memory, without
file-backed pages; for the Ray save also the ShardWriter actor's process), the
rank's own shard bytes for comparison, and on-disk bytes.

Then planning at scale, no I/O (``benchmarks.bench_plan`` in its own process,
``--plan-scale`` SAVEDxTENSORSxTARGET, default 1024x2000x1000): the bulk planner
for all target ranks, one rank's plan, the per-rank planner (extrapolated), save
planning, and the manifest's encode/decode, with time and memory.
``benchmarks/NOTES.md`` (what was tried for each target, and what it gained) is
appended to the markdown.

    .venv/bin/python -m benchmarks.bench_suite --sizes-mb 256,1024 --repeats 3 --out bench_out

Writes ``{out}/bench_suite.json``, ``{out}/bench_suite.png`` (the target ratios)
and ``BENCHMARKS.md`` at the repository root (``--markdown`` to change it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import torch

import rayckpt
from benchmarks.bench_engine import (
    RAW_BLOCK,
    build_state,
    checksums,
    dir_bytes,
    evict,
    files_under,
    io_delta,
    layer_shapes,
    memcpy_anchor,
    proc_io,
    read_raw,
    resident_fraction,
    state_bytes,
    verify_loaded,
    write_raw,
)
from rayckpt.testing.multiproc import run_ranks

REPO_ROOT = Path(__file__).resolve().parent.parent
SAVE_SYSTEMS = ("rayckpt", "rayckpt_ray", "dcp", "dcp_async", "torch_save", "raw")
LOAD_SYSTEMS = ("rayckpt", "dcp", "torch_load", "rayckpt_warm", "dcp_warm")
#: Loads with the checkpoint already in the page cache (a restart on the same node).
WARM_SYSTEMS = {"rayckpt_warm": "rayckpt", "dcp_warm": "dcp"}
LABELS = {
    "rayckpt": "rayckpt save (sync, in process)",
    "rayckpt_ray": "rayckpt Ray save_async",
    "dcp": "torch DCP save",
    "dcp_async": "torch DCP async_save",
    "torch_save": "torch.save (rank 0, full state)",
    "raw": "raw disk (write + fsync)",
}
LOAD_LABELS = {
    "rayckpt": "rayckpt load",
    "dcp": "torch DCP load",
    "torch_load": "torch.load + set_state_dict (1 proc)",
    "rayckpt_warm": "rayckpt load, page cache warm",
    "dcp_warm": "torch DCP load, page cache warm",
}
#: "Bounded buffer" allowed on top of a rank's own shard in the memory target.
MEM_BUFFER_BYTES = 64 * 2**20
#: Planning target: all target ranks' plans in under this many seconds.
PLAN_TARGET_S = 1.0
#: What was tried for the targets and what each change gained (appended to BENCHMARKS.md).
NOTES = REPO_ROOT / "benchmarks" / "NOTES.md"
MIB = 2**20
SAMPLE_INTERVAL_S = 0.005


# ---------------------------------------------------------------------------
# Memory sampling


_MEM_FIELDS = {b"VmRSS:": "rss", b"RssAnon:": "anon", b"RssFile:": "file", b"RssShmem:": "shmem"}


def read_mem(fd: int) -> dict[str, int] | None:
    """VmRSS / RssAnon / RssFile / RssShmem in bytes from an open /proc/<pid>/status."""
    try:
        data = os.pread(fd, 8192, 0)
    except OSError:
        return None
    out = {}
    for line in data.split(b"\n"):
        parts = line.split()
        if parts and parts[0] in _MEM_FIELDS:
            out[_MEM_FIELDS[parts[0]]] = int(parts[1]) * 1024
    return out if "rss" in out else None


class MemSampler:
    """Peak RSS of some processes (this one and e.g. a Ray actor) over a window, sampled in a thread."""

    def __init__(self, pids: dict[str, int], interval: float = SAMPLE_INTERVAL_S) -> None:
        self.pids = pids
        self.interval = interval
        self._fds: dict[str, int] = {}
        self._base: dict[str, dict[str, int]] = {}
        self._peak: dict[str, dict[str, int]] = {}
        self._samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        for label, fd in self._fds.items():
            m = read_mem(fd)
            if m is None:
                continue
            peak = self._peak[label]
            peak["rss"] = max(peak["rss"], m["rss"])
            peak["anon_shmem"] = max(peak["anon_shmem"], m.get("anon", 0) + m.get("shmem", 0))
            for k in ("anon", "file", "shmem"):
                peak[k] = max(peak[k], m.get(k, 0))
        self._samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()
        # interval 0: no thread (start() does not start one); only the before/after samples.

    def start(self) -> MemSampler:
        for label, pid in self.pids.items():
            try:
                fd = os.open(f"/proc/{pid}/status", os.O_RDONLY)
            except OSError:
                continue
            base = read_mem(fd)
            if base is None:
                os.close(fd)
                continue
            self._fds[label] = fd
            self._base[label] = base
            self._peak[label] = {
                "rss": base["rss"],
                "anon_shmem": base.get("anon", 0) + base.get("shmem", 0),
                **{k: base.get(k, 0) for k in ("anon", "file", "shmem")},
            }
        if self.interval > 0:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> dict[str, dict[str, int]]:
        self._sample()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        out = {}
        for label, base in self._base.items():
            peak = self._peak[label]
            out[label] = {
                "base_rss": base["rss"],
                "extra_rss": peak["rss"] - base["rss"],
                "extra_anon_shmem": peak["anon_shmem"] - base.get("anon", 0) - base.get("shmem", 0),
                **{f"extra_{k}": peak[k] - base.get(k, 0) for k in ("anon", "file", "shmem")},
                "samples": self._samples,
            }
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        return out


# ---------------------------------------------------------------------------
# Helpers on the ranks


def local_bytes(app: Any) -> int:
    """Bytes of this rank's own shards (DTensors: the local part) in the app's state."""
    return state_bytes(app, local=True)


def zero_state(model: Any, optim: Any, app: Any) -> None:
    """Zero every local param and moment (and the steps): a load must then write all of them."""
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
            st = optim.state[p]
            st["exp_avg"].to_local().zero_()
            st["exp_avg_sq"].to_local().zero_()
            st["step"].zero_()
    app.extras["step"] = 0


def warm_up(paths: list[str]) -> None:
    """Read ``paths`` once so their pages are in the page cache (for the warm loads)."""
    buf = bytearray(RAW_BLOCK)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def rotated(items: list[str] | tuple[str, ...], rep: int) -> list[str]:
    k = rep % len(items)
    return list(items[k:]) + list(items[:k])


def measure(fn: Any, pids: dict[str, int], interval: float = SAMPLE_INTERVAL_S) -> dict[str, Any]:
    """Barrier, sample memory, run ``fn(t0)``, barrier. ``fn`` returns extra figures (stall, commit...)."""
    import torch.distributed as dist

    dist.barrier()
    io0 = proc_io()
    sampler = MemSampler(pids, interval).start()
    t0 = time.perf_counter()
    extra = fn(t0) or {}
    t1 = time.perf_counter()
    mem = sampler.stop()
    dist.barrier()
    t2 = time.perf_counter()
    return {"wall": t2 - t0, "own": t1 - t0, "io": io_delta(io0, proc_io()), "mem": mem, **extra}


def connect_ray(address: str) -> None:
    import ray

    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, namespace="rayckpt-bench")


# ---------------------------------------------------------------------------
# Save side


def save_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import ray
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from rayckpt.ray import async_save
    from rayckpt.ray.metadata_actor import get_metadata_actor
    from rayckpt.ray.shard_writer import get_shard_writer

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
    connect_ray(cfg["ray_address"])
    ray.get(get_metadata_actor().ping.remote())
    writer = get_shard_writer()
    ray.get(writer.node.remote())
    pids = dict(me)
    if rank == 0:
        try:
            pids["writer"] = ray.get(writer.__ray_call__.remote(lambda self: os.getpid()))
        except Exception:  # noqa: BLE001 - memory of the writer is optional
            pass
    out["ray_connect_s"] = time.perf_counter() - t_ray
    async_pg = dist.new_group(backend="gloo")  # DCP's docs: async saves get their own gloo group

    paths = cfg["save_paths"]
    run = f"bench-{cfg['size_label']}"

    # Warm every code path once on a tiny state (imports, actors, the gloo subgroup).
    warm_dir = os.path.join(cfg["size_dir"], "warmup")
    tiny = {"warm": {f"r{rank}": torch.full((1024,), float(rank))}}
    rayckpt.save(tiny, os.path.join(warm_dir, "rayckpt"))
    async_save.save_async(tiny, os.path.join(warm_dir, "ray"), run=run + "-warmup").wait()
    async_save.prepare_staging({"app": app})  # what Checkpointer.restore does before training
    dcp.save(tiny, storage_writer=dcp.FileSystemWriter(os.path.join(warm_dir, "dcp")))
    fut = dcp.async_save(
        tiny, storage_writer=dcp.FileSystemWriter(os.path.join(warm_dir, "dcp_async")), process_group=async_pg
    )
    getattr(fut, "upload_completion", fut).result()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(warm_dir, ignore_errors=True)

    # torch.save's full state dict: gathered once, on rank 0 (cpu_offload=True), reported apart.
    full: dict[str, Any] = {}

    def gather(t0: float) -> dict[str, Any]:
        msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        full.update({"model": msd, "optim": osd, "step": 7})
        return {}

    out["gather"] = measure(gather, me, cfg["mem_interval"])
    if rank != 0:
        full.clear()
    out["setup_s"] = time.perf_counter() - t_setup

    if rank == 0:
        out.update(memcpy_anchor())

    raw_dir = paths["raw"]
    raw_bytes = -(-total // world_size // RAW_BLOCK) * RAW_BLOCK
    blob = memoryview(bytearray(os.urandom(RAW_BLOCK)))
    mine = os.path.join(raw_dir, f"rank{rank}.bin")
    state = {"app": app}

    def op_rayckpt(t0: float) -> dict[str, Any]:
        info = rayckpt.save(state, paths["rayckpt"])
        t = time.perf_counter() - t0
        return {"stall": t, "commit": t, "bytes_written": info.bytes_written}

    def op_ray(t0: float, rep: int) -> dict[str, Any]:
        handle = async_save.save_async(state, paths["rayckpt_ray"], run=run, step=rep)
        returned = time.perf_counter() - t0
        entry = handle.wait()
        commit = time.perf_counter() - t0
        return {"stall": handle.stall_seconds, "stall_external": returned, "commit": commit, "status": entry.status}

    def op_dcp(t0: float) -> dict[str, Any]:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(paths["dcp"]))
        t = time.perf_counter() - t0
        return {"stall": t, "commit": t}

    def op_dcp_async(t0: float) -> dict[str, Any]:
        f = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(paths["dcp_async"]), process_group=async_pg)
        stall = time.perf_counter() - t0
        getattr(f, "upload_completion", f).result()
        return {"stall": stall, "commit": time.perf_counter() - t0}

    def op_torch_save(t0: float) -> dict[str, Any]:
        if rank != 0:
            return {"stall": 0.0, "commit": 0.0}
        with open(paths["torch_save"], "wb") as f:
            torch.save(full, f)
            f.flush()
            os.fsync(f.fileno())
        t = time.perf_counter() - t0
        return {"stall": t, "commit": t}

    def op_raw(t0: float) -> dict[str, Any]:
        write_raw(mine, raw_bytes, blob, fsync=True)
        t = time.perf_counter() - t0
        return {"stall": t, "commit": t, "bytes": raw_bytes}

    for rep in range(cfg["repeats"]):
        for system in rotated(SAVE_SYSTEMS, rep):
            path = paths[system]
            if rank == 0:
                if system == "raw":
                    os.makedirs(path, exist_ok=True)
                elif os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.unlink(path)
                os.sync()  # untimed: no one's dirty pages get flushed inside the timed window
            ops = {
                "rayckpt": op_rayckpt,
                "rayckpt_ray": lambda t0, rep=rep: op_ray(t0, rep),
                "dcp": op_dcp,
                "dcp_async": op_dcp_async,
                "torch_save": op_torch_save,
                "raw": op_raw,
            }
            rec = measure(ops[system], pids if system == "rayckpt_ray" else me, cfg["mem_interval"])
            rec["repeat"] = rep
            out["save"][system].append(rec)
            if system == "raw":
                evict([mine])
                resident = resident_fraction([mine])

                def op_read(t0: float) -> dict[str, Any]:
                    n = read_raw(mine)
                    assert n == raw_bytes, (n, raw_bytes)
                    return {}

                rec = measure(op_read, me, cfg["mem_interval"])
                rec["repeat"] = rep
                rec["resident_before"] = resident
                out["raw_read"].append(rec)
                os.unlink(mine)
    dist.barrier()
    full.clear()
    ray.shutdown()
    return out


# ---------------------------------------------------------------------------
# Load side


def load_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    t_setup = time.perf_counter()
    model, optim, app = build_state(world_size, rank, seed=100, shapes=cfg["shapes"])
    state = {"app": app}
    sources = cfg["sources"]
    systems = [s for s in LOAD_SYSTEMS if s in sources]
    out: dict[str, Any] = {
        "rank": rank,
        "own_bytes": local_bytes(app),
        "load": {s: [] for s in systems},
        "verified": {},
        "setup_s": time.perf_counter() - t_setup,
    }
    me = {"rank": os.getpid()}
    all_files = [f for p in sources.values() for f in (files_under(p) if os.path.isdir(p) else [p])]

    def op_rayckpt(t0: float) -> dict[str, Any]:
        info = rayckpt.load(state, sources["rayckpt"])
        return {"bytes_needed": info.bytes_needed, "bytes_read": info.bytes_read, "num_reads": info.num_reads}

    def op_dcp(t0: float) -> dict[str, Any]:
        dcp.load(state, storage_reader=dcp.FileSystemReader(sources["dcp"]))
        return {}

    def op_torch_load(t0: float) -> dict[str, Any]:
        sd = torch.load(sources["torch_load"], weights_only=True)
        read_s = time.perf_counter() - t0
        set_state_dict(
            model,
            optim,
            model_state_dict=sd["model"],
            optim_state_dict=sd["optim"],
            options=StateDictOptions(full_state_dict=True),
        )
        app.extras["step"] = sd["step"]
        del sd
        return {"read_s": read_s}

    ops = {"rayckpt": op_rayckpt, "dcp": op_dcp, "torch_load": op_torch_load}
    ops.update({warm: ops[cold] for warm, cold in WARM_SYSTEMS.items()})
    for rep in range(cfg["repeats"]):
        for system in rotated(systems, rep):
            if rep == 0 and cfg["verify"]:
                zero_state(model, optim, app)
            resident = None
            if rank == 0:
                out["fadvise_used"] = evict(all_files)
                p = sources[system]
                files = files_under(p) if os.path.isdir(p) else [p]
                if system in WARM_SYSTEMS:
                    warm_up(files)
                resident = resident_fraction(files)
            rec = measure(ops[system], me, cfg["mem_interval"])
            rec["repeat"] = rep
            rec["resident_before"] = resident
            out["load"][system].append(rec)
            if rep == 0 and cfg["verify"]:
                out["verified"][system] = verify_loaded(system, model, optim, app, cfg["checksums"])

    resave = cfg.get("resave")
    if resave:  # the checkpoints of this world size, for later N->M loads from it
        if rank == 0:
            for p in resave.values():
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()
        rayckpt.save(state, resave["rayckpt"])
        dcp.save(state, storage_writer=dcp.FileSystemWriter(resave["dcp"]))
    dist.barrier()
    return out


# ---------------------------------------------------------------------------
# Driver


def summary(values: list[float], nbytes: int | None = None) -> dict[str, Any]:
    med = statistics.median(values)
    out = {"values": values, "median": med, "min": min(values), "max": max(values)}
    if nbytes is not None and med > 0:
        out["GBps_median"] = nbytes / 1e9 / med
    return out


def mem_summary(recs_by_rank: list[list[dict[str, Any]]], label: str, own: list[int]) -> dict[str, Any] | None:
    """Max over repeats of each rank's peak extra memory; ``own``: each rank's own shard bytes."""
    per_rank = []
    for r, recs in enumerate(recs_by_rank):
        mems = [x["mem"][label] for x in recs if label in x.get("mem", {})]
        if not mems:
            continue
        per_rank.append(
            {
                "rank": r,
                "extra_rss": max(m["extra_rss"] for m in mems),
                "extra_anon_shmem": max(m["extra_anon_shmem"] for m in mems),
                "extra_anon": max(m["extra_anon"] for m in mems),
                "extra_file": max(m["extra_file"] for m in mems),
                "extra_shmem": max(m["extra_shmem"] for m in mems),
                "base_rss": mems[0]["base_rss"],
                "own_bytes": own[r] if r < len(own) else None,
                "samples_min": min(m["samples"] for m in mems),
            }
        )
    if not per_rank:
        return None
    over = [p["extra_rss"] - p["own_bytes"] for p in per_rank if p["own_bytes"] is not None]
    return {
        "per_rank": per_rank,
        "max_extra_rss": max(p["extra_rss"] for p in per_rank),
        "max_extra_anon_shmem": max(p["extra_anon_shmem"] for p in per_rank),
        "max_extra_anon": max(p["extra_anon"] for p in per_rank),
        "max_own_bytes": max(p["own_bytes"] or 0 for p in per_rank),
        "max_extra_rss_over_own": max(over) if over else None,
    }


def save_report(saved: list[dict[str, Any]], total: int) -> dict[str, Any]:
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
            "repeats": [
                {
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
                for row in rows
            ],
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


def load_report(loaded: list[dict[str, Any]], total: int) -> dict[str, Any]:
    own = [r["own_bytes"] for r in loaded]
    out: dict[str, Any] = {"ranks": len(loaded), "own_bytes_per_rank": own}
    needed: list[int] | None = None
    if "rayckpt" in loaded[0]["load"]:
        needed = [r["load"]["rayckpt"][0]["bytes_needed"] for r in loaded]
    for system in loaded[0]["load"]:
        reps = len(loaded[0]["load"][system])
        rows = [[r["load"][system][i] for r in loaded] for i in range(reps)]
        walls = [max(x["wall"] for x in row) for row in rows]
        entry: dict[str, Any] = {
            "wall_s": summary(walls, total),
            "mem": mem_summary([r["load"][system] for r in loaded], "rank", own),
            "resident_before": [row[0].get("resident_before") for row in rows],
            "verified_tensors": loaded[0]["verified"].get(system),
            "disk_read_bytes": [sum(x["io"].get("read_bytes", 0) for x in row) for row in rows],
            "own_s_per_rank": [[round(x["own"], 4) for x in row] for row in rows],
        }
        rchar = [x["io"].get("rchar", 0) for x in rows[0]]
        if system in ("rayckpt", "rayckpt_warm"):
            read = [x["bytes_read"] for x in rows[0]]
            entry["bytes_read_per_rank"] = read
            entry["read_amplification"] = sum(read) / max(sum(needed or [1]), 1)
        else:
            entry["bytes_read_per_rank"] = rchar
            entry["read_amplification"] = sum(rchar) / max(sum(needed), 1) if needed else None
        entry["bytes_needed_per_rank"] = needed
        entry["read_syscall_bytes_per_rank"] = rchar
        if system == "torch_load":
            entry["torch_load_only_s"] = summary([max(x.get("read_s", 0.0) for x in row) for row in rows], total)
        out[system] = entry
    return out


def ratio_row(name: str, measured: float | None, threshold: float, higher_is_better: bool, how: str) -> dict:
    met = None
    if measured is not None:
        met = measured >= threshold if higher_is_better else measured <= threshold
    return {
        "target": name,
        "measured": measured,
        "threshold": threshold,
        "direction": ">=" if higher_is_better else "<=",
        "met": met,
        "how": how,
    }


def targets(size: dict[str, Any], main_reshard: str) -> list[dict[str, Any]]:
    s = size["save"]
    dcp_save = s["dcp"]["commit_s"]["median"]
    raw_w = s["raw"]["commit_s"]["median"]
    rows = [
        ratio_row(
            "save stall: rayckpt Ray save_async / DCP save",
            s["rayckpt_ray"]["stall_s"]["median"] / dcp_save,
            0.2,
            False,
            "median SaveHandle.stall_seconds (max over ranks) / median DCP dcp.save time",
        ),
        ratio_row(
            "durable commit: rayckpt Ray save_async / DCP save",
            s["rayckpt_ray"]["commit_s"]["median"] / dcp_save,
            1.0,
            False,
            "median barrier-to-handle.wait() (max over ranks) / median dcp.save",
        ),
        ratio_row(
            "durable commit: rayckpt.save (sync) / DCP save",
            s["rayckpt"]["commit_s"]["median"] / dcp_save,
            1.0,
            False,
            "median rayckpt.save / median dcp.save",
        ),
    ]
    ld = size["load"].get(main_reshard) or {}
    for suffix, label, how in (
        ("", "", " (page cache evicted)"),
        ("_warm", ", page cache warm", ", checkpoint files read into the page cache first"),
    ):
        if "rayckpt" + suffix in ld and "dcp" + suffix in ld:
            rows.append(
                ratio_row(
                    f"reshard load {main_reshard}{label}: DCP time / rayckpt time",
                    ld["dcp" + suffix]["wall_s"]["median"] / ld["rayckpt" + suffix]["wall_s"]["median"],
                    1.5,
                    True,
                    f"median dcp.load / median rayckpt.load{how}",
                )
            )
    rows.append(
        ratio_row(
            "persist throughput: rayckpt.save (sync) / raw write+fsync",
            raw_w / s["rayckpt"]["commit_s"]["median"],
            0.8,
            True,
            "GB/s of rayckpt.save over GB/s of the raw write + fsync of the same bytes, same ranks",
        )
    )
    rows.append(
        ratio_row(
            "persist throughput: rayckpt Ray (commit - stall) / raw write+fsync",
            raw_w / s["rayckpt_ray"]["persist_s"]["median"],
            0.8,
            True,
            "GB/s of the background part of save_async (commit - stall, max over ranks) over raw",
        )
    )
    worst = []
    for label, m in (("save", s["rayckpt"]["mem"]), ("save_async rank", s["rayckpt_ray"]["mem"])):
        if m and m["max_extra_rss_over_own"] is not None:
            worst.append((m["max_extra_rss_over_own"], label))
    for reshard, entry in size["load"].items():
        m = entry.get("rayckpt", {}).get("mem")
        if m and m["max_extra_rss_over_own"] is not None:
            worst.append((m["max_extra_rss_over_own"], f"load {reshard}"))
    if worst:
        over, where = max(worst)
        rows.append(
            ratio_row(
                f"memory: rayckpt rank peak extra RSS - own shard (worst: {where}), MiB",
                over / MIB,
                MEM_BUFFER_BYTES / MIB,
                False,
                "max over ranks, repeats and rayckpt operations of (peak RSS - RSS before) - the rank's own shard "
                "bytes, against a bounded buffer of 64 MiB",
            )
        )
    w = s["rayckpt_ray"].get("writer_mem")
    if w:
        rows.append(
            ratio_row(
                "memory: ShardWriter actor peak extra private (anon) memory, MiB",
                w["max_extra_anon"] / MIB,
                MEM_BUFFER_BYTES / MIB,
                False,
                "the node's writer maps the ranks' staged shards (object store shared memory, counted at the "
                "ranks); its private memory during the save against 64 MiB",
            )
        )
    return rows


def parse_reshards(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        n, _, m = part.strip().replace("->", ":").partition(":")
        out.append((int(n), int(m)))
    return out


def busy_jiffies() -> int:
    """CPU time (clock ticks) the whole machine spent busy: /proc/stat minus idle and iowait."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:9]]
    return sum(vals) - vals[3] - vals[4]


def tree_jiffies(root: int) -> int:
    """CPU ticks of ``root`` and all its descendants (utime + stime + reaped children's)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(rest[1]), []).append(int(name))
        ticks[int(name)] = sum(int(x) for x in rest[11:15])
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += ticks.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total


def load_avg_thread(samples: list[tuple[float, float, float | None]], stop: threading.Event) -> threading.Thread:
    """Every 5 s: the 1-minute load average, and the CPU cores used by processes outside this benchmark's
    process tree (ranks, Ray and its actors are inside it; kernel threads, e.g. writeback, are outside)."""
    hz = os.sysconf("SC_CLK_TCK")

    def loop() -> None:
        prev = (time.monotonic(), busy_jiffies(), tree_jiffies(os.getpid()))
        while True:
            now = (time.monotonic(), busy_jiffies(), tree_jiffies(os.getpid()))
            dt = now[0] - prev[0]
            others = (now[1] - prev[1] - (now[2] - prev[2])) / hz / dt if dt > 0.5 else None
            if now[2] < prev[2] or (others is not None and not 0 <= others <= (os.cpu_count() or 1) + 0.5):
                others = None  # a process left the tree unaccounted (killed, reparented): no figure
            samples.append((time.time(), os.getloadavg()[0], others))
            prev = now
            if stop.wait(5.0):
                return

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def save_partial(out: str, label: str, result: dict[str, Any]) -> None:
    """What a size has measured so far, in case the run is cut short (removed at the end of a run)."""
    with open(os.path.join(out, f"bench_suite.partial-{label}.json"), "w") as f:
        json.dump(result, f, indent=1)


def run_size(args: argparse.Namespace, size_mb: float, out: str, ray_address: str) -> dict[str, Any]:
    label = f"{size_mb:g}MB"
    size_dir = os.path.join(out, f"suite_{label}")
    shutil.rmtree(size_dir, ignore_errors=True)
    n0 = args.save_ranks
    ck = {n0: {"rayckpt": os.path.join(size_dir, f"n{n0}", "rayckpt"), "dcp": os.path.join(size_dir, f"n{n0}", "dcp")}}
    save_paths = {
        "rayckpt": ck[n0]["rayckpt"],
        "rayckpt_ray": os.path.join(size_dir, f"n{n0}", "rayckpt_ray"),
        "dcp": ck[n0]["dcp"],
        "dcp_async": os.path.join(size_dir, f"n{n0}", "dcp_async"),
        "torch_save": os.path.join(size_dir, f"n{n0}", "full.pt"),
        "raw": os.path.join(size_dir, "raw"),
    }
    os.makedirs(os.path.join(size_dir, f"n{n0}"), exist_ok=True)
    shapes = layer_shapes(size_mb)
    cfg: dict[str, Any] = {
        "shapes": shapes,
        "repeats": args.repeats,
        "save_paths": save_paths,
        "size_dir": size_dir,
        "size_label": label,
        "ray_address": ray_address,
        "verify": not args.no_verify,
        "mem_interval": args.mem_interval_ms / 1000,
    }
    t0 = time.perf_counter()
    print(f"[suite] {label}: saving with {n0} ranks, {args.repeats} repeat(s)", flush=True)
    saved = run_ranks(save_worker, n0, cfg, timeout=args.timeout)
    total = saved[0]["state_bytes"]
    result: dict[str, Any] = {
        "size_mb": size_mb,
        "state_bytes": total,
        "layer_shapes_rows_cols": shapes,
        "save_ranks": n0,
        "own_bytes_per_save_rank": [r["own_bytes"] for r in saved],
        "setup_s": {
            "save_side_per_rank": [round(r["setup_s"], 2) for r in saved],
            "ray_connect_per_rank": [round(r["ray_connect_s"], 2) for r in saved],
        },
        "memcpy_GBps_1thread": saved[0].get("memcpy_GBps_1thread"),
        "torch_threads_per_rank": saved[0].get("torch_threads"),
        "save": save_report(saved, total),
        "on_disk": {},
        "load": {},
    }
    for system in SAVE_SYSTEMS:
        p = save_paths[system]
        if system == "raw":
            result["on_disk"][system] = {"bytes": saved[0]["save"]["raw"][0]["bytes"] * n0, "files": n0}
        elif os.path.isdir(p):
            b, n = dir_bytes(p)
            result["on_disk"][system] = {"bytes": b, "files": n}
        elif os.path.exists(p):
            result["on_disk"][system] = {"bytes": os.path.getsize(p), "files": 1}
    for p in (save_paths["rayckpt_ray"], save_paths["dcp_async"]):
        shutil.rmtree(p, ignore_errors=True)  # measured; not loaded
    print(f"[suite] {label}: saves done in {time.perf_counter() - t0:.0f}s", flush=True)
    save_partial(out, label, result)

    reshards = parse_reshards(args.reshards)
    pending = list(reshards)
    # Sources first: N->M runs whose M is the N of a later reshard also write M-rank checkpoints.
    needed_sources = {n for n, _ in reshards if n != n0}
    order = sorted(pending, key=lambda nm: (nm[0] != n0, nm[1] not in needed_sources))
    for n, m in order:
        name = f"{n}->{m}"
        if n not in ck:
            raise SystemExit(
                f"reshard {name}: no {n}-rank checkpoint; N must be --save-ranks ({n0}) or the M of a reshard from {n0}"
            )
        sources: dict[str, str] = dict(ck[n])
        sources.update({warm: sources[cold] for warm, cold in WARM_SYSTEMS.items()})
        if m == 1 and n == n0:
            sources["torch_load"] = save_paths["torch_save"]
        lcfg: dict[str, Any] = {
            "shapes": shapes,
            "repeats": args.repeats,
            "sources": sources,
            "checksums": saved[0]["checksums"],
            "verify": not args.no_verify,
            "mem_interval": args.mem_interval_ms / 1000,
        }
        if m in needed_sources and m not in ck:
            ck[m] = {s: os.path.join(size_dir, f"n{m}", s) for s in ("rayckpt", "dcp")}
            lcfg["resave"] = ck[m]
        t1 = time.perf_counter()
        loaded = run_ranks(load_worker, m, lcfg, timeout=args.timeout)
        result["load"][name] = load_report(loaded, total)
        result["load"][name]["fadvise_used"] = bool(loaded[0].get("fadvise_used"))
        result["load"][name]["setup_s_per_rank"] = [round(r["setup_s"], 2) for r in loaded]
        print(f"[suite] {label}: load {name} done in {time.perf_counter() - t1:.0f}s", flush=True)
        save_partial(out, label, result)
    # Report in the order asked.
    result["load"] = {f"{n}->{m}": result["load"][f"{n}->{m}"] for n, m in reshards}
    main = f"{n0}->3" if f"{n0}->3" in result["load"] else next(iter(result["load"]), "")
    result["targets"] = targets(result, main)
    result["runtime_s"] = time.perf_counter() - t0
    os.unlink(os.path.join(out, f"bench_suite.partial-{label}.json"))
    if not args.keep:
        shutil.rmtree(size_dir, ignore_errors=True)
    return result


# ---------------------------------------------------------------------------
# Markdown


def fmt(s: dict[str, Any], digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def mib(n: float | None) -> str:
    return "" if n is None else f"{n / MIB:,.0f}"


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    la = report["load_average_1min"]
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{report['command']}` on {report['date']}: {m['nproc']} CPUs, "
        f"{m['mem_total_gb']:.0f} GB RAM, torch {m['torch']}, ray {m['ray']}, pyarrow {m['pyarrow']}, "
        f"rayckpt {m['rayckpt']}. 1-minute load average: {la['before_start']:.2f} before the start; during the "
        f"run (its own 4 ranks and Ray included) min {la['min']:.2f}, median {la['median']:.2f}, max "
        f"{la['max']:.2f}; CPU used by processes outside the benchmark (kernel writeback included): mean "
        f"{la['other_processes_cpu_cores']['mean']:.2f}, max {la['other_processes_cpu_cores']['max']:.2f} "
        f"cores of {m['nproc']}. Total run time {report['total_runtime_s']:.0f} s.",
        "",
        "Numbers on a 2-core machine are noisy (+-25% run to run): read the ratios between systems measured in "
        "the same run; seconds are medians over repeats with (min-max); GB = 1e9 bytes.",
    ]
    chart = report.get("chart")
    if chart:
        lines += ["", f"Chart of the target ratios: `{chart['shown_as']}` ({chart['renderer']})."]
    for key, size in report["sizes"].items():
        s = size["save"]
        n0 = size["save_ranks"]
        own = max(size["own_bytes_per_save_rank"])
        lines += [
            "",
            f"## {size['state_bytes'] / 1e9:.3f} GB state ({key}: fp32 params + AdamW exp_avg + exp_avg_sq, "
            f"{len(size['layer_shapes_rows_cols'])} FSDP2 Linear layers)",
            "",
            f"### Save, {n0} ranks (largest own shard {mib(own)} MiB)",
            "",
            "| system | stall s (train loop blocked) | durable commit s | commit GB/s | peak extra RSS per rank, "
            "MiB (max) | of which anon+shm MiB | on-disk bytes (files) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for system in SAVE_SYSTEMS:
            e = s[system]
            disk = size["on_disk"].get(system, {})
            memo = e["mem"] or {}
            lines.append(
                f"| {LABELS[system]} | {fmt(e['stall_s'])} | {fmt(e['commit_s'])} | "
                f"{e['commit_s'].get('GBps_median', 0):.2f} | {mib(memo.get('max_extra_rss'))} | "
                f"{mib(memo.get('max_extra_anon_shmem'))} | "
                f"{disk.get('bytes', 0):,} ({disk.get('files', 0)}) |"
            )
        w = s["rayckpt_ray"].get("writer_mem")
        if w:
            lines.append(
                f"| ShardWriter actor (node's, during save_async) | | | | {mib(w['max_extra_rss'])} | "
                f"{mib(w['max_extra_anon_shmem'])} | |"
            )
        g = s["torch_save_gather"]
        lines += [
            "",
            f"Raw disk cold read of the same bytes ({n0} procs): {fmt(s['raw_read']['wall_s'])} s, "
            f"{s['raw_read']['wall_s'].get('GBps_median', 0):.2f} GB/s. torch.save's full-state gather to rank 0 "
            f"(once, not in the times above): {g['wall_s']:.2f} s, rank 0 +{mib(g['rank0_extra_rss'])} MiB RSS.",
            "",
            "### Load (page cache evicted before each load; 'page cache warm' rows: files read into it first)",
            "",
            "| reshard | system | load s | GB/s | bytes read / needed (read amp.) | peak extra RSS per rank, MiB "
            "(max) | of which anon+shm MiB | own shard MiB (max) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, ld in size["load"].items():
            for system in LOAD_SYSTEMS:
                e = ld.get(system)
                if not e:
                    continue
                amp = e.get("read_amplification")
                read = sum(e.get("bytes_read_per_rank") or [0])
                need = sum(e.get("bytes_needed_per_rank") or [0])
                amp_s = "" if amp is None else f"{mib(read)} / {mib(need)} MiB ({amp:.3f})"
                if system == "torch_load":
                    amp_s = f"whole file: {amp_s}"
                memo = e["mem"] or {}
                lines.append(
                    f"| {name} | {LOAD_LABELS[system]} | {fmt(e['wall_s'])} | "
                    f"{e['wall_s'].get('GBps_median', 0):.2f} | {amp_s} | {mib(memo.get('max_extra_rss'))} | "
                    f"{mib(memo.get('max_extra_anon_shmem'))} | {mib(max(ld['own_bytes_per_rank']))} |"
                )
            for suffix, label in (("", ""), ("_warm", ", page cache warm")):
                if "rayckpt" + suffix in ld and "dcp" + suffix in ld:
                    ratio = ld["dcp" + suffix]["wall_s"]["median"] / ld["rayckpt" + suffix]["wall_s"]["median"]
                    lines.append(
                        f"| {name} | DCP / rayckpt time{label} (>1: rayckpt faster) | {ratio:.2f} | | | | | |"
                    )
        lines += [
            "",
            "### Targets",
            "",
            "| target | measured | target | met |",
            "| --- | --- | --- | --- |",
        ]
        for t in size["targets"]:
            met = "n/a" if t["met"] is None else ("met" if t["met"] else "**not met**")
            val = "n/a" if t["measured"] is None else f"{t['measured']:.3f}"
            lines.append(f"| {t['target']} | {val} | {t['direction']} {t['threshold']:g} | {met} |")
    lines += [
        "",
        "## Method",
        "",
        "- One command runs every system on the same machine; each repeat runs every system once, in an order "
        "that rotates from repeat to repeat. Times are barrier to barrier (``dist.barrier()``) on gloo ranks "
        "spawned with ``rayckpt.testing.multiproc.run_ranks``; a figure is the max over ranks, then median (min-max) "
        "over repeats.",
        "- Stall = time the calling rank is blocked: the whole call for synchronous saves; "
        "``SaveHandle.stall_seconds`` for rayckpt's Ray ``save_async`` (plan + one copy into shared memory: the "
        "rank's staging buffer in /dev/shm, made before the repeats with ``prepare_staging`` as "
        "``Checkpointer.restore`` does, and reused by every save; it holds the rank's share between saves); "
        "until ``dcp.async_save`` returns for DCP (its staging copy). Durable commit = from the barrier before "
        "the call until the checkpoint is committed: ``handle.wait()`` / ``future.result()`` return.",
        "- The Ray path: the driver runs ``ray.init(num_cpus=8)``; every rank connects with "
        "``ray.init(address=...)``; the node's ShardWriter actor writes the staged shards and the "
        "MetadataActor commits. Actors and code paths are warmed with a tiny save first.",
        "- torch.save: the full state dict (params + optimizer) is gathered on rank 0 once per size "
        "(``get_state_dict(full_state_dict=True, cpu_offload=True)``, reported apart) and the timed part is "
        "``torch.save`` + fsync on rank 0. torch.load: ``torch.load(weights_only=True)`` + ``set_state_dict`` "
        "into the 1-rank model (the 4->1 row).",
        "- Raw disk: each save rank writes its 1/N of the state bytes (8 MiB blocks, one file per rank) then "
        "fsyncs; the read is of the same files after evicting them from the page cache.",
        "- Loads: before every load the checkpoint files are fsynced and dropped from the page cache "
        "(``posix_fadvise(DONTNEED)``). The first load of each system into a zeroed model is checked bit-exact "
        "against checksums of the saved state. 2-rank checkpoints (for 2->4) are written by the 4->2 ranks "
        "after their loads. The 'page cache warm' rows load the same checkpoints after rank 0 has read their "
        "files once (a restart on the node that saved): they time the loader's own work, not the disk.",
        "- Read amplification: rayckpt = sum of ``LoadInfo.bytes_read`` / sum of ``bytes_needed``; DCP = bytes "
        "its ranks read through ``read()`` (``rchar`` in /proc/self/io) / the same bytes needed; torch.load "
        "reads the whole file on one process.",
        f"- Memory: a thread in each rank samples /proc/self/status (VmRSS, RssAnon, RssShmem) every "
        f"{report['config']['memory_sample_interval_s'] * 1000:g} ms during "
        "the operation; the figure is the peak minus the value just before, max over repeats and ranks. "
        "'anon+shm' leaves out file-backed pages (memory-mapped checkpoint files, which are page cache). For "
        "the Ray save, rank 0 also samples the ShardWriter actor's process. Memory a process freed earlier but "
        "still holds (allocator caches) is reused without raising its RSS, so the figures are lower bounds of "
        "what an operation allocates. The memory target allows a rank "
        f"its own shard bytes plus a bounded buffer of {MEM_BUFFER_BYTES // MIB} MiB.",
        "- Persist throughput: state bytes over rayckpt's save time against the same bytes over the raw "
        "write + fsync time of the same number of processes.",
    ]
    plan = report.get("plan")
    if plan:
        bulk = plan["results"]["bulk_plan"]["seconds"]["median"]
        met = "met" if bulk < PLAN_TARGET_S else "**not met**"
        table = plan["markdown"].split("\n", 1)[1].lstrip("\n")  # without its own title
        lines += ["", "## Planning at scale (no I/O)", "", table.rstrip(), ""]
        lines += [
            "| target | measured | target | met |",
            "| --- | --- | --- | --- |",
            f"| planning {plan['config']['saved_ranks']} saved -> {plan['config']['target_ranks']} target ranks "
            f"x {plan['config']['tensors']} tensors, s (create_dim0_plans, all ranks) | {bulk:.3f} | "
            f"< {PLAN_TARGET_S:g} | {met} |",
        ]
    if os.path.exists(NOTES):
        with open(NOTES) as f:
            lines += ["", f.read().rstrip()]
    return "\n".join(lines) + "\n"


def run_plan_bench(spec: str, out: str, repeats: int) -> dict[str, Any]:
    """Run ``benchmarks.bench_plan`` at ``spec`` (SAVEDxTENSORSxTARGET) in its own process; its report."""
    saved, tensors, target = (int(x) for x in spec.lower().split("x"))
    cmd = [sys.executable, "-m", "benchmarks.bench_plan", "--saved-ranks", str(saved), "--tensors", str(tensors)]
    cmd += ["--target-ranks", str(target), "--repeats", str(repeats), "--out", out]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)
    with open(os.path.join(out, "bench_plan.json")) as f:
        report = json.load(f)
    with open(os.path.join(out, "bench_plan.md")) as f:
        report["markdown"] = f.read()
    return report


# ---------------------------------------------------------------------------
# Chart


def chart_rows(report: dict[str, Any]) -> list[tuple[str, str, float, float, bool]]:
    """(target, size, measured, threshold, higher_is_better) for every ratio target."""
    rows = []
    for key, size in report["sizes"].items():
        for t in size["targets"]:
            if t["measured"] is None or "MiB" in t["target"]:
                continue
            rows.append((t["target"], key, t["measured"], t["threshold"], t["direction"] == ">="))
    return rows


def write_chart(report: dict[str, Any], path: str) -> str:
    rows = chart_rows(report)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        write_png_bars(rows, path)
        return "hand-made (matplotlib not installed)"
    names = list(dict.fromkeys(r[0] for r in rows))
    sizes = list(dict.fromkeys(r[1] for r in rows))
    ncols = min(3, len(names))
    nrows = -(-len(names) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    for ax, name in zip(axes.flat, names):
        mine = [r for r in rows if r[0] == name]
        xs = list(range(len(mine)))
        colors = ["#2a9d4a" if (r[2] >= r[3] if r[4] else r[2] <= r[3]) else "#d1495b" for r in mine]
        ax.bar(xs, [r[2] for r in mine], color=colors)
        ax.axhline(mine[0][3], color="black", linestyle="--", linewidth=1)
        ax.set_xticks(xs, [r[1] for r in mine])
        for x, r in zip(xs, mine):
            ax.text(x, r[2], f"{r[2]:.2f}", ha="center", va="bottom", fontsize=8)
        wrapped = name.replace(": ", ":\n", 1).replace(" / ", "\n/ ")
        ax.set_title(f"{wrapped}\n(target {'>=' if mine[0][4] else '<='} {mine[0][3]:g})", fontsize=8)
        ax.tick_params(labelsize=8)
    fig.suptitle(f"rayckpt targets, sizes {', '.join(sizes)} (green: met, red: not met)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


def write_png_bars(rows: list[tuple[str, str, float, float, bool]], path: str) -> None:
    """A bare bar chart (no text): one bar per (target, size), its height measured/threshold, a black
    line at 1.0; green where the target is met, red where not. The markdown names the bars in order."""
    width, height, margin = 40 + 36 * max(len(rows), 1), 240, 20
    img = [[(255, 255, 255)] * width for _ in range(height)]
    top = max([r[2] / r[3] for r in rows] + [1.0]) * 1.1
    plot_h = height - 2 * margin

    def y_of(v: float) -> int:
        return height - margin - int(plot_h * v / top)

    for i, (_name, _size, val, thr, higher) in enumerate(rows):
        met = val >= thr if higher else val <= thr
        color = (42, 157, 74) if met else (209, 73, 91)
        x0 = margin + 36 * i + 6
        for y in range(y_of(val / thr), height - margin):
            for x in range(x0, x0 + 24):
                img[y][x] = color
    for x in range(margin, width - margin):
        img[y_of(1.0)][x] = (0, 0, 0)
        img[height - margin][x] = (90, 90, 90)
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in img)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(png)


# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sizes-mb",
        default="256,1024",
        help="state sizes in MiB (params + AdamW moments), comma-separated; 4096 for 4 GB",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save-ranks", type=int, default=4)
    parser.add_argument("--reshards", default="4:3,4:2,2:4,4:1", help="N:M load reshards")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--markdown", default=str(REPO_ROOT / "BENCHMARKS.md"), help="where to write the tables")
    parser.add_argument("--chart", default=None, help="PNG of the target ratios (default: {out}/bench_suite.png)")
    parser.add_argument(
        "--mem-interval-ms", type=float, default=SAMPLE_INTERVAL_S * 1000, help="RSS sampling period; 0: off"
    )
    parser.add_argument("--no-verify", action="store_true", help="skip the bit-exact check of the first loads")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints under --out")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per group of ranks")
    parser.add_argument(
        "--plan-scale",
        default="1024x2000x1000",
        help="planning benchmark, SAVEDxTENSORSxTARGET ranks/tensors ('none' to skip)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    sizes = [float(x) for x in args.sizes_mb.split(",") if x.strip()]

    import ray

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    load_samples: list[tuple[float, float, float | None]] = []
    load_before = os.getloadavg()
    stop = threading.Event()
    sampler = load_avg_thread(load_samples, stop)
    t0 = time.perf_counter()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        address = ray.get_runtime_context().gcs_address
        report: dict[str, Any] = {
            "command": " ".join([".venv/bin/python", "-m", "benchmarks.bench_suite", *(argv or sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "config": {
                "sizes_mb": sizes,
                "repeats": args.repeats,
                "save_ranks": args.save_ranks,
                "reshards": args.reshards,
                "verify": not args.no_verify,
                "memory_sample_interval_s": args.mem_interval_ms / 1000,
                "memory_target_buffer_bytes": MEM_BUFFER_BYTES,
                "dcp_writer": "FileSystemWriter defaults (single_file_per_rank, sync_files=True, thread_count=1)",
            },
            "machine": {
                "nproc": os.cpu_count(),
                "torch": torch.__version__,
                "ray": ray.__version__,
                "pyarrow": __import__("pyarrow").__version__,
                "rayckpt": rayckpt.__version__,
                "python": platform.python_version(),
                "platform": platform.platform(),
                "mem_total_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
            },
            "sizes": {},
        }
        for size_mb in sizes:
            result = run_size(args, size_mb, out, address)
            report["sizes"][f"{size_mb:g}MB"] = result
            print(f"[suite] {size_mb:g}MB done in {result['runtime_s']:.0f}s", flush=True)
    finally:
        stop.set()
        sampler.join()
        ray.shutdown()
    if args.plan_scale.lower() != "none":
        report["plan"] = run_plan_bench(args.plan_scale, out, args.repeats)
    loads = [x[1] for x in load_samples]
    others = [x[2] for x in load_samples if x[2] is not None] or [0.0]
    report["load_average_1min"] = {
        "before_start": load_before[0],
        "min": min(loads),
        "median": statistics.median(loads),
        "max": max(loads),
        "other_processes_cpu_cores": {
            "mean": statistics.fmean(others),
            "max": max(others),
            "note": "CPU used outside this benchmark's process tree per 5 s window (incl. kernel writeback)",
        },
        "samples_time_load1_othercores": [
            (round(t, 1), round(v, 2), None if o is None else round(o, 2)) for t, v, o in load_samples
        ],
    }
    report["total_runtime_s"] = time.perf_counter() - t0
    png = os.path.abspath(args.chart or os.path.join(out, "bench_suite.png"))
    shown = os.path.relpath(png, REPO_ROOT) if png.startswith(str(REPO_ROOT) + os.sep) else png
    report["chart"] = {"path": png, "shown_as": shown, "renderer": write_chart(report, png)}
    md = markdown(report)
    with open(os.path.join(out, "bench_suite.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(args.markdown, "w") as f:
        f.write(md)
    print(md)
    print(f"[suite] total {report['total_runtime_s']:.0f}s; wrote {out}/bench_suite.json, {png}, {args.markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
