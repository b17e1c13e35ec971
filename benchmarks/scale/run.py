"""Thousands of ranks, metadata only: rayckpt side by side with DCP, each library's own code on the
metadata a save of a GPT with AdamW makes (``--tensors`` float32 tensors, FSDP2 dim-0 shards over N
ranks), no tensor data. Each step runs in a fresh process; figures are its CPU seconds, steps under a
second the median of 5 runs. "One rank without Ray": a rank's plan from the slice rank 0 scattered
to it (it reads no manifest). DCP past ``--budget-s`` is timed on samples and extrapolated ("est.",
how: below the tables); a manifest step that would not fit in memory samples the tensors."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import cli
from benchmarks.common.harness import REPO_ROOT, load_sampled, new_report, profiled, repeated, write_report
from benchmarks.scale import layout as lay
from benchmarks.scale.report import fit_exponents, markdown, targets
from rayckpt.format.chunk_columns import ChunkColumns
from rayckpt.planning.bulk import create_dim0_plans
from rayckpt.planning.chunk_table import ChunkTable
from rayckpt.planning.rank_slice import slice_plan
from rayckpt.planning.save_columns import ShardLayout, assign_writers, digest
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import commit_manifest, create_manifest, read_manifest

#: Tensors of each shape timed for DCP's estimated global save plan.
SHAPE_SAMPLE = 4
STEPS = ("rayckpt_commit", "rayckpt_load", "rayckpt_save_plan", "dcp_commit", "dcp_load", "dcp_save_plan")


def targets_of(n: int) -> list[int]:
    """The reshard targets of N saved ranks: N-1 and N/2."""
    return sorted({max(1, n - 1), max(1, n // 2)}, reverse=True)


def rayckpt_commit(layout: lay.Layout, n: int, work: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    spec, shards = lay.rayckpt_save_inputs(layout, n)
    out: dict[str, Any] = {"build_s": time.perf_counter() - t0}
    # What the committer runs on every save: the validated manifest of every rank's chunks, then its
    # encoding, written atomically.
    out["create_manifest"], manifest = profiled(lambda: create_manifest(spec, shards))
    shards.clear()  # the commit needs only the manifest
    directory = os.path.join(work, f"rayckpt-{n}")
    out["commit"], _ = profiled(lambda: commit_manifest(CheckpointDir.resolve(directory), manifest))
    out["files"] = lay.metadata_bytes(directory)
    out["metadata_bytes"] = sum(out["files"].values())
    out["chunks"] = sum(len(e.chunks) for e in manifest.entries.values() if hasattr(e, "chunks"))
    return out


def rayckpt_load(layout: lay.Layout, n: int, work: str) -> dict[str, Any]:
    """Read, then the whole job's plans as rank 0 makes them (table, bulk plan, every rank's slice), one
    rank's part of the bulk plan (on Ray) and one rank's plan from its slice (without Ray)."""
    out: dict[str, Any] = {"targets": {}}
    out["read"], manifest = profiled(lambda: read_manifest(CheckpointDir.resolve(os.path.join(work, f"rayckpt-{n}"))))
    out["chunk_table"], table = profiled(lambda: ChunkTable.from_manifest(manifest))
    for m in targets_of(n):
        rank = m // 2
        t = out["targets"][m] = {"rank": rank}
        # Every target rank's plan at once, as the MetadataActor plans on Ray.
        t["bulk_plan"], bulk = profiled(
            lambda m=m, table=table: create_dim0_plans(manifest, lay.specs(layout), m, table=table)
        )
        t["for_rank"], for_rank = repeated(lambda bulk=bulk, rank=rank: bulk.for_rank(rank))
        # Without Ray: rank 0 slices the bulk plan; each rank builds its plan from its slice.
        t["slices"], slices = profiled(
            lambda bulk=bulk: slice_plan(bulk, lay.specs(layout), (), ChunkColumns.from_manifest(manifest))
        )
        mine = slices[rank]
        t["slice_bytes"] = mine.nbytes
        t["from_slice"], from_slice = repeated(lambda mine=mine: mine.plan(lay.specs(layout)))
        t["reads"], t["from_slice_equals_for_rank"] = len(from_slice.reads), from_slice == for_rank
        del bulk, slices, mine

    return out


def rayckpt_save_plan(layout: lay.Layout, n: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    shards = lay.rayckpt_local_shards(layout, n)
    out: dict[str, Any] = {"build_s": time.perf_counter() - t0}
    layouts = [ShardLayout.from_shards(own) for own in shards]  # made on each rank, in parallel
    # Rank 0's part of an uncached save plan: which rank writes each distinct (key, box).
    out["save_plan"], assignment = profiled(lambda: assign_writers(layouts))
    out["write_items"] = sum(len(w) for w in assignment.written)
    # The next save of the same layout: each rank hashes its own layout, rank 0 compares the digest of
    # every rank's hash with the one the first save cached; a hit reuses the cached plan.
    hashes = [ShardLayout.from_shards(own).digest() for own in shards]
    cached = digest(*hashes)
    out["cached_save_plan"], hit = repeated(lambda: digest(*hashes) == cached)
    assert hit
    return out


def dcp_commit(layout: lay.Layout, n: int, work: str) -> dict[str, Any]:
    from benchmarks.scale import dcp

    directory = os.path.join(work, f"dcp-{n}")
    os.makedirs(directory, exist_ok=True)
    t0 = time.perf_counter()
    metadata = dcp.build_metadata(layout, n, directory)
    out: dict[str, Any] = {"build_s": time.perf_counter() - t0, "chunks": dcp.metadata_chunks(metadata)}
    out["write"], _ = profiled(lambda: dcp.write_metadata(directory, metadata))
    out["files"] = lay.metadata_bytes(directory)
    out["metadata_bytes"] = sum(out["files"].values())
    return out


def dcp_load(layout: lay.Layout, n: int, work: str, budget_s: float, samples: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

    from benchmarks.scale import dcp

    out: dict[str, Any] = {"targets": {}}
    out["read"], metadata = profiled(lambda: dcp.read_metadata(os.path.join(work, f"dcp-{n}")))

    def rank_plan(m: int, rank: int) -> tuple[dict[str, float], int, float]:
        """Rank ``rank``'s plan among ``m``: its figures, read items, and the wall seconds it all took."""
        t0 = time.perf_counter()
        with dcp.fake_world(m, rank) as mesh:
            state = dcp.target_state(layout, mesh)
            stats, plan = profiled(lambda: create_default_local_load_plan(state, metadata, strict=True))
        return stats, len(plan.items), time.perf_counter() - t0

    for m in targets_of(n):
        rank = m // 2
        stats, items, wall = rank_plan(m, rank)
        t: dict[str, Any] = {"rank": rank, "rank_plan": stats, "read_items": items}
        if wall * m <= budget_s:  # the DTensors of each rank are built too: the wall seconds decide
            timed = {r: rank_plan(m, r)[0]["cpu_s"] for r in range(m) if r != rank}
            timed[rank] = stats["cpu_s"]
            t["whole_job"] = {"cpu_s": sum(timed.values()), "estimated": False, "method": f"all {m} ranks, summed"}
        else:
            ranks = sorted({(2 * i + 1) * m // (2 * samples) for i in range(samples)})  # each group's middle
            timed = {r: rank_plan(m, r)[0]["cpu_s"] for r in ranks}
            method = f"median of ranks {ranks} x {m} ranks"
            t["whole_job"] = {"cpu_s": statistics.median(timed.values()) * m, "estimated": True, "method": method}
            t["whole_job"]["sample"] = timed
        out["targets"][m] = t
    return out


def dcp_save_plan(layout: lay.Layout, n: int, budget_s: float) -> dict[str, Any]:
    from benchmarks.scale import dcp

    out: dict[str, Any] = {"per_shape": []}
    # What a call costs whatever the tensors (N plans to dedup, merge and validate): counted once.
    plans = dcp.local_save_plans(layout.subset([]), n)
    out["fixed"], _ = profiled(lambda: dcp.global_plan(plans))
    estimate = out["fixed"]["cpu_s"]
    for shape, indices in layout.by_shape().items():
        sample = indices[:SHAPE_SAMPLE]
        plans = dcp.local_save_plans(layout.subset(sample), n)
        stats, _ = profiled(lambda plans=plans: dcp.global_plan(plans))
        out["per_shape"].append({"shape": list(shape), "tensors": len(indices), "timed": len(sample), **stats})
        estimate += max(0.0, stats["cpu_s"] - out["fixed"]["cpu_s"]) * len(indices) / len(sample)
    del plans
    out["estimate_s"] = estimate
    if estimate <= budget_s:
        plans = dcp.local_save_plans(layout, n)
        out["uncached"], _ = profiled(lambda: dcp.global_plan(plans))
        out["uncached"]["estimated"] = False
    else:
        method = f"up to {SHAPE_SAMPLE} tensors of each shape timed at once, less a call on empty plans, x its "
        method += "tensors / those, summed, plus that call"
        out["uncached"] = {"cpu_s": estimate, "estimated": True, "method": method}
        plans = dcp.local_save_plans(layout.subset([0]), n)
    dcp.clear_plan_cache()
    if estimate <= budget_s / 2:
        dcp.global_plan(plans, caching=True)  # the first cached save: the uncached plan, then stored
    else:  # what the first save would store; the cached path does not look inside it
        dcp.hydrate_plan_cache(plans)
    out["cached"], _ = repeated(lambda: dcp.global_plan([dcp.SavePlan([], usable=False)] * n, caching=True))
    dcp.clear_plan_cache()
    return out


def run_step(step: str, layout: lay.Layout, n: int, work: str, args: argparse.Namespace) -> dict[str, Any]:
    """One step in this process (the worker; the unit test calls it directly at tiny N)."""
    return {
        "rayckpt_commit": lambda: rayckpt_commit(layout, n, work),
        "rayckpt_load": lambda: rayckpt_load(layout, n, work),
        "rayckpt_save_plan": lambda: rayckpt_save_plan(layout, n),
        "dcp_commit": lambda: dcp_commit(layout, n, work),
        "dcp_load": lambda: dcp_load(layout, n, work, args.budget_s, args.dcp_sample_ranks),
        "dcp_save_plan": lambda: dcp_save_plan(layout, n, args.budget_s),
    }[step]()


def proc_bytes(path: str, field: str) -> int:
    """A figure of a /proc file in kB (``VmHWM:`` of /proc/self/status, ``MemAvailable:``...), in bytes."""
    with open(path) as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def worker(args: argparse.Namespace) -> int:
    full = lay.gpt_layout(args.tensors)
    layout = lay.sampled(full, args.tensor_stride) if args.tensor_stride > 1 else full
    import torch  # noqa: F401  (imported by both sides; outside every step's figures)

    from benchmarks.scale import dcp  # noqa: F401

    base = proc_bytes("/proc/self/status", "VmHWM:")
    t0 = time.perf_counter()
    result = run_step(args.worker, layout, args.n, args.work, args)
    result.update(
        step_wall_s=time.perf_counter() - t0, process_peak_extra_rss=proc_bytes("/proc/self/status", "VmHWM:") - base
    )
    if layout is not full:
        chunks = {"chunks": lay.chunk_count(layout, args.n), "full_chunks": lay.chunk_count(full, args.n)}
        result["sampled"] = {"stride": args.tensor_stride, "tensors": layout.tensors, **chunks}
        result["scale"] = result["sampled"]["full_chunks"] / result["sampled"]["chunks"]
    with open(args.result, "w") as f:
        json.dump(result, f, indent=1)
    return 0


#: Peak bytes per chunk of the manifest steps' processes (as measured at 1,024 ranks), to decide when to sample.
BYTES_PER_CHUNK = {"rayckpt": 900, "dcp": 2200}
GIB = 2**30


def tensor_stride(system: str, n: int, args: argparse.Namespace) -> int:
    """1, or the stride of tensors a system's manifest steps sample when the whole would not fit in memory."""
    need = BYTES_PER_CHUNK[system] * lay.chunk_count(lay.gpt_layout(args.tensors), n)
    room = min(args.max_gib * GIB, proc_bytes("/proc/meminfo", "MemAvailable:") - 3 * GIB)
    return max(1, int(-(-need // max(room, GIB))))


def run_all(args: argparse.Namespace, report: dict[str, Any]) -> None:
    work = os.path.abspath(args.work)
    for n in args.ranks:
        per_n = report["results"].setdefault(str(n), {})
        strides = {system: tensor_stride(system, n, args) for system in BYTES_PER_CHUNK}
        for step in STEPS:
            if step in per_n:
                continue
            path = os.path.join(args.out, f"bench_scale.{n}.{step}.json")
            cmd = [sys.executable, "-m", "benchmarks.scale", "--worker", step, "--n", str(n)]
            if not step.endswith("save_plan"):
                cmd += ["--tensor-stride", str(strides[step.split("_")[0]])]
            cmd += ["--tensors", str(args.tensors), "--work", work, "--result", path]
            cmd += ["--budget-s", str(args.budget_s), "--dcp-sample-ranks", str(args.dcp_sample_ranks)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
            if proc.returncode:
                per_n[step] = {"error": proc.stderr[-2000:]}
                print(f"[scale] N={n} {step} FAILED:\n{proc.stderr[-2000:]}", flush=True)
            else:
                with open(path) as f:
                    per_n[step] = json.load(f)
                os.remove(path)
            print(f"[scale] N={n} {step} {time.perf_counter() - t0:.0f}s", flush=True)
            finish(report, args, echo=False)
        shutil.rmtree(work, ignore_errors=True)


def finish(report: dict[str, Any], args: argparse.Namespace, echo: bool = True) -> int:
    """Fits, targets and the result files of what was measured so far (a run cut short keeps them)."""
    report["fits"] = fit_exponents(report)
    report["targets"] = targets(report)
    return write_report(args, "bench_scale", report, markdown(report), echo)


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__, "scale")
    parser.add_argument("--ranks", default="64,256,1024,4096", help="comma-separated saved rank counts")
    parser.add_argument("--tensors", type=int, default=1992)
    parser.add_argument("--budget-s", type=float, default=120.0, help="longest a DCP step runs before sampling")
    parser.add_argument("--dcp-sample-ranks", type=int, default=3, help="ranks timed for an estimated DCP job")
    parser.add_argument("--max-gib", type=float, default=12.0, help="memory a manifest step may use (else sampled)")
    parser.add_argument("--tensor-stride", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--work", default="/tmp/rayckpt-bench-scale", help="where the metadata files go")
    parser.add_argument("--worker", choices=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    args = cli.parse(parser, argv)
    args.ranks = [int(x) for x in args.ranks.split(",")]
    if min(args.ranks) < 2 or args.tensors < 1:
        parser.error("--ranks must be >= 2 and --tensors >= 1")
    config = {k: getattr(args, k) for k in ("ranks", "tensors", "budget_s", "dcp_sample_ranks", "max_gib")}
    config |= {"block_size": lay.rayckpt_block_size(lay.gpt_layout(args.tensors)), "model": lay.GPT_SHAPE}
    report = new_report("benchmarks.scale", argv, __doc__, config=config, results={})
    with load_sampled(report):
        run_all(args, report)
    try:
        from benchmarks.scale.plot import write_plot

        write_plot(report, os.path.join(args.out, "bench_scale.png"))
    except Exception as exc:  # the figures stand without the plot
        print(f"[scale] no plot: {exc}", flush=True)
    return finish(report, args)
