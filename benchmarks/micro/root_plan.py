"""A load without Ray, N -> M: rank 0's whole-job planning and one rank's, on the scale benchmark's layout.

Synthetic metadata only (``scale.layout``: the 55-layer GPT's 1,992 float32 tensors
with AdamW, dim-0 sharded over ``--saved-ranks``; ``--stride`` keeps every k-th
tensor of each shape), loaded by ``--target-ranks`` FSDP2 ranks. No processes:
each step is timed (CPU seconds) in this one, as the rank that runs it would.
Reading the manifest is not included (``python -m benchmarks.scale`` measures it).

- rank 0: ``ChunkColumns.from_manifest`` with the block checksums (reported apart:
  a manifest read from its stored chunk table has them for free), ``ChunkTable.from_manifest`` +
  ``create_dim0_plans`` (the whole-job plan), ``slice_plan`` (every rank's slice of
  it), and pickling every slice (what ``scatter_object_list`` sends);
  ``root_s`` = table + bulk plan + slicing + pickle. With ``--repeat k``, the row
  with the least ``root_s`` of k runs (the first run in a process also pays for
  the memory the process had not touched yet).
- one rank (``--rank``, default the middle one): unpickle its slice and build its
  ``LoadPlan`` (``rank_s``); its ask's pickled size; with ``--check``, its plan is
  compared with ``create_load_plan``'s, whose time is the ``before`` column (what
  every rank did alone, besides decoding the whole manifest).

    .venv/bin/python -m benchmarks.micro root-plan --saved-ranks 1024 --target-ranks 512 1023

Prints a markdown table; ``--out DIR`` also writes ``DIR/bench_root_plan.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from typing import Any

from benchmarks.scale import layout as S
from rayckpt.format.chunk_columns import ChunkColumns
from rayckpt.planning.bulk import create_dim0_plans
from rayckpt.planning.chunk_table import ChunkTable
from rayckpt.planning.load_plan import TensorRequest, dim0_box
from rayckpt.planning.rank_slice import LoadAsk, slice_plan


def cpu() -> float:
    return time.process_time()


def measure(manifest: Any, layout: S.Layout, world: int, rank: int, check: bool) -> dict[str, Any]:
    specs = [(k, S.DTYPE, s) for k, s in zip(layout.keys, layout.shapes, strict=True)]
    t0 = cpu()
    cols = ChunkColumns.from_manifest(manifest, checksums=True)
    t1 = cpu()
    table = ChunkTable.from_manifest(manifest, cols)
    t2 = cpu()
    bulk = create_dim0_plans(manifest, specs, world, table=table)
    t3 = cpu()
    slices = slice_plan(bulk, specs, (), cols)
    t4 = cpu()
    assert slices is not None, "the layout is dim-0: every rank gets a slice"
    sent = [pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL) for s in slices]
    t5 = cpu()
    mine = pickle.loads(sent[rank])
    plan = mine.plan(specs)
    t6 = cpu()
    requests = [TensorRequest(k, d, s, dim0_box(s, world, rank)) for k, d, s in specs]
    ask = LoadAsk.of(requests, (), True, rank, world)
    out: dict[str, Any] = {
        "target_ranks": world,
        "columns_s": t1 - t0,
        "table_s": t2 - t1,
        "bulk_s": t3 - t2,
        "whole_job_plan_s": t3 - t1,
        "slices_s": t4 - t3,
        "pickle_s": t5 - t4,
        "root_s": t5 - t1,
        "scatter_bytes": sum(map(len, sent)),
        "rank": rank,
        "rank_s": t6 - t5,
        "rank_bytes": len(sent[rank]),
        "ask_bytes": len(pickle.dumps(ask)),
        "items": sum(len(r.items) for r in plan.reads),
    }
    assert plan == bulk.for_rank(rank), "the slice's plan differs from for_rank's"
    if check:
        t0 = cpu()
        own = S.rayckpt_rank_plan(manifest, layout, world, rank)
        out["before_s"] = cpu() - t0
        assert plan == own, "the slice's plan differs from create_load_plan's"
    return out


def table(saved: int, tensors: int, rows: list[dict[str, Any]]) -> str:
    head = (
        f"saved ranks {saved}, tensors {tensors}; CPU seconds\n\n"
        "| N -> M | columns | table + bulk plan | slicing | pickle | rank 0 total (first run) | scattered MB "
        "| one rank: build plan | its slice KB | its ask B | items | before (create_load_plan) |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    lines = [
        f"| {saved} -> {r['target_ranks']} | {r['columns_s']:.2f} | {r['whole_job_plan_s']:.3f} | "
        f"{r['slices_s']:.3f} | {r['pickle_s']:.3f} | {r['root_s']:.3f} ({r.get('first_root_s', r['root_s']):.3f}) | "
        f"{r['scatter_bytes'] / 1e6:.1f} | "
        f"{r['rank_s']:.4f} | {r['rank_bytes'] / 1e3:.0f} | {r['ask_bytes']} | {r['items']} | "
        f"{r.get('before_s', float('nan')):.3f} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--saved-ranks", type=int, default=256)
    p.add_argument("--target-ranks", type=int, nargs="+", default=None, help="default: N - 1 and N / 2")
    p.add_argument("--tensors", type=int, default=1992)
    p.add_argument("--stride", type=int, default=1, help="keep every k-th tensor of each shape")
    p.add_argument("--rank", type=int, default=None, help="the receiving rank timed (default: the middle one)")
    p.add_argument("--check", action="store_true", help="compare with create_load_plan (slow at scale)")
    p.add_argument("--repeat", type=int, default=1, help="runs per N -> M; the fastest is reported")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    n = args.saved_ranks
    layout = S.gpt_layout(args.tensors)
    if args.stride > 1:
        layout = S.sampled(layout, args.stride)
    spec, shards = S.rayckpt_save_inputs(layout, n)
    manifest = S.rayckpt_create_manifest(spec, shards)
    del shards
    rows = []
    for m in args.target_ranks or [max(n - 1, 1), max(n // 2, 1)]:
        rank = m // 2 if args.rank is None else min(args.rank, m - 1)
        runs = [measure(manifest, layout, m, rank, args.check and not i) for i in range(args.repeat)]
        rows.append(min(runs, key=lambda r: r["root_s"]))
        rows[-1].update(first_root_s=runs[0]["root_s"], **{k: v for k, v in runs[0].items() if k == "before_s"})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(n, layout.tensors, rows))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_root_plan.json"), "w") as f:
            json.dump({"saved_ranks": n, "tensors": layout.tensors, "rows": rows}, f, indent=1)
    return 0
