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

    .venv/bin/python -m benchmarks.micro engine --size-mb 1024 --repeats 3 --save-ranks 4 --load-ranks 3

Writes ``{out}/bench_engine.json`` and ``{out}/bench_engine.md`` and prints the
markdown table.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import time
from typing import Any

import rayckpt
from benchmarks.common.diskio import RAW_BLOCK, dir_bytes, evict, files_under, read_raw, resident_fraction, write_raw
from benchmarks.common.harness import import_rayckpt, io_delta, memcpy_anchor, proc_io
from benchmarks.common.workload import build_state, checksums, layer_shapes, state_bytes, tensor_sums, verify_loaded
from benchmarks.micro.engine_report import build_report, markdown
from rayckpt.engine.app_state import AppState
from rayckpt.testing.multiproc import run_ranks

SYSTEMS = ("rayckpt", "dcp")
# build_state and layer_shapes (from benchmarks.common.workload) stay importable from here: callers import them so.


# ---------------------------------------------------------------------------
# Timing and the two systems


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

    import_rayckpt()

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

    import_rayckpt()

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=1024, help="params + AdamW moments, MiB, over all ranks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save-ranks", type=int, default=4)
    parser.add_argument("--load-ranks", type=int, default=3)
    parser.add_argument("--out", default="bench_out/engine")
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
