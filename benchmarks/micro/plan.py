"""Planning at scale, no I/O: the load planner and the manifest codec on a synthetic manifest."""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.common.harness import MIB, sampled, summary, table, write_report
from rayckpt.format.manifest import ChunkEntry, FileEntry, Manifest, TensorEntry
from rayckpt.format.manifest_files import manifest_file_bytes, manifest_from_bytes
from rayckpt.planning.bulk import create_dim0_plans
from rayckpt.planning.chunk_table import ChunkTable
from rayckpt.planning.load_plan import ChunkIndex, TensorRequest, create_load_plan, dim0_boxes
from rayckpt.planning.save_columns import create_save_plans
from rayckpt.planning.save_plan import LocalShard

DTYPE = "float32"
ITEMSIZE = 4


def build_manifest(saved_ranks: int, tensors: int, rows: int, cols: int, block_size: int) -> Manifest:
    """The synthetic manifest: every tensor dim-0 sharded over all saved ranks, a file per rank."""
    shape = (rows, cols)
    boxes = dim0_boxes(shape, saved_ranks)
    files = [f"r{r}.arrow" for r in range(saved_ranks)]
    lengths = [b.volume * ITEMSIZE for b in boxes]
    checksums = [(123,) * -(-n // block_size) for n in lengths]
    pos = [0] * saved_ranks
    entries: dict[str, Any] = {}
    for t in range(tensors):
        chunks = []
        for r in range(saved_ranks):
            chunks.append(
                ChunkEntry(
                    box=boxes[r], file=files[r], byte_offset=pos[r], byte_length=lengths[r], checksums=checksums[r]
                )
            )
            pos[r] += lengths[r]
        entries[f"layers.{t}.weight"] = TensorEntry(DTYPE, shape, tuple(chunks))
    file_entries = tuple(FileEntry(files[r], pos[r], r) for r in range(saved_ranks))
    return Manifest(
        save_id="bench_plan", world_size=saved_ranks, block_size=block_size, entries=entries, files=file_entries
    )


def peak_memory(fn: Callable[[], Any]) -> dict[str, int]:
    """Peak bytes allocated while ``fn`` runs, and bytes its result still holds, by tracemalloc."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    out = fn()
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del out
    return {"peak_bytes": peak - base, "kept_bytes": kept - base}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    # One long function on purpose: each step reuses what the one before built (manifest, table, bulk
    # plan), and the decode step measures RSS after deleting them, which needs this frame to hold the
    # only references.
    n, m, reps = args.saved_ranks, args.target_ranks, args.repeats
    shape = (args.rows, args.cols)
    results: dict[str, Any] = {}
    rss0 = rss_bytes()

    t0 = time.perf_counter()
    manifest = build_manifest(n, args.tensors, args.rows, args.cols, args.block_size)
    built_s = time.perf_counter() - t0
    chunks = sum(len(e.chunks) for e in manifest.entries.values())
    print(f"[plan] manifest: {chunks:,} chunks built in {built_s:.1f}s", flush=True)
    specs = [(k, DTYPE, shape) for k in manifest.entries]

    secs, table = sampled(lambda: ChunkTable.from_manifest(manifest), reps)
    results["chunk_table"] = {
        "label": "ChunkTable.from_manifest",
        "seconds": secs,
        "memory": peak_memory(lambda: ChunkTable.from_manifest(manifest)),
        "table_bytes": table.nbytes,
    }
    print(f"[plan] chunk table {secs['median']:.2f}s", flush=True)

    secs, bulk = sampled(lambda: create_dim0_plans(manifest, specs, m, table=table), reps)
    results["bulk_plan"] = {
        "label": f"create_dim0_plans, all {m} target ranks",
        "seconds": secs,
        "memory": peak_memory(lambda: create_dim0_plans(manifest, specs, m, table=table)),
        "plan_bytes": bulk.nbytes,
        "per_item_path": bulk.per_item,
        "items": bulk.num_items_total,
        "reads": int(bulk.num_reads.sum()),
        "read_bytes": int(bulk.read_bytes.sum()),
        "needed_bytes": int(bulk.needed_bytes.sum()),
        "max_reads_per_rank": int(bulk.num_reads.max()),
    }
    print(f"[plan] bulk plan {secs['median']:.3f}s", flush=True)

    secs, plan0 = sampled(lambda: bulk.for_rank(0), reps)
    results["for_rank"] = {
        "label": "BulkPlan.for_rank (rank 0)",
        "seconds": secs,
        "memory": peak_memory(lambda: bulk.for_rank(0)),
        "items": sum(len(r.items) for r in plan0.reads),
        "reads": len(plan0.reads),
    }

    # The per-item planner as create_load_plans runs it, one ChunkIndex shared by all ranks. The first
    # call also sorts every key's chunks into the index; then a stratified sample of ranks (the middle
    # rank of each of --per-item-ranks equal groups), extrapolated to all ranks.
    boxes = dim0_boxes(shape, m)

    def requests(rank: int) -> list[TensorRequest]:
        return [TensorRequest(k, DTYPE, shape, boxes[rank]) for k in manifest.entries]

    index = ChunkIndex(manifest)
    reqs = requests(0)
    t0 = time.perf_counter()
    plan = create_load_plan(manifest, reqs, index=index)
    first_s = time.perf_counter() - t0
    equal = plan == bulk.for_rank(0)
    sample = sorted({(2 * i + 1) * m // (2 * args.per_item_ranks) for i in range(args.per_item_ranks)})
    per_rank = []
    for r in sample:
        reqs = requests(r)
        t0 = time.perf_counter()
        plan = create_load_plan(manifest, reqs, index=index)
        per_rank.append(time.perf_counter() - t0)
        equal = equal and plan == bulk.for_rank(r)
    # The median: a sampled rank now and then pays a full GC pass over the manifest's millions of
    # objects, which a mean over a few ranks overweights (checked against all 1000 ranks once).
    typical = statistics.median(per_rank)
    reqs = requests(0)
    results["per_item_plan"] = {
        "label": f"planner.create_load_plan x {m} ranks (extrapolated)",
        "extrapolated": True,
        "sample_ranks": sample,
        "first_rank_s": first_s,
        "seconds_per_rank": summary(per_rank),
        "seconds": first_s + typical * (m - 1),
        "extrapolation": "rank 0 (with the index build) + median seconds per sampled rank x the other ranks",
        "memory": peak_memory(lambda: create_load_plan(manifest, reqs, index=ChunkIndex(manifest))),
        "equals_bulk_for_rank": equal,
    }
    print(f"[plan] per-item planner ~{results['per_item_plan']['seconds']:.1f}s (extrapolated)", flush=True)

    # Save plans: each saved rank reports its shard of every tensor; the first ranks, extrapolated.
    save_boxes = dim0_boxes(shape, n)
    points = []
    for s in sorted({max(1, min(n, args.save_sample_ranks // 2)), max(1, min(n, args.save_sample_ranks))}):
        shards = [[LocalShard(k, DTYPE, shape, save_boxes[r]) for k in manifest.entries] for r in range(s)]
        secs, _ = sampled(lambda shards=shards: create_save_plans(shards), reps)
        points.append({"sample_ranks": s, "seconds": secs})
    last = points[-1]
    results["save_plans"] = {
        "label": f"planner.create_save_plans x {n} ranks (extrapolated)",
        "extrapolated": True,
        "samples": points,
        "seconds": last["seconds"]["median"] * n / last["sample_ranks"],
        "extrapolation": "median seconds of the larger sample x saved ranks / sample ranks",
        "memory": peak_memory(lambda: create_save_plans(shards)),
    }
    shards = []

    if not args.no_codec:
        secs, data = sampled(lambda: manifest_file_bytes(manifest), args.codec_repeats)
        stored = sum(map(len, data.values()))
        results["encode_manifest"] = {
            "label": "encode_manifest (manifest.json + chunk table)",
            "seconds": secs,
            "json_bytes": stored,
            "memory": peak_memory(lambda: manifest_file_bytes(manifest)) if args.codec_memory else None,
        }
        print(f"[plan] encode {secs['median']:.1f}s, {stored / 1e6:.0f} MB", flush=True)
        del manifest, table, bulk, plan0, index
        gc.collect()
        rss1 = rss_bytes()
        secs, decoded = sampled(lambda: manifest_from_bytes(data), args.codec_repeats)
        results["decode_manifest"] = {
            "label": "decode_manifest",
            "seconds": secs,
            "rss_after_bytes": rss_bytes() - rss1,
            "memory": peak_memory(lambda: manifest_from_bytes(data)) if args.codec_memory else None,
        }
        print(f"[plan] decode {secs['median']:.1f}s", flush=True)
        secs, _ = sampled(lambda: ChunkTable.from_manifest(decoded), 1)
        results["chunk_table_decoded"] = {"label": "ChunkTable.from_manifest (decoded manifest)", "seconds": secs}
    results["rss_end_bytes"] = rss_bytes() - rss0
    return {"manifest": {"chunks": chunks, "build_s": built_s, "shape": list(shape)}, "results": results}


def fmt_s(s: dict[str, Any] | float) -> tuple[str, str]:
    def f(v: float) -> str:
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"

    if isinstance(s, dict):
        return f(s["median"]), f"{f(s['min'])}-{f(s['max'])}"
    return f(s), "extrapolated"


def markdown(report: dict[str, Any]) -> str:
    c, mach = report["config"], report["machine"]
    res = report["results"]
    lines = [
        "# Planning at scale",
        "",
        f"`{report['command']}` on {report['date']}: {mach['nproc']} CPUs, Python {mach['python']}, "
        f"numpy {mach['numpy']}. Manifest: {c['saved_ranks']} saved ranks x {c['tensors']} tensors "
        f"{c['dtype']} {tuple(report['manifest']['shape'])} ({report['manifest']['chunks']:,} chunks, built in "
        f"{report['manifest']['build_s']:.1f} s), block size {c['block_size']}; {c['target_ranks']} target ranks. "
        f"Seconds: median (min-max) over {c['repeats']} repeats; memory: tracemalloc peak of one more run.",
        "",
    ]
    notes = {
        "chunk_table": lambda r: f"table columns {r['table_bytes'] / MIB:.0f} MiB",
        "bulk_plan": lambda r: (
            f"{r['items']:,} items, {r['reads']:,} reads (max {r['max_reads_per_rank']}/rank), "
            f"read {r['read_bytes'] / 1e6:,.0f} MB for {r['needed_bytes'] / 1e6:,.0f} MB needed"
            + (" (per-item path!)" if r["per_item_path"] else "")
        ),
        "for_rank": lambda r: f"{r['items']:,} items in {r['reads']} reads",
        "per_item_plan": lambda r: (
            f"{r['seconds_per_rank']['median']:.3f} s/rank (median of ranks {r['sample_ranks']}); rank 0 with "
            f"the index build {r['first_rank_s']:.2f} s; equal to for_rank: {r['equals_bulk_for_rank']}"
        ),
        "save_plans": lambda r: "; ".join(
            f"{p['sample_ranks']} ranks {p['seconds']['median']:.2f} s" for p in r["samples"]
        ),
        "encode_manifest": lambda r: f"{r['json_bytes'] / 1e6:,.0f} MB stored",
        "decode_manifest": lambda r: f"RSS +{r['rss_after_bytes'] / MIB:,.0f} MiB held after",
        "chunk_table_decoded": lambda r: "one run, distinct objects per chunk",
    }
    rows = []
    for name, r in ((n, res[n]) for n in notes if n in res):
        mem = r.get("memory") or {}
        memory = [f"{mem[k] / MIB:,.0f}" if mem else "" for k in ("peak_bytes", "kept_bytes")]
        rows.append([r["label"], *fmt_s(r["seconds"]), *memory, notes[name](r)])
    lines += table(["step", "seconds", "min-max", "peak MiB", "kept MiB", "notes"], rows)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--saved-ranks", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--target-ranks", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-item-ranks", type=int, default=8, help="sampled ranks for create_load_plan")
    parser.add_argument("--save-sample-ranks", type=int, default=64, help="saved ranks given to create_save_plans")
    parser.add_argument("--codec-repeats", type=int, default=1, help="repeats of encode/decode_manifest")
    parser.add_argument("--codec-memory", action="store_true", help="also trace encode/decode memory (slow)")
    parser.add_argument("--no-codec", action="store_true", help="skip encode/decode_manifest")
    parser.add_argument("--out", default="bench_out/plan")
    args = parser.parse_args(argv)
    if min(args.repeats, args.codec_repeats, args.saved_ranks, args.target_ranks, args.tensors) < 1:
        parser.error("--repeats, --codec-repeats and the rank and tensor counts must be >= 1")

    t0 = time.perf_counter()
    report: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", "-m", "benchmarks.micro", "plan", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "config": {
            "saved_ranks": args.saved_ranks,
            "tensors": args.tensors,
            "target_ranks": args.target_ranks,
            "dtype": DTYPE,
            "block_size": args.block_size,
            "repeats": args.repeats,
            "codec_repeats": args.codec_repeats,
            "per_item_ranks": args.per_item_ranks,
            "save_sample_ranks": args.save_sample_ranks,
        },
        "machine": {
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "platform": platform.platform(),
            "mem_total_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
            "load_average_1min_before": os.getloadavg()[0],
        },
    }
    report.update(run(args))
    report["machine"]["load_average_1min_after"] = os.getloadavg()[0]
    report["total_runtime_s"] = time.perf_counter() - t0
    out = os.path.abspath(args.out)
    md = markdown(report)
    write_report(out, "bench_plan", report, md)
    print(md)
    print(f"[plan] total {report['total_runtime_s']:.0f}s; wrote {out}/bench_plan.json and bench_plan.md")
    return 0
