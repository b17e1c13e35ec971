"""Load planning at scale, no I/O: the bulk planner on a synthetic manifest of dim-0 shards.

Every tensor is saved dim-0 sharded by ``--saved-ranks`` ranks, one shard file per saved
rank; the ``ChunkEntry`` objects are built directly (no save, no files). Timed over
``--repeats``: the chunk table, every target rank's plan (``create_dim0_plans``) and one
rank's plan (``BulkPlan.for_rank``); memory is ``tracemalloc``'s peak of one more run.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from benchmarks.common import cli
from benchmarks.common.harness import MIB, new_report, sampled, table, write_report
from rayckpt.format.manifest import ChunkEntry, FileEntry, Manifest, TensorEntry
from rayckpt.planning.bulk import create_dim0_plans
from rayckpt.planning.chunk_table import ChunkTable
from rayckpt.planning.load_plan import dim0_boxes

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
            chunk = ChunkEntry(
                box=boxes[r], file=files[r], byte_offset=pos[r], byte_length=lengths[r], checksums=checksums[r]
            )
            chunks.append(chunk)
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    n, m, reps = args.saved_ranks, args.target_ranks, args.repeats
    t0 = time.perf_counter()
    manifest = build_manifest(n, args.tensors, args.rows, args.cols, args.block_size)
    built_s = time.perf_counter() - t0
    chunks = sum(len(e.chunks) for e in manifest.entries.values())
    specs = [(k, DTYPE, (args.rows, args.cols)) for k in manifest.entries]
    steps: dict[str, Callable[[], Any]] = {"chunk_table": lambda: ChunkTable.from_manifest(manifest)}
    chunk_table = steps["chunk_table"]()
    steps["bulk_plan"] = lambda: create_dim0_plans(manifest, specs, m, table=chunk_table)
    bulk = steps["bulk_plan"]()
    steps["for_rank"] = lambda: bulk.for_rank(0)
    labels = {
        "chunk_table": "ChunkTable.from_manifest",
        "bulk_plan": f"create_dim0_plans, all {m} target ranks",
        "for_rank": "BulkPlan.for_rank (rank 0)",
    }
    results = {}
    for name, fn in steps.items():
        secs, _ = sampled(fn, reps)
        results[name] = {"label": labels[name], "seconds": secs, "memory": peak_memory(fn)}
        print(f"[plan] {labels[name]}: {secs['median']:.3f} s", flush=True)
    results["bulk_plan"].update(
        per_item_path=bulk.per_item,
        items=bulk.num_items_total,
        reads=int(bulk.num_reads.sum()),
        read_bytes=int(bulk.read_bytes.sum()),
        needed_bytes=int(bulk.needed_bytes.sum()),
    )
    return {"manifest": {"chunks": chunks, "build_s": built_s, "shape": [args.rows, args.cols]}, "results": results}


def markdown(report: dict[str, Any]) -> str:
    c, man = report["config"], report["manifest"]
    lines = [
        "# Planning at scale",
        "",
        f"`{report['command']}` on {report['date']}: {report['machine']['nproc']} CPUs. Manifest: "
        f"{c['saved_ranks']} saved ranks x {c['tensors']} tensors {DTYPE} {tuple(man['shape'])} "
        f"({man['chunks']:,} chunks, built in {man['build_s']:.1f} s), block size {c['block_size']}; "
        f"{c['target_ranks']} target ranks. Seconds: median (min-max) over {c['repeats']} repeats; memory: "
        "tracemalloc peak of one more run.",
        "",
    ]
    rows = []
    for r in report["results"].values():
        s, mem = r["seconds"], r["memory"]
        note = ""
        if "reads" in r:
            note = f"{r['items']:,} items, {r['reads']:,} reads, read {r['read_bytes'] / 1e6:,.0f} MB for "
            note += f"{r['needed_bytes'] / 1e6:,.0f} MB needed" + (" (per-item path!)" if r["per_item_path"] else "")
        rows.append(
            [
                r["label"],
                f"{s['median']:.3f}",
                f"{s['min']:.3f}-{s['max']:.3f}",
                f"{mem['peak_bytes'] / MIB:,.0f}",
                f"{mem['kept_bytes'] / MIB:,.0f}",
                note,
            ]
        )
    lines += table(["step", "seconds", "min-max", "peak MiB", "kept MiB", "notes"], rows)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__, "plan")
    parser.add_argument("--saved-ranks", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--target-ranks", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if min(args.repeats, args.saved_ranks, args.target_ranks, args.tensors) < 1:
        parser.error("--repeats and the rank and tensor counts must be >= 1")
    report = new_report("benchmarks.micro plan", argv, config={k: v for k, v in vars(args).items() if k != "out"})
    report.update(run(args))
    md = markdown(report)
    write_report(args.out, "bench_plan", report, md)
    print(md)
    return 0
