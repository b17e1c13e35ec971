"""The benchmark suite: rayckpt against torch DCP, torch.save and the raw disk, in one run.

For each state size (FSDP2 state of fp32 params + AdamW moments, built like
``micro.engine``: uneven ``Linear`` layers, ``fully_shard``-ed on a 1-D CPU mesh):

save, ``--save-ranks`` (4) gloo ranks, systems alternated within each repeat (the
order rotates from repeat to repeat):

- ``rayckpt``: ``rayckpt.save`` in process (returns once committed);
- ``rayckpt Ray async``: ``rayckpt.ray.rank.async_save.save_async`` from ranks connected to
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

Then planning at scale, no I/O (``benchmarks.micro.plan`` in its own process,
``--plan-scale`` SAVEDxTENSORSxTARGET, default 1024x2000x1000): the bulk planner
for all target ranks, one rank's plan, the per-rank planner (extrapolated), save
planning, and the manifest's encode/decode, with time and memory.

    .venv/bin/python -m benchmarks.suite --sizes-mb 256,1024 --repeats 3

Writes ``{out}/bench_suite.json``, ``{out}/bench_suite.png`` (the target ratios) and
``{out}/bench_suite.md`` (``--markdown`` to change it); ``--out`` is ``bench_out/suite``,
outside git. ``--storage s3`` runs the same saves and loads on an S3 endpoint
(``benchmarks.suite.s3``).
"""


# The suite's pieces: ``common.harness`` (sampling, timing, statistics), ``common.workload`` (the
# FSDP2 state), ``common.diskio`` (page cache, raw-disk anchor), ``save`` / ``load`` (what the
# ranks run, and how their records reduce), ``report`` (targets, markdown, chart).
# This module parses the command line and drives them: one size at a time, saves then loads.

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

from benchmarks.common.cli import add_storage_arg
from benchmarks.common.diskio import dir_bytes
from benchmarks.common.harness import (
    REPO_ROOT,
    SAMPLE_INTERVAL_S,
    load_average,
    load_avg_thread,
    machine_info,
    partial_path,
    save_partial,
)
from benchmarks.common.workload import layer_shapes
from benchmarks.suite.load import WARM_SYSTEMS, load_report, load_worker, parse_reshards
from benchmarks.suite.report import MEM_BUFFER_BYTES, markdown, targets, write_chart
from benchmarks.suite.save import SAVE_SYSTEMS, save_report, save_worker
from rayckpt.testing.multiproc import run_ranks

# ---------------------------------------------------------------------------
# One state size


def run_size(args: argparse.Namespace, size_mb: float, out: str, ray_address: str) -> dict[str, Any]:
    """One state size: the saves with ``--save-ranks`` ranks, then every reshard's loads, then its targets."""
    label = f"{size_mb:g}MB"
    size_dir = os.path.join(out, f"suite_{label}")
    shutil.rmtree(size_dir, ignore_errors=True)
    n0 = args.save_ranks
    save_paths = {
        "rayckpt": os.path.join(size_dir, f"n{n0}", "rayckpt"),
        "rayckpt_ray": os.path.join(size_dir, f"n{n0}", "rayckpt_ray"),
        "dcp": os.path.join(size_dir, f"n{n0}", "dcp"),
        "dcp_async": os.path.join(size_dir, f"n{n0}", "dcp_async"),
        "torch_save": os.path.join(size_dir, f"n{n0}", "full.pt"),
        "raw": os.path.join(size_dir, "raw"),
    }
    os.makedirs(os.path.join(size_dir, f"n{n0}"), exist_ok=True)
    shapes = layer_shapes(size_mb)
    t0 = time.perf_counter()
    saved, result = run_saves(args, size_mb, size_dir, save_paths, shapes, ray_address)
    print(f"[suite] {label}: saves done in {time.perf_counter() - t0:.0f}s", flush=True)
    save_partial(out, label, result)

    reshards = parse_reshards(args.reshards)
    run_loads(args, reshards, result, save_paths, size_dir, saved[0]["checksums"], out)
    # Report in the order asked.
    result["load"] = {f"{n}->{m}": result["load"][f"{n}->{m}"] for n, m in reshards}
    main_reshard = f"{n0}->3" if f"{n0}->3" in result["load"] else next(iter(result["load"]), "")
    result["targets"] = targets(result, main_reshard)
    result["runtime_s"] = time.perf_counter() - t0
    os.unlink(partial_path(out, label))
    if not args.keep:
        shutil.rmtree(size_dir, ignore_errors=True)
    return result


def run_saves(
    args: argparse.Namespace,
    size_mb: float,
    size_dir: str,
    save_paths: dict[str, str],
    shapes: list[tuple[int, int]],
    ray_address: str,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every save system on ``--save-ranks`` ranks; the ranks' records and the size's result so far."""
    label = f"{size_mb:g}MB"
    n0 = args.save_ranks
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
    return saved, result


def run_loads(
    args: argparse.Namespace,
    reshards: list[tuple[int, int]],
    result: dict[str, Any],
    save_paths: dict[str, str],
    size_dir: str,
    sums: dict[str, Any],
    out: str,
) -> None:
    """Every N->M reshard's loads into ``result["load"]``, saving the partial result after each."""
    n0 = args.save_ranks
    label = f"{result['size_mb']:g}MB"
    ck = {n0: {"rayckpt": save_paths["rayckpt"], "dcp": save_paths["dcp"]}}
    # Sources first: N->M runs whose M is the N of a later reshard also write M-rank checkpoints.
    needed_sources = {n for n, _ in reshards if n != n0}
    order = sorted(reshards, key=lambda nm: (nm[0] != n0, nm[1] not in needed_sources))
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
            "shapes": result["layer_shapes_rows_cols"],
            "repeats": args.repeats,
            "sources": sources,
            "checksums": sums,
            "verify": not args.no_verify,
            "mem_interval": args.mem_interval_ms / 1000,
        }
        if m in needed_sources and m not in ck:
            ck[m] = {s: os.path.join(size_dir, f"n{m}", s) for s in ("rayckpt", "dcp")}
            lcfg["resave"] = ck[m]
        t1 = time.perf_counter()
        loaded = run_ranks(load_worker, m, lcfg, timeout=args.timeout)
        result["load"][name] = load_report(loaded, result["state_bytes"])
        result["load"][name]["fadvise_used"] = bool(loaded[0].get("fadvise_used"))
        result["load"][name]["setup_s_per_rank"] = [round(r["setup_s"], 2) for r in loaded]
        print(f"[suite] {label}: load {name} done in {time.perf_counter() - t1:.0f}s", flush=True)
        save_partial(out, label, result)


def run_plan_bench(spec: str, out: str, repeats: int) -> dict[str, Any]:
    """Run ``benchmarks.micro.plan`` at ``spec`` (SAVEDxTENSORSxTARGET) in its own process; its report."""
    saved, tensors, target = (int(x) for x in spec.lower().split("x"))
    cmd = [sys.executable, "-m", "benchmarks.micro", "plan", "--saved-ranks", str(saved), "--tensors", str(tensors)]
    cmd += ["--target-ranks", str(target), "--repeats", str(repeats), "--out", out]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)
    with open(os.path.join(out, "bench_plan.json")) as f:
        report = json.load(f)
    with open(os.path.join(out, "bench_plan.md")) as f:
        report["markdown"] = f.read()
    return report


# ---------------------------------------------------------------------------
# The run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sizes-mb",
        default="256,1024",
        help="state sizes in MiB (params + AdamW moments), comma-separated; 4096 for 4 GB",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save-ranks", type=int, default=4)
    parser.add_argument("--reshards", default="4:3,4:2,2:4,4:1", help="N:M load reshards")
    add_storage_arg(parser, "local")
    parser.add_argument("--out", default="bench_out/suite", help="directory for the report, chart and checkpoints")
    parser.add_argument("--markdown", default=None, help="where to write the tables (default: {out}/bench_suite.md)")
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
    return args


def report_head(args: argparse.Namespace, argv: list[str] | None, sizes: list[float]) -> dict[str, Any]:
    """The command, date, configuration and machine of the run (the sizes are filled in as they finish)."""
    import ray

    return {
        "command": " ".join([".venv/bin/python", "-m", "benchmarks.suite", *(argv or sys.argv[1:])]),
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
        "machine": {**machine_info(), "ray": ray.__version__},
        "sizes": {},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
        report = report_head(args, argv, sizes)
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
    report["load_average_1min"] = load_average(load_before[0], load_samples)
    report["total_runtime_s"] = time.perf_counter() - t0
    png = os.path.abspath(args.chart or os.path.join(out, "bench_suite.png"))
    shown = os.path.relpath(png, REPO_ROOT) if png.startswith(str(REPO_ROOT) + os.sep) else png
    report["chart"] = {"path": png, "shown_as": shown, "renderer": write_chart(report, png)}
    md = markdown(report)
    with open(os.path.join(out, "bench_suite.json"), "w") as f:
        json.dump(report, f, indent=2)
    md_path = args.markdown or os.path.join(out, "bench_suite.md")
    with open(md_path, "w") as f:
        f.write(md)
    print(md)
    print(f"[suite] total {report['total_runtime_s']:.0f}s; wrote {out}/bench_suite.json, {png}, {md_path}")
    return 0
