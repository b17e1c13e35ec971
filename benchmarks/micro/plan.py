"""Load planning at scale, no I/O: the bulk planner on a synthetic manifest of dim-0 shards.

Every tensor is saved dim-0 sharded by ``--saved-ranks`` ranks, one shard file per saved
rank; the manifest is made as a save commits it, from synthetic shards (no tensor data, no files). Timed over
``--repeats``: the chunk table, every target rank's plan (``create_dim0_plans``) and one
rank's plan (``BulkPlan.for_rank``): wall and CPU seconds, median (min-max), and the peak RSS above
the RSS before each.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.common import cli
from benchmarks.common.harness import document, mib, new_report, repeated, table, timed, write_report
from benchmarks.scale.layout import Layout, rayckpt_save_inputs
from rayckpt.planning.bulk import create_dim0_plans
from rayckpt.planning.chunk_table import ChunkTable
from rayckpt.storage.commit import create_manifest

DTYPE = "float32"


def build_manifest(saved_ranks: int, tensors: int, rows: int, cols: int, block_size: int) -> Any:
    """The synthetic manifest: ``tensors`` (rows, cols) tensors, each dim-0 sharded over the saved ranks, a
    file per rank, made as a save commits it (``benchmarks.scale.layout``'s shards, ``create_manifest``)."""
    keys = tuple(f"layers.{t}.weight" for t in range(tensors))
    layout = Layout(keys, tuple(("layers", str(t), "weight") for t in range(tensors)), ((rows, cols),) * tensors)
    return create_manifest(*rayckpt_save_inputs(layout, saved_ranks, block_size))


def run(args: argparse.Namespace) -> dict[str, Any]:
    n, m = args.saved_ranks, args.target_ranks
    built_s, manifest = timed(lambda: build_manifest(n, args.tensors, args.rows, args.cols, args.block_size))
    specs = [(k, DTYPE, (args.rows, args.cols)) for k in manifest.entries]
    results: dict[str, Any] = {}
    stats, table = repeated(lambda: ChunkTable.from_manifest(manifest), args.repeats)
    results["chunk_table"] = {"label": "ChunkTable.from_manifest", **stats}
    stats, bulk = repeated(lambda: create_dim0_plans(manifest, specs, m, table=table), args.repeats)
    results["bulk_plan"] = {"label": f"create_dim0_plans, all {m} target ranks", **stats}
    results["bulk_plan"] |= {"per_item_path": bulk.per_item, "items": bulk.num_items_total}
    results["bulk_plan"] |= {"reads": int(bulk.num_reads.sum()), "read_bytes": int(bulk.read_bytes.sum())}
    results["bulk_plan"]["needed_bytes"] = int(bulk.needed_bytes.sum())
    stats, _ = repeated(lambda: bulk.for_rank(0), args.repeats)
    results["for_rank"] = {"label": "BulkPlan.for_rank (rank 0)", **stats}
    chunks = sum(len(e.chunks) for e in manifest.entries.values())
    return {"manifest": {"chunks": chunks, "build_s": built_s, "shape": [args.rows, args.cols]}, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__, "plan")
    parser.add_argument("--saved-ranks", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--target-ranks", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=3)
    args = cli.parse(parser, argv)
    if min(args.repeats, args.saved_ranks, args.target_ranks, args.tensors) < 1:
        parser.error("--repeats and the rank and tensor counts must be >= 1")
    config = {k: v for k, v in vars(args).items() if k != "out"}
    report = new_report("benchmarks.micro plan", argv, __doc__, config=config, **run(args))
    rows = [
        {"step": r["label"], "wall s": r["wall"], "CPU s": r["cpu"], "peak MiB": mib(r["peak_extra_rss"])}
        | ({"items": r["items"], "reads": r["reads"], "per-item path": r["per_item_path"]} if "items" in r else {})
        for r in report["results"].values()
    ]
    return write_report(args, "bench_plan", report, document("Planning at scale", report, table(rows)))
