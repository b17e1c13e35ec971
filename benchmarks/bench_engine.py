"""Benchmark rayckpt.save / rayckpt.load against torch DCP on the same FSDP2 state.

N spawned gloo ranks build an FSDP2 model (several large, unevenly sized
``nn.Linear`` layers, fp32, each ``fully_shard``-ed on a 1-D CPU mesh) with AdamW
state, so that params + exp_avg + exp_avg_sq total about ``--size-mb`` MiB, and
save it with ``rayckpt.save`` and with ``torch.distributed.checkpoint.save``
(``FileSystemWriter`` defaults), alternating systems within each repeat. M ranks
then build a fresh, differently seeded model and load both checkpoints (a real
N -> M reshard), alternating again, after evicting the checkpoint files from the
page cache (fsync + ``posix_fadvise(DONTNEED)``) so loads read the disk. The
loaded state is checked once per system against the saved one (checksums of
every full parameter and AdamW moment). A raw-disk anchor writes the same number
of bytes from N processes (with fsync, and into the page cache) and reads them
back cold.

Times are wall times: from a ``dist.barrier()`` before to one after, max over
ranks. GB/s = state bytes (1 GB = 1e9 bytes) / seconds.

    .venv/bin/python -m benchmarks.bench_engine --size-mb 1024 --repeats 3 --save-ranks 4 --load-ranks 3

Writes ``{out}/bench_engine.json`` and ``{out}/bench_engine.md`` and prints the
markdown table.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import json
import math
import mmap
import os
import platform
import pstats
import shutil
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn as nn

import rayckpt
from rayckpt.engine.app_state import AppState
from rayckpt.testing.multiproc import run_ranks

SYSTEMS = ("rayckpt", "dcp")
LABELS = {"rayckpt": "rayckpt", "dcp": "torch DCP"}
RAW_BLOCK = 8 * 1024 * 1024
NUM_LAYERS = 8


# ---------------------------------------------------------------------------
# The model and its state


class BenchModel(nn.Module):
    """A stack of large linear layers (never run forward: only its state matters)."""

    def __init__(self, shapes: list[tuple[int, int]]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(cols, rows) for rows, cols in shapes)


def layer_shapes(size_mb: float, num_layers: int = NUM_LAYERS) -> list[tuple[int, int]]:
    """(rows, cols) per layer so that 3 fp32 copies (param, exp_avg, exp_avg_sq) of
    weights + biases total about ``size_mb`` MiB. Rows (the FSDP2 shard dim) are odd
    and not multiples of 3, so shards are uneven for 2, 3, 4 and 6 ranks and the
    shard boundaries of N and M ranks differ."""
    elements = int(size_mb * 2**20) // 12
    per_layer = max(elements // num_layers, 64)
    base = max(int(math.sqrt(per_layer)), 7)
    shapes = []
    for i in range(num_layers):
        rows = base + 6 * i
        while rows % 2 == 0 or rows % 3 == 0:
            rows += 1
        cols = max(per_layer // (rows + 1), 1)
        shapes.append((rows, cols))
    return shapes


def build_state(world_size: int, rank: int, seed: int, shapes: list[tuple[int, int]]) -> tuple[Any, Any, AppState]:
    """FSDP2 model (meta init, then only local shards materialized) + AdamW with filled moments."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = BenchModel(shapes)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(generator=gen)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    app = AppState(model, optim, step=7)
    app.state_dict()  # get_state_dict initializes the (empty) optimizer state with one zero-grad step
    with torch.no_grad():
        for p in model.parameters():
            st = optim.state[p]
            st["exp_avg"].to_local().normal_(generator=gen)
            st["exp_avg_sq"].to_local().uniform_(generator=gen)
            st["step"].fill_(7.0)
    return model, optim, app


def memcpy_anchor() -> dict[str, float]:
    """Single-thread memory copy speed (64 MiB, 4 times): the anchor for copy-bound phases."""
    a = torch.empty(64 * 2**20 // 4)
    a.normal_()
    b = torch.empty_like(a)
    t0 = time.perf_counter()
    for _ in range(4):
        b.copy_(a)
    return {
        "memcpy_GBps_1thread": 4 * a.numel() * 4 / 1e9 / (time.perf_counter() - t0),
        "torch_threads": torch.get_num_threads(),
    }


def state_bytes(app: AppState, local: bool = False) -> int:
    """Bytes of every tensor in the app's state: DTensors counted globally, or with
    ``local=True`` only this rank's own shards."""
    total = 0

    def walk(node: Any) -> None:
        nonlocal total
        if isinstance(node, torch.Tensor):
            t = node.to_local() if local and hasattr(node, "to_local") else node
            total += t.numel() * t.element_size()  # DTensor.numel() is the global count
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(app.state_dict())
    return total


def tensor_sums(t: torch.Tensor) -> tuple[float, int, int]:
    """(float64 sum, int sum of the raw bits, position-weighted int sum): the int sums are
    exact and order-independent, so they compare bit-for-bit across shardings."""
    flat = t.detach().reshape(-1).contiguous()
    bits = flat.view(torch.int32).to(torch.int64)
    weights = torch.arange(bits.numel(), dtype=torch.int64) % 65521 + 1
    return float(flat.double().sum()), int(bits.sum()), int((bits * weights).sum())


def checksums(model: nn.Module, optim: torch.optim.Optimizer, compute: bool) -> dict[str, tuple[float, int, int]]:
    """Checksums of every full (unsharded, via ``DTensor.full_tensor()``) param and AdamW moment.
    A collective: every rank calls it; only ranks with ``compute`` sum (the others get {})."""
    out: dict[str, tuple[float, int, int]] = {}
    for name, p in model.named_parameters():
        full = {"param": p.full_tensor()}
        for k in ("exp_avg", "exp_avg_sq"):
            full[k] = optim.state[p][k].full_tensor()
        if compute:
            for k, t in full.items():
                out[f"{k}:{name}"] = tensor_sums(t)
            out[f"step:{name}"] = (float(optim.state[p]["step"]), 0, 0)
        del full
    return out


def verify_loaded(system: str, model: nn.Module, optim: torch.optim.Optimizer, app: AppState, expected: dict) -> int:
    """Compare the loaded state with the saved checksums (rank 0), then raise on every rank if it differs."""
    import torch.distributed as dist

    rank = dist.get_rank()
    got = checksums(model, optim, compute=rank == 0)
    problem = None
    if rank == 0:
        bad = [k for k in expected if k not in got or tuple(got[k][1:]) != tuple(expected[k][1:])]
        bad += [k for k in expected if k.startswith("step:") and got.get(k, (None,))[0] != expected[k][0]]
        if bad:
            detail = "; ".join(f"{k}: saved {expected.get(k)} loaded {got.get(k)}" for k in bad[:6])
            problem = f"{system}: loaded state differs from the saved state in {len(bad)} tensor(s): {detail}"
    if app.extras.get("step") != 7:
        problem = f"{system}: extras.step loaded as {app.extras.get('step')!r}, saved 7"
    verdict = [problem]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise AssertionError(verdict[0])
    return len(expected)


# ---------------------------------------------------------------------------
# Disk helpers


def files_under(path: str) -> list[str]:
    found = []
    for root, _dirs, names in os.walk(path):
        found.extend(os.path.join(root, n) for n in names)
    return sorted(found)


def dir_bytes(path: str) -> tuple[int, int]:
    files = files_under(path)
    return sum(os.path.getsize(f) for f in files), len(files)


def evict(paths: list[str]) -> bool:
    """fsync then drop each file's pages from the page cache; False if fadvise is unavailable."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def resident_fraction(paths: list[str]) -> float | None:
    """Fraction of the files' pages in the page cache (mincore), or None if it cannot tell."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        page = os.sysconf("SC_PAGE_SIZE")
        failed = ctypes.c_void_p(-1).value
        resident = total = 0
        for p in paths:
            size = os.path.getsize(p)
            if size == 0:
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr is None or addr == failed:
                    return None
                try:
                    n = (size + page - 1) // page
                    vec = (ctypes.c_ubyte * n)()
                    if libc.mincore(addr, size, vec) != 0:
                        return None
                    resident += n - bytes(vec).count(0)
                    total += n
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
        return resident / total if total else 0.0
    except (OSError, AttributeError):
        return None


def proc_io() -> dict[str, int]:
    """This process's I/O counters (read_bytes / write_bytes: what reached the block layer)."""
    try:
        with open("/proc/self/io") as f:
            return {k.strip(): int(v) for k, v in (line.split(":", 1) for line in f if ":" in line)}
    except OSError:
        return {}


def io_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in ("read_bytes", "write_bytes", "rchar", "wchar") if k in before}


def timed(fn: Any) -> tuple[dict[str, Any], Any]:
    """Barrier, run ``fn``, barrier: this rank's wall time (barrier to barrier) and own time."""
    import torch.distributed as dist

    dist.barrier()
    io0 = proc_io()
    t0 = time.perf_counter()
    result = fn()
    t1 = time.perf_counter()
    dist.barrier()
    t2 = time.perf_counter()
    return {"wall": t2 - t0, "own": t1 - t0, "io": io_delta(io0, proc_io())}, result


def write_raw(path: str, nbytes: int, blob: memoryview, fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            view = blob[: min(left, len(blob))]
            while len(view):
                n = os.write(fd, view)
                view = view[n:]
                left -= n
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_raw(path: str) -> int:
    buf = bytearray(RAW_BLOCK)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return total
            total += n


def profile_call(enabled: bool, fn: Any, out_path: str) -> None:
    if not enabled:
        fn()
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)
    with open(out_path, "w") as f:
        f.write(text.getvalue())


def save_with(system: str, app: AppState, path: str) -> Any:
    if system == "rayckpt":
        return rayckpt.save({"app": app}, path)
    import torch.distributed.checkpoint as dcp

    dcp.save({"app": app}, storage_writer=dcp.FileSystemWriter(path))
    return None


def load_with(system: str, app: AppState, path: str) -> Any:
    if system == "rayckpt":
        return rayckpt.load({"app": app}, path)
    import torch.distributed.checkpoint as dcp

    dcp.load({"app": app}, storage_reader=dcp.FileSystemReader(path))
    return None


# ---------------------------------------------------------------------------
# Rank workers


def save_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    t_build = time.perf_counter()
    model, optim, app = build_state(world_size, rank, seed=0, shapes=cfg["shapes"])
    build_s = time.perf_counter() - t_build
    total = state_bytes(app)
    t_sums = time.perf_counter()
    sums = checksums(model, optim, compute=rank == 0)
    out: dict[str, Any] = {
        "rank": rank,
        "build_s": build_s,
        "checksum_s": time.perf_counter() - t_sums,
        "save": {s: [] for s in SYSTEMS},
        "raw": [],
    }
    if rank == 0:
        out["state_bytes"] = total
        out["checksums"] = sums
        out.update(memcpy_anchor())
    raw_dir = os.path.join(cfg["out"], "raw")
    raw_bytes = -(-total // world_size // RAW_BLOCK) * RAW_BLOCK
    blob = memoryview(bytearray(os.urandom(RAW_BLOCK)))

    for rep in range(cfg["repeats"]):
        for system in SYSTEMS:
            path = cfg["dirs"][system]
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
                os.sync()  # untimed: nobody's dirty pages get flushed inside the timed window
            stats, info = timed(lambda system=system, path=path: save_with(system, app, path))
            stats["repeat"] = rep
            if info is not None:
                stats["bytes_written"] = info.bytes_written
                stats["num_files"] = info.num_files
            out["save"][system].append(stats)
        # Raw-disk anchor: the same total bytes from N processes, sequential writes.
        if rank == 0:
            os.makedirs(raw_dir, exist_ok=True)
        dist.barrier()
        mine = os.path.join(raw_dir, f"rank{rank}.bin")
        cached = os.path.join(raw_dir, f"rank{rank}.cache.bin")
        w_sync, _ = timed(lambda mine=mine: write_raw(mine, raw_bytes, blob, fsync=True))
        w_cache, _ = timed(lambda cached=cached: write_raw(cached, raw_bytes, blob, fsync=False))
        evict([cached])
        os.unlink(cached)
        evict([mine])
        resident = resident_fraction([mine])
        r_cold, n = timed(lambda mine=mine: read_raw(mine))
        assert n == raw_bytes, (n, raw_bytes)
        os.unlink(mine)
        out["raw"].append(
            {
                "repeat": rep,
                "bytes": raw_bytes,
                "write_fsync": w_sync,
                "write_cache": w_cache,
                "read_cold": r_cold,
                "resident_before_read": resident,
            }
        )

    if cfg["profile"]:
        for system in SYSTEMS:
            path = cfg["dirs"][system] + ".profile"
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            profile_call(
                rank == 0,
                lambda system=system, path=path: save_with(system, app, path),
                os.path.join(cfg["out"], f"profile_save_{system}.txt"),
            )
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    return out


def load_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    t_build = time.perf_counter()
    apps = {}
    for i, system in enumerate(SYSTEMS):
        model, optim, app = build_state(world_size, rank, seed=100 + i, shapes=cfg["shapes"])
        apps[system] = (model, optim, app)
    expected = cfg["checksums"]
    first = next(iter(expected))
    out: dict[str, Any] = {
        "rank": rank,
        "build_s": time.perf_counter() - t_build,
        "load": {s: [] for s in SYSTEMS},
        "verified": {},
    }
    for system in SYSTEMS:
        # Only the first param: enough to show the fresh model differs, so the check below means something.
        model, optim, _ = apps[system]
        before = tensor_sums(next(iter(model.parameters())).full_tensor())
        if before[1:] == tuple(expected[first][1:]):
            raise AssertionError(f"{system}: the fresh model already equals the saved one; the check would be void")

    for rep in range(cfg["repeats"]):
        for system in SYSTEMS:
            path = cfg["dirs"][system]
            model, optim, app = apps[system]
            resident = None
            if rank == 0:
                all_files = files_under(cfg["dirs"]["rayckpt"]) + files_under(cfg["dirs"]["dcp"])
                out["fadvise_used"] = evict(all_files)
                resident = resident_fraction(files_under(path))
            stats, info = timed(lambda system=system, path=path, app=app: load_with(system, app, path))
            stats["repeat"] = rep
            stats["resident_before_load"] = resident
            if info is not None:
                stats["bytes_needed"] = info.bytes_needed
                stats["bytes_read"] = info.bytes_read
                stats["num_reads"] = info.num_reads
                stats["missing_keys"] = list(info.missing_keys)
            out["load"][system].append(stats)
            if rep == 0:
                t_verify = time.perf_counter()
                out["verified"][system] = verify_loaded(system, model, optim, app, expected)
                out[f"verify_s_{system}"] = time.perf_counter() - t_verify

    if cfg["profile"]:
        for system in SYSTEMS:
            model, optim, app = apps[system]
            if rank == 0:
                evict(files_under(cfg["dirs"][system]))
            dist.barrier()
            profile_call(
                rank == 0,
                lambda system=system, app=app: load_with(system, app, cfg["dirs"][system]),
                os.path.join(cfg["out"], f"profile_load_{system}.txt"),
            )
            dist.barrier()
    dist.barrier()
    return out


# ---------------------------------------------------------------------------
# Report


def summarize(walls: list[float], nbytes: int) -> dict[str, Any]:
    med = statistics.median(walls)
    return {
        "seconds": walls,
        "median_s": med,
        "min_s": min(walls),
        "max_s": max(walls),
        "GBps_median": nbytes / 1e9 / med,
    }


def per_repeat(rank_results: list[dict[str, Any]], phase: str, system: str) -> list[dict[str, Any]]:
    """Per repeat: wall = max over ranks, plus per-rank figures."""
    reps = []
    for i in range(len(rank_results[0][phase][system])):
        rows = [r[phase][system][i] for r in rank_results]
        reps.append(
            {
                "wall_s": max(x["wall"] for x in rows),
                "own_s_per_rank": [round(x["own"], 4) for x in rows],
                "io_per_rank": [x["io"] for x in rows],
                **{
                    k: [x[k] for x in rows]
                    for k in ("bytes_needed", "bytes_read", "num_reads", "bytes_written", "num_files")
                    if k in rows[0]
                },
                **{k: rows[0][k] for k in ("resident_before_load",) if k in rows[0]},
            }
        )
    return reps


def fmt_s(s: dict[str, Any]) -> str:
    return f"{s['median_s']:.2f} ({s['min_s']:.2f}-{s['max_s']:.2f})"


def build_report(
    args: argparse.Namespace, cfg: dict[str, Any], saved: list[dict], loaded: list[dict], disk: dict
) -> dict:
    total = saved[0]["state_bytes"]
    report: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.bench_engine", *sys.argv[1:]]),
        "config": {
            "size_mb": args.size_mb,
            "repeats": args.repeats,
            "save_ranks": args.save_ranks,
            "load_ranks": args.load_ranks,
            "layer_shapes_rows_cols": cfg["shapes"],
            "state_bytes": total,
            "dcp_writer": "FileSystemWriter defaults (single_file_per_rank, sync_files=True, thread_count=1)",
        },
        "machine": {
            "nproc": os.cpu_count(),
            "sched_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch": torch.__version__,
            "pyarrow": __import__("pyarrow").__version__,
            "rayckpt": rayckpt.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "mem_total_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
            "torch_threads_per_rank": saved[0].get("torch_threads"),
            "memcpy_GBps_1thread": saved[0].get("memcpy_GBps_1thread"),
        },
        "page_cache_eviction": {
            "method": "fsync + os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) on every checkpoint file",
            "used": bool(loaded[0].get("fadvise_used")),
        },
        "setup_s": {
            "save_side_build_per_rank": [round(r["build_s"], 2) for r in saved],
            "save_side_checksums_per_rank": [round(r["checksum_s"], 2) for r in saved],
            "load_side_build_two_models_per_rank": [round(r["build_s"], 2) for r in loaded],
            "load_side_verify": {s: round(loaded[0].get(f"verify_s_{s}", 0.0), 2) for s in SYSTEMS},
        },
        "systems": {},
    }
    for system in SYSTEMS:
        save_reps = per_repeat(saved, "save", system)
        load_reps = per_repeat(loaded, "load", system)
        entry: dict[str, Any] = {
            "save": summarize([r["wall_s"] for r in save_reps], total),
            "load": summarize([r["wall_s"] for r in load_reps], total),
            "save_repeats": save_reps,
            "load_repeats": load_reps,
            "on_disk_bytes": disk[system][0],
            "on_disk_files": disk[system][1],
            "verified_tensors": loaded[0]["verified"].get(system),
        }
        disk_reads = [sum(x.get("read_bytes", 0) for x in r["io_per_rank"]) for r in load_reps]
        entry["disk_read_bytes_median"] = statistics.median(disk_reads)
        entry["disk_read_over_state"] = statistics.median(disk_reads) / total
        # Bytes the ranks pulled through read()-family syscalls (mmap'ed reads do not count here).
        syscall_reads = [sum(x.get("rchar", 0) for x in r["io_per_rank"]) for r in load_reps]
        entry["syscall_read_over_state"] = statistics.median(syscall_reads) / total
        writes = [sum(x.get("write_bytes", 0) for x in r["io_per_rank"]) for r in save_reps]
        entry["disk_write_bytes_median"] = statistics.median(writes)
        if system == "rayckpt":
            rep0 = load_reps[0]
            entry["read_amplification"] = sum(rep0["bytes_read"]) / max(sum(rep0["bytes_needed"]), 1)
            entry["bytes_read_per_rank"] = rep0["bytes_read"]
            entry["bytes_needed_per_rank"] = rep0["bytes_needed"]
        entry["resident_before_load"] = [r.get("resident_before_load") for r in load_reps]
        report["systems"][system] = entry
    r, d = report["systems"]["rayckpt"], report["systems"]["dcp"]
    report["ratio_rayckpt_over_dcp"] = {
        phase: {
            "time_median_ratio": r[phase]["median_s"] / d[phase]["median_s"],
            "paired_time_ratios": [a / b for a, b in zip(r[phase]["seconds"], d[phase]["seconds"])],
        }
        for phase in ("save", "load")
    }
    raw_reps = []
    for i in range(len(saved[0]["raw"])):
        rows = [x["raw"][i] for x in saved]
        nbytes = sum(x["bytes"] for x in rows)
        raw_reps.append(
            {
                "bytes": nbytes,
                **{k: max(x[k]["wall"] for x in rows) for k in ("write_fsync", "write_cache", "read_cold")},
                "resident_before_read": [x["resident_before_read"] for x in rows],
            }
        )
    report["raw_disk"] = {
        "bytes": raw_reps[0]["bytes"],
        "processes": args.save_ranks,
        "repeats": raw_reps,
        **{
            k: summarize([x[k] for x in raw_reps], raw_reps[0]["bytes"])
            for k in ("write_fsync", "write_cache", "read_cold")
        },
    }
    return report


def markdown(report: dict[str, Any]) -> str:
    cfg, sysr = report["config"], report["systems"]
    n, m = cfg["save_ranks"], cfg["load_ranks"]
    raw = report["raw_disk"]
    lines = [
        f"State {cfg['state_bytes'] / 1e9:.3f} GB (fp32 params + AdamW exp_avg + exp_avg_sq, "
        f"{len(cfg['layer_shapes_rows_cols'])} FSDP2 Linear layers), save {n} ranks, load {m} ranks, "
        f"{cfg['repeats']} repeat(s), systems alternated; wall = barrier to barrier, max over ranks; "
        f"seconds as median (min-max); GB = 1e9 bytes. Machine: {report['machine']['nproc']} CPUs, "
        f"torch {report['machine']['torch']}. Page cache evicted before loads: "
        f"{'yes (fadvise DONTNEED)' if report['page_cache_eviction']['used'] else 'NO'}.",
        "",
        f"| system | save s | save GB/s | load {n}->{m} s | load GB/s | read amp. "
        "| disk read / state | on-disk bytes (files) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for system in SYSTEMS:
        e = sysr[system]
        if "read_amplification" in e:
            amp = f"{e['read_amplification']:.3f} (LoadInfo)"
        else:
            amp = f"{e['syscall_read_over_state']:.3f} (read() bytes)"
        lines.append(
            f"| {LABELS[system]} | {fmt_s(e['save'])} | {e['save']['GBps_median']:.2f} | {fmt_s(e['load'])} "
            f"| {e['load']['GBps_median']:.2f} | {amp} | {e['disk_read_over_state']:.3f} "
            f"| {e['on_disk_bytes']:,} ({e['on_disk_files']}) |"
        )
    ratio = report["ratio_rayckpt_over_dcp"]
    paired = {p: ", ".join(f"{x:.2f}" for x in ratio[p]["paired_time_ratios"]) for p in ("save", "load")}
    lines.append(
        f"| time ratio rayckpt / DCP (<1: rayckpt faster) | {ratio['save']['time_median_ratio']:.2f} "
        f"(per repeat {paired['save']}) | | {ratio['load']['time_median_ratio']:.2f} "
        f"(per repeat {paired['load']}) | | | | |"
    )
    lines.append(
        f"| raw disk ({n} procs, write+fsync / cold read) | {fmt_s(raw['write_fsync'])} "
        f"| {raw['write_fsync']['GBps_median']:.2f} | {fmt_s(raw['read_cold'])} "
        f"| {raw['read_cold']['GBps_median']:.2f} "
        f"| | | {raw['bytes']:,} ({n}) |"
    )
    lines.append(
        f"| raw disk ({n} procs, write into page cache) | {fmt_s(raw['write_cache'])} "
        f"| {raw['write_cache']['GBps_median']:.2f} | | | | | |"
    )
    lines.append("")
    lines.append(
        f"Single-thread memcpy: {report['machine']['memcpy_GBps_1thread']:.1f} GB/s. "
        "'disk read / state' = block-layer read_bytes (/proc/self/io, summed over ranks) / state bytes "
        "(ranks share the page cache, so a byte two ranks read counts once). Read amp.: rayckpt = sum "
        "LoadInfo.bytes_read / sum bytes_needed; DCP = bytes its ranks read via read() (rchar) / state bytes."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=1024, help="params + AdamW moments, MiB, over all ranks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save-ranks", type=int, default=4)
    parser.add_argument("--load-ranks", type=int, default=3)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--profile", action="store_true", help="after timing, cProfile one save/load on rank 0")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints under --out")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    dirs = {s: os.path.join(out, f"ckpt_{s}") for s in SYSTEMS}
    cfg: dict[str, Any] = {
        "shapes": layer_shapes(args.size_mb),
        "repeats": args.repeats,
        "out": out,
        "dirs": dirs,
        "profile": args.profile,
    }
    t0 = time.perf_counter()
    print(f"[bench] saving with {args.save_ranks} ranks, {args.repeats} repeat(s), shapes {cfg['shapes']}", flush=True)
    saved = run_ranks(save_worker, args.save_ranks, cfg, timeout=1800)
    disk = {s: dir_bytes(dirs[s]) for s in SYSTEMS}
    print(f"[bench] saves done in {time.perf_counter() - t0:.0f}s; loading with {args.load_ranks} ranks", flush=True)
    cfg["checksums"] = saved[0]["checksums"]
    loaded = run_ranks(load_worker, args.load_ranks, cfg, timeout=1800)
    report = build_report(args, cfg, saved, loaded, disk)
    report["total_runtime_s"] = time.perf_counter() - t0
    md = markdown(report)
    with open(os.path.join(out, "bench_engine.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out, "bench_engine.md"), "w") as f:
        f.write(md + "\n")
    if not args.keep:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(os.path.join(out, "raw"), ignore_errors=True)
    print(md)
    print(f"[bench] total {report['total_runtime_s']:.0f}s; wrote {out}/bench_engine.json and bench_engine.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
