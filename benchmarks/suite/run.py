"""The benchmark suite: rayckpt against torch DCP, torch.save and the raw disk, on a local disk or on
an S3 endpoint, through one code path."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from typing import Any

from benchmarks.common.cli import parser
from benchmarks.common.harness import REPO_ROOT, SAMPLE_INTERVAL_S, load_sampled, new_report, write_report
from benchmarks.common.systems import Where
from benchmarks.common.workload import layer_shapes
from benchmarks.suite.ranks import load_report, load_worker, save_report, save_worker
from benchmarks.suite.report import MEM_BUFFER_BYTES, markdown, targets
from rayckpt.testing.multiproc import run_ranks

BUCKET = "rayckpt-bench"


def parse_reshards(text: str) -> list[tuple[int, int]]:
    """``"4:3,4->2"`` -> [(4, 3), (4, 2)]."""
    return [tuple(int(x) for x in p.strip().replace("->", ":").split(":")) for p in text.split(",")]  # type: ignore[misc]


def run_size(args: argparse.Namespace, size_mb: float, where: Where, address: str, samples: dict) -> dict[str, Any]:
    """One state size: the saves, then every reshard's loads (sources first), then its targets."""
    label, n0 = f"{size_mb:g}MB", args.save_ranks
    shapes = layer_shapes(size_mb)
    saves = ("rayckpt", "rayckpt_ray", "dcp", "dcp_async", "torch_save")
    rels = {s: f"{label}/n{n0}/{s}" for s in saves} | {"raw": f"{label}/raw", "warmup": f"{label}/warmup"}
    where.delete(label)
    t0 = time.perf_counter()
    cfg = {"where": where, "storage": args.storage, "rels": rels, "shapes": shapes, "repeats": args.repeats}
    cfg |= {
        "size_label": label,
        "ray_address": address,
        "verify": not args.no_verify,
        "mem_interval": args.mem_interval_ms / 1000,
    }
    print(f"[suite] {label}: saving with {n0} ranks, {args.repeats} repeat(s)", flush=True)
    saved = run_ranks(save_worker, n0, cfg, timeout=args.timeout)
    total = saved[0]["state_bytes"]
    result: dict[str, Any] = {"size_mb": size_mb, "state_bytes": total, "layer_shapes_rows_cols": shapes}
    result |= {"save_ranks": n0, "memcpy_GBps_1thread": saved[0].get("memcpy_GBps_1thread")}
    result |= {"save": save_report(saved, total), "on_disk": {}, "load": {}}
    samples[label] = {"save": saved}
    for system in saves if where.endpoint is None else ():
        files = where.files(rels[system])
        if files:
            result["on_disk"][system] = {"bytes": sum(os.path.getsize(f) for f in files), "files": len(files)}
    where.delete(rels["rayckpt_ray"])  # measured; not loaded
    where.delete(rels["dcp_async"])
    print(f"[suite] {label}: saves done in {time.perf_counter() - t0:.0f}s", flush=True)

    reshards = reshards_for(args, size_mb)
    ck = {n0: {"rayckpt": rels["rayckpt"], "dcp": rels["dcp"], "torch_save": rels["torch_save"]}}
    needed = {n for n, _ in reshards if n != n0}
    order = sorted(reshards, key=lambda nm: (nm[0] != n0, nm[1] not in needed))
    for i, (n, m) in enumerate(order):
        name = f"{n}->{m}"
        if n not in ck:
            raise SystemExit(f"reshard {name}: no {n}-rank checkpoint; N must be {n0} or the M of a reshard from {n0}")
        sources = {k: v for k, v in ck[n].items() if k != "torch_save" or (m == 1 and where.endpoint is None)}
        lcfg = {**cfg, "sources": sources, "checksums": saved[0]["checksums"]}
        if m in needed and m not in ck:
            ck[m] = lcfg["resave"] = {s: f"{label}/n{m}/{s}" for s in ("rayckpt", "dcp")}
        t1 = time.perf_counter()
        loaded = run_ranks(load_worker, m, lcfg, timeout=args.timeout)
        result["load"][name] = load_report(loaded, total)
        samples[label][name] = loaded
        print(f"[suite] {label}: load {name} done in {time.perf_counter() - t1:.0f}s", flush=True)
        if where.endpoint is not None and all(later[0] != n for later in order[i + 1 :]):
            for rel in ck[n].values():
                where.delete(rel)  # the server holds objects in memory: free what no later load reads
    result["load"] = {f"{n}->{m}": result["load"][f"{n}->{m}"] for n, m in reshards}
    main_reshard = f"{n0}->3" if f"{n0}->3" in result["load"] else next(iter(result["load"]), "")
    result["targets"] = targets(result, main_reshard, args.storage)
    result["runtime_s"] = time.perf_counter() - t0
    if not args.keep:
        where.delete(label)
    return result


def reshards_for(args: argparse.Namespace, size_mb: float) -> list[tuple[int, int]]:
    """``--reshards``, or this size's ``--reshards-at SIZE=N:M,...``."""
    for spec in args.reshards_at:
        size, _, text = spec.partition("=")
        if float(size) == size_mb:
            return parse_reshards(text)
    return parse_reshards(args.reshards)


def run_plan_bench(spec: str, out: str, repeats: int) -> dict[str, Any]:
    """``benchmarks.micro plan`` at ``spec`` (SAVEDxTENSORSxTARGET) in its own process; its report."""
    saved, tensors, target = spec.lower().split("x")
    cmd = [sys.executable, "-m", "benchmarks.micro", "plan", "--saved-ranks", saved, "--tensors", tensors]
    subprocess.run([*cmd, "--target-ranks", target, "--repeats", str(repeats), "--out", out], check=True, cwd=REPO_ROOT)
    with open(os.path.join(out, "bench_plan.json")) as f:
        report = json.load(f)
    with open(os.path.join(out, "bench_plan.md")) as f:
        report["markdown"] = f.read()
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, "suite", markdown=True)
    p.add_argument(
        "--storage",
        choices=("local", "s3"),
        default="local",
        help="local: a local directory; s3: a local S3 endpoint (moto) (default: %(default)s)",
    )
    p.add_argument("--sizes-mb", default="256,1024", help="state sizes in MiB (params + AdamW moments)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--save-ranks", type=int, default=4)
    p.add_argument("--reshards", default="4:3,4:2,2:4,4:1", help="N:M load reshards")
    p.add_argument("--reshards-at", action="append", default=[], help="SIZE=N:M,... : other reshards for one size")
    p.add_argument("--mem-interval-ms", type=float, default=SAMPLE_INTERVAL_S * 1000, help="RSS sampling period")
    p.add_argument("--no-verify", action="store_true", help="skip the bit-exact check of the first loads")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints under --out (local)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per group of ranks")
    p.add_argument("--plan-scale", default="1024x2000x1000", help="planning, SAVEDxTENSORSxTARGET ('none': skip)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.storage == "s3" and args.out == p.get_default("out"):
        args.out = "bench_out/s3"
    args.out = os.path.abspath(args.out)
    return args


def s3_endpoint(stack: ExitStack, args: argparse.Namespace) -> tuple[Any, dict[str, str]]:
    """moto's server behind the counting middleware, stopped when ``stack`` closes; its versions."""
    from importlib.metadata import version

    from rayckpt.testing.s3_server import S3_ENV, start_moto_server

    os.environ.update(S3_ENV)  # before ray.init: Ray's workers inherit the credentials
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    server = start_moto_server(
        os.path.join(args.out, "moto.log"),
        BUCKET,
        module="benchmarks.suite.s3_counter",
        env={"PYTHONPATH": path},
    )
    stack.callback(server.stop)
    return server.endpoint, {n: version(n) for n in ("moto", "s3fs", "aiobotocore", "fsspec")}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    sizes = [float(x) for x in args.sizes_mb.split(",") if x.strip()]
    os.makedirs(args.out, exist_ok=True)
    name = "bench_suite" if args.storage == "local" else "bench_s3"
    import ray

    report = new_report("benchmarks.suite", argv, storage=args.storage, sizes={})
    report["config"] = {
        "sizes_mb": sizes,
        "repeats": args.repeats,
        "save_ranks": args.save_ranks,
        "memory_sample_interval_s": args.mem_interval_ms / 1000,
        "memory_target_buffer_bytes": MEM_BUFFER_BYTES,
    }
    samples: dict[str, Any] = {}
    with ExitStack() as stack, load_sampled(report):
        versions: dict[str, str] = {}
        where = Where(args.out)
        if args.storage == "s3":
            endpoint, versions = s3_endpoint(stack, args)
            where = Where(args.out, endpoint)
        report["machine"].update(versions)
        # A cluster of its own (address="local"), even where someone else's was started with `ray start`.
        ray.init(
            address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING
        )
        stack.callback(ray.shutdown)
        address = ray.get_runtime_context().gcs_address
        for size_mb in sizes:
            result = run_size(args, size_mb, where, address, samples)
            report["sizes"][f"{size_mb:g}MB"] = result
            print(f"[suite] {size_mb:g}MB done in {result['runtime_s']:.0f}s", flush=True)
    if args.storage == "local" and args.plan_scale.lower() != "none":
        report["plan"] = run_plan_bench(args.plan_scale, args.out, args.repeats)
    report["samples"] = samples
    md = markdown(report)
    write_report(args.out, name, report, md, args.markdown)
    print(md)
    print(f"[suite] total {report['total_runtime_s']:.0f}s; wrote {args.out}/{name}.json, .md")
    return 0
